"""Bit-identical resume: stop, restore in a fresh process, continue = uninterrupted run."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import forkpoint as fp
import procs


def _train(repo, log, steps, every=5, extra=()):
    subprocess.run([sys.executable, "-m", "forkpoint.cli.demo", "train", "--repo", repo, "--log", log,
                    "--steps", str(steps), "--every", str(every), *extra], check=True, timeout=procs.CHILD_SECONDS)


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    ref, cut = str(tmp_path / "ref"), str(tmp_path / "cut")
    _train(ref, str(tmp_path / "ref.jsonl"), 41)
    _train(cut, str(tmp_path / "cut.jsonl"), 23)
    assert fp.Repo(cut).version("main").step == 20
    _train(cut, str(tmp_path / "cut.jsonl"), 41)
    a, b = fp.Repo(ref), fp.Repo(cut)
    assert a.version("main").step == b.version("main").step == 40
    ta, tb = a.load("main"), b.load("main")
    for part in ("model", "optim", "sched", "rng", "data"):
        flat_a = {leaf.path: leaf.digest for leaf in a.manifest("main").leaves if leaf.path.startswith(part)}
        flat_b = {leaf.path: leaf.digest for leaf in b.manifest("main").leaves if leaf.path.startswith(part)}
        assert flat_a == flat_b, part
    assert ta["sched"] == tb["sched"] and ta["data"] == tb["data"]
    for k in ta["model"]:
        assert torch.equal(ta["model"][k], tb["model"][k])
    la, lb = _losses(str(tmp_path / "ref.jsonl")), _losses(str(tmp_path / "cut.jsonl"))
    assert la == lb and len(la) == 41


def test_checkpointer_async_and_time_policy(repo):
    model = torch.nn.Linear(64, 64)
    ck = fp.Checkpointer(repo, {"model": model}, every=3)
    pending = [ck.step(s) for s in range(7)]
    assert [p is not None for p in pending] == [True, False, False, True, False, False, True]
    ck.wait_capture()
    with torch.no_grad():
        model.weight.zero_()
    last = ck.close() or ck.last_version
    assert [v.step for v in repo.log()] == [6, 3, 0]
    assert not torch.equal(repo.load()["model"]["weight"], model.weight), "captured before the mutation"
    ck2 = fp.Checkpointer(repo, {"model": model}, every=fp.EverySeconds(3600), branch="timed")
    assert ck2.step(0) is None
    ck2._last_save -= 3601
    assert ck2.step(1) is not None
    ck2.close()
    assert repo.version("timed").step == 1
    assert last is not None
    with pytest.raises(RuntimeError, match="Checkpointer of branch 'timed' is closed"):
        ck2.step(3)
    with pytest.raises(RuntimeError, match="is closed"):
        ck2.save(4)
    ck2.close()
    assert repo.version("timed").step == 1, "nothing saved after close"


def test_resume_on_empty_branch_starts_at_zero(repo):
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=1)
    assert ck.resume() == 0
    ck.step(0)
    ck.close()
    assert fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=1).resume() == 1


def test_resuming_a_branch_with_a_model_of_another_shape_says_how_to_start_anew(repo):
    """The architecture changed between runs: resume names the mismatch and the two ways on
    (another branch, or carrying parts over), and the branch keeps its versions."""
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(4, 3)}, every=1)
    ck.resume()
    ck.step(0)
    ck.close()
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(5, 3)}, every=1)
    with pytest.raises(fp.errors.StateMismatchError) as e:
        ck.resume()
    message = str(e.value)
    assert message.startswith("resume of branch 'main': cannot restore version"), message
    assert "m/weight: stored shape [3, 4], live [3, 5]" in message
    assert "save on another branch (fp.Checkpointer(..., branch='...'))" in message
    assert [v.step for v in repo.log()] == [0]
    wider = fp.Checkpointer(repo, {"m": torch.nn.Linear(5, 3)}, every=1, branch="wider")
    assert wider.resume() == 0
    wider.close()


def _flip_object_of(repo, ref, path):
    """Flip one byte in the object that holds leaf `path` of `ref` (it must be its own object)."""
    leaf = next(leaf for leaf in repo.manifest(ref).leaves if leaf.path == path)
    digest = leaf.chunks[0].objects[0]
    target = next(pathlib.Path(repo.url, "objects").rglob(digest + "*"))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    return digest


def test_resume_skips_a_damaged_head_for_the_newest_intact_version(repo):
    """One flipped byte in the head's object: resume restores the version before it with a
    warning naming the skipped version and why; fall_back=False raises; repair with branch reset."""
    model = torch.nn.Linear(256, 256)
    ck = fp.Checkpointer(repo, {"model": model}, every=1, sync=True)
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.step(step)
    ck.close()
    good = repo.load("main~1")["model"]["weight"].clone()
    head = repo.resolve("main")
    _flip_object_of(repo, "main", "model/weight")
    fresh = torch.nn.Linear(256, 256)
    with pytest.warns(fp.ResumeWarning, match=rf"from {repo.resolve('main~1')[:12]} \(step 1\), skipping 1 newer "
                                              rf"damaged version\(s\): {head[:12]} \(step 2\)"):
        start = fp.Checkpointer(fp.Repo(repo.url), {"model": fresh}, every=1).resume()
    assert start == 2 and torch.equal(fresh.weight, good)
    with pytest.raises(fp.errors.CorruptObjectError):
        fp.Checkpointer(fp.Repo(repo.url), {"model": torch.nn.Linear(256, 256)}, every=1).resume(fall_back=False)


def test_resume_with_every_version_damaged_says_so(repo):
    model = torch.nn.Linear(256, 256)
    repo.save({"model": model}, step=0)
    _flip_object_of(repo, "main", "model/weight")
    with pytest.raises(fp.errors.CorruptObjectError, match="no version of branch 'main' could be restored intact") as e:
        fp.Checkpointer(fp.Repo(repo.url), {"model": model}, every=1).resume()
    assert "rebuild the model and optimizer" in str(e.value) and "restore reads into" not in str(e.value)


def test_a_restore_stopped_by_damage_says_the_live_tensors_may_hold_part_of_it(repo):
    """restore fills live tensors in place: when a damaged object stops it, the error names the
    tensors it had begun filling and the ways on, and no object's load_state_dict ran (the
    optimizer keeps its own hyperparameters); a load, which fills nothing live, says nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    v = repo.save({"model": model, "opt": opt})
    _flip_object_of(repo, "main", "model/1.weight")
    live = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    live_opt = torch.optim.SGD(live.parameters(), lr=0.5)
    with pytest.raises(fp.errors.CorruptObjectError) as e:
        fp.Repo(repo.url).restore({"model": live, "opt": live_opt})
    first, second = str(e.value).split("\n")
    assert "leaf 'model/" in first and "does not match its hash" in first
    assert second.startswith("  restore reads into the live tensors in place, so 4 of them (model/0.bias, "
                             "model/0.weight, model/1.bias, model/1.weight) may now hold part of")
    assert f"part of version {v.id} (no load_state_dict was called)" in second and "forkpoint verify" in second
    assert live_opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(fp.errors.CorruptObjectError) as e:
        fp.Repo(repo.url).load("main")
    assert "\n" not in str(e.value)


FINISHING_SCRIPT = """
import sys, warnings, torch, forkpoint as fp
warnings.simplefilter("always")
model = torch.nn.Linear(4, 4)
ck = fp.Checkpointer(fp.Repo(sys.argv[1], create=True), {"model": model}, every=10)
start = ck.resume()
for step in range(start, 25):
    ck.wait_capture()  # the write below is not optimizer.step(): the hooks do not see it
    with torch.no_grad():
        model.weight.add_(1.0)
    print("trained", step, flush=True)
    ck.step(step)
ck.close(final_step=step if start < 25 else None)
"""


def test_close_saves_the_final_step_and_a_rerun_of_a_finished_run_says_so(tmp_path):
    """The README loop: the last step is saved at close, and running the finished script again
    trains nothing and says the run is finished."""
    url = str(tmp_path / "repo")
    script = tmp_path / "train.py"
    script.write_text(FINISHING_SCRIPT)
    first = procs.run([sys.executable, str(script), url], timeout=procs.CHILD_SECONDS)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("trained") == 25
    repo = fp.Repo(url)
    assert [v.step for v in repo.log()] == [24, 20, 10, 0]
    assert repo.version("main").meta["final"] is True
    again = procs.run([sys.executable, str(script), url], timeout=procs.CHILD_SECONDS)
    assert again.returncode == 0, again.stderr
    assert "trained" not in again.stdout
    assert "branch 'main' finished at step 24" in again.stderr
    assert [v.step for v in fp.Repo(url).log()] == [24, 20, 10, 0], "nothing saved again"


def test_close_does_not_save_a_final_step_twice(repo):
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=5)
    for step in range(10):
        ck.step(step)
    ck.close(final_step=9)
    ck.close(final_step=9)
    assert [v.step for v in repo.log()] == [9, 5, 0]


def test_close_warns_of_steps_trained_after_the_newest_save(repo):
    ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=100)
    for step in range(250):
        ck.step(step)
    with pytest.warns(UserWarning, match=r"with steps 201\.\.249 trained after its newest save \(step 200\): "
                      r"no version holds them\. Pass ck\.close\(final_step=249\)"):
        ck.close()
    assert [v.step for v in repo.log()] == [200, 100, 0]


def test_close_is_quiet_when_nothing_trained_goes_unsaved(repo):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=5)
        for step in range(11):
            ck.step(step)
        ck.close()                                  # step 10 was the newest save
        ck = fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=5, branch="manual")
        for step in range(3):
            ck.step(step)
        ck.save(2)
        ck.close()
        with pytest.raises(ZeroDivisionError):      # a loop that raised is not done: no advice
            with fp.Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, every=5, branch="raised") as ck:
                for step in range(3):
                    ck.step(step)
                1 / 0


def test_continuing_a_fork_is_not_a_restart(repo):
    model = torch.nn.Linear(4, 4)
    ck = fp.Checkpointer(repo, {"model": model}, every=1, sync=True)
    ck.step(0)
    ck.close()
    repo.fork("main", "exp")
    ck = fp.Checkpointer(repo, {"model": model}, every=1, sync=True, branch="exp")
    ck.step(ck.resume())
    ck.close()
    meta = repo.version("exp").meta
    assert meta.get("forked_from") == repo.resolve("main")
    assert "restarts" not in meta and "lost_seconds" not in meta
    ck = fp.Checkpointer(repo, {"model": model}, every=1, sync=True, branch="exp")
    ck.step(ck.resume())
    ck.close()
    assert repo.version("exp").meta["restarts"] == 1, "a resume of the fork's own version is a restart"


def _steps(ck, steps, model):
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.step(step)


def test_a_loop_that_ignores_resumes_step_is_warned_once(repo):
    """The run resumed at step 5 but its loop starts at 0 again: the first step() says so and
    how to loop, once; the versions it saves are still made (the run is the user's)."""
    model = torch.nn.Linear(2, 2)
    ck = fp.Checkpointer(repo, {"model": model}, every=2, sync=True)
    _steps(ck, range(5), model)
    ck.close()
    again = fp.Checkpointer(fp.Repo(repo.url), {"model": model}, every=2, sync=True)
    assert again.resume() == 5
    with pytest.warns(fp.ResumeWarning) as caught:
        _steps(again, range(4), model)
    again.close()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("Checkpointer.step(0) on branch 'main' goes back to steps the run already passed")
    assert "resume() restored step 4 (and returned 5)" in message and "range(ck.resume(), ...)" in message
    assert [v.step for v in repo.log()][:3] == [2, 0, 4]


def test_a_branch_continued_without_resume_or_a_step_going_back_is_warned(repo):
    model = torch.nn.Linear(2, 2)
    ck = fp.Checkpointer(repo, {"model": model}, every=2, sync=True)
    _steps(ck, range(3), model)
    ck.close()
    head = repo.version("main")
    blind = fp.Checkpointer(fp.Repo(repo.url), {"model": model}, every=2, sync=True)
    with pytest.warns(fp.ResumeWarning, match=rf"branch 'main' already holds step 2 \(version {head.id[:12]}\) "
                                              r"and was not resumed: call resume\(\) first"):
        _steps(blind, [1], model)
    blind.close()

    other = fp.Checkpointer(fp.Repo(repo.url), {"model": model}, every=100, sync=True, branch="other")
    with pytest.warns(fp.ResumeWarning, match=r"step\(3\) on branch 'other' goes back .*: step\(7\) came before it"):
        _steps(other, [5, 7, 7, 3], model)
    other.close()


def test_a_resumed_loop_from_resumes_step_warns_nothing(repo):
    """The README's loop, and a step repeated (a gradient-accumulation loop calling step()
    per micro-batch with the same global step), are not warned."""
    import warnings

    model = torch.nn.Linear(2, 2)
    ck = fp.Checkpointer(repo, {"model": model}, every=2, sync=True)
    _steps(ck, range(3), model)
    ck.close()
    again = fp.Checkpointer(fp.Repo(repo.url), {"model": model}, every=2, sync=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp.ResumeWarning)
        start = again.resume()
        _steps(again, [start, start, start + 1, start + 1], model)
    again.close()
