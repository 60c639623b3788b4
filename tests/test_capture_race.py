"""An in-place write that the capture hooks do not guard, landing while an asynchronous save
copies the tensor, fails that save (StateChangedError) instead of committing a later or torn
state; a Checkpointer then warns once and copies the state at each save.

Each test holds the save's copy at a gate until the write is done, so the race is certain."""

import threading
import warnings

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.engine import chunksave, save as engine_save
from forkpoint.errors import StateChangedError


class Gate:
    """Holds the first call of `module.name` until `release()`; `started` is set when it arrives."""

    def __init__(self, monkeypatch, module, name):
        self.started, self._open, self._real, self._first = threading.Event(), threading.Event(), getattr(module, name), True
        monkeypatch.setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        if self._first:
            self._first = False
            self.started.set()
            assert self._open.wait(60), "the gate was never released"
        return self._real(*args, **kwargs)

    def release(self):
        self._open.set()


def test_a_write_during_the_copy_fails_that_save_and_commits_nothing(tmp_path, monkeypatch):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    w = torch.zeros(1 << 20)
    first = repo.save({"w": w, "step": 0}, step=0)
    gate = Gate(monkeypatch, chunksave, "stream_copy")
    pending = repo.save({"w": w, "step": 1}, step=1, sync=False)
    assert gate.started.wait(60)
    w.add_(1)                                     # not optimizer.step(): no hook waits
    gate.release()
    with pytest.raises(StateChangedError, match=r"'w' changed while an asynchronous save was copying it") as e:
        pending.wait()
    assert e.value.paths == ["w"] and "wait_capture()" in str(e.value)
    assert [v.id for v in repo.log()] == [first.id]
    assert repo.verify().ok
    after = repo.save({"w": w, "step": 1}, step=1, sync=False).wait()  # the repository goes on
    assert torch.equal(repo.load(after.id)["w"], torch.ones(1 << 20))
    repo.close()


def test_small_leaves_packed_together_are_checked_too(tmp_path, monkeypatch):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    state = {"a": torch.zeros(16), "b": torch.zeros(16), "n": 3}
    gate = Gate(monkeypatch, engine_save, "content_hash")
    pending = repo.save(state, step=0, sync=False)
    assert gate.started.wait(60)
    state["b"].fill_(7)
    gate.release()
    with pytest.raises(StateChangedError, match=r"^'b' changed"):
        pending.wait()
    assert not repo.branches()
    repo.close()


def test_a_write_after_wait_capture_is_fine(tmp_path, monkeypatch):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    w = torch.zeros(1 << 20)
    pending = repo.save({"w": w}, step=0, sync=False)
    pending.wait_capture()
    w.add_(1)
    assert torch.equal(repo.load(pending.wait().id)["w"], torch.zeros(1 << 20))
    repo.close()


def test_a_checkpointer_warns_once_and_then_copies_at_each_save(tmp_path, monkeypatch):
    """A manual update loop (no optimizer): the held save of step 0 is lost, named in one
    warning; every later save is committed and holds exactly its step's values."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    w = torch.zeros(1 << 20)
    ck = fp.Checkpointer(repo, {"w": w}, every=1)
    gate = Gate(monkeypatch, chunksave, "stream_copy")
    held = ck.step(0)
    assert gate.started.wait(60)
    with torch.no_grad():
        w.add_(1)
    gate.release()
    with pytest.raises(StateChangedError):
        held.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            ck.step(step)
            with torch.no_grad():
                w.add_(1)                          # no wait_capture(): the Checkpointer copied already
        ck.close()
    lost = [str(c.message) for c in caught if "was not committed" in str(c.message)]
    assert len(lost) == 1 and lost[0].startswith("the save of step 0 on branch 'main' was not committed: 'w' changed")
    assert "ck.wait_capture()" in lost[0]
    log = repo.log()
    assert [v.step for v in log] == [5, 4, 3, 2, 1]
    for v in log:
        assert torch.equal(repo.load(v.id)["w"], torch.full((1 << 20,), float(v.step))), v.step
    repo.close()


def test_the_optimizer_hook_waits_so_nothing_is_lost(tmp_path, monkeypatch):
    """optimizer.step() waits for the copy it would overwrite: no failure, no warning."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1)
    gate = Gate(monkeypatch, chunksave, "stream_copy")
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            model(torch.randn(4, 1024)).sum().backward()
            if step == 1:
                assert gate.started.wait(60)       # step 0's copy is held; step() must wait for it
                threading.Timer(0.2, gate.release).start()
            opt.step()
            opt.zero_grad()
            expected[step] = model.weight.detach().clone()
            ck.step(step)
        ck.close()
    assert [v.step for v in repo.log()] == [2, 1, 0]
    for v in repo.log():
        assert torch.equal(repo.load(v.id)["model"]["weight"], expected[v.step])
    repo.close()


def test_inference_tensors_save_asynchronously(tmp_path):
    """They keep no write counter (and cannot be written outside inference mode)."""
    with torch.inference_mode():
        t = torch.randn(1 << 20)
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    assert torch.equal(repo.load(repo.save({"t": t}, sync=False).wait().id)["t"], t)
    repo.close()


def test_a_checkpointer_copies_numpy_arrays_before_step_returns(tmp_path, monkeypatch):
    """numpy counts no writes, so a simulation's in-place update right after step() must not
    reach the version: step() returns only once the arrays are copied."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    u = np.zeros(1 << 20, dtype=np.float32)
    ck = fp.Checkpointer(repo, {"u": u, "small": np.zeros(8)}, every=1)
    for step in range(3):
        u[:] = step
        ck.state["small"][:] = step
        gate = Gate(monkeypatch, chunksave, "stream_copy")
        threading.Timer(0.5, gate.release).start()  # step() waits for the held copy, so the gate opens by itself
        ck.step(step)
        assert gate.started.is_set()
        u[:] = 100 + step                           # in place, as a stencil update writes
        ck.state["small"][:] = 100 + step
        gate.release()
    ck.close()
    assert [v.step for v in repo.log()] == [2, 1, 0]
    for v in repo.log():
        tree = repo.load(v.id)
        assert np.array_equal(tree["u"], np.full(1 << 20, v.step, dtype=np.float32)), v.step
        assert np.array_equal(tree["small"], np.full(8, float(v.step))), v.step
    repo.close()


def test_small_numpy_arrays_packed_with_tensors_are_copied_before_step_returns(tmp_path, monkeypatch):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    a = np.zeros(16)
    ck = fp.Checkpointer(repo, {"a": a, "t": torch.zeros(16)}, every=1)
    gate = Gate(monkeypatch, engine_save, "content_hash")
    threading.Timer(0.5, gate.release).start()
    ck.step(0)
    assert gate.started.is_set()
    a[:] = 1
    gate.release()
    ck.close()
    assert np.array_equal(repo.load("main")["a"], np.zeros(16))
    repo.close()


def test_tensors_beside_numpy_arrays_stay_asynchronous(tmp_path, monkeypatch):
    """Only the arrays are waited for: step() returns while a tensor's copy is still held."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    w = torch.zeros(1 << 20)
    ck = fp.Checkpointer(repo, {"w": w, "u": np.zeros(16)}, every=1)
    gate = Gate(monkeypatch, chunksave, "stream_copy")
    ck.step(0)
    assert gate.started.wait(60) and not ck._pending[0][1].captured()
    gate.release()
    ck.close()
    assert torch.equal(repo.load("main")["w"], w)
    repo.close()


def test_a_numpy_copy_in_the_state_is_not_waited_for(tmp_path):
    """A big-endian or strided array is copied when described, so nothing aliases it."""
    from forkpoint.state.leaves import numpy_leaf

    assert numpy_leaf(np.zeros(4), "a", copy=False).unwatched
    assert not numpy_leaf(np.zeros(8)[::2], "a", copy=False).unwatched
    assert not numpy_leaf(np.zeros(4, dtype=">f8"), "a", copy=False).unwatched
    assert not numpy_leaf(np.zeros(4), "a", copy=True).unwatched


def test_a_write_racing_a_packed_numpy_copy_cannot_misname_its_bytes(tmp_path, monkeypatch):
    """Without a Checkpointer nothing waits, but a small array's bytes are hashed from their
    copy: the pack never names bytes by another state's hash, which a later save would reuse."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    a = np.zeros(16)
    gate = Gate(monkeypatch, engine_save, "content_hash")
    pending = repo.save({"a": a, "t": torch.zeros(16)}, sync=False)
    assert gate.started.wait(60)
    a[:] = 1                                        # against the contract: before wait_capture()
    gate.release()
    first = pending.wait()
    again = repo.save({"a": np.zeros(16)})         # dedups against what the first save named
    assert np.array_equal(repo.load(first.id)["a"], np.zeros(16))
    assert np.array_equal(repo.load(again.id)["a"], np.zeros(16))
    assert repo.verify().ok
    repo.close()
