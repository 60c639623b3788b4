"""fp.ResumableLoader: a resume goes on at the first sample the loop did not see, with worker
processes fetching ahead, another batch size, drop_last and a distributed sampler."""

import gc
import os
import select
import signal
import subprocess
import sys

import pytest
import torch

import forkpoint as fp
import procs

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "helpers"))
from loader_run import Indices  # noqa: E402


def _epochs(loader, epochs: int) -> list[int]:
    """Every index `loader` yields over `epochs` epochs, uninterrupted."""
    return [i for _ in range(epochs) for batch in loader for i in batch.tolist()]


def _run(url, loader, stop_after: int | None, until_epoch: int) -> list[int]:
    """Resume `loader` from the repository at `url`, then use batches until `stop_after` of them
    (or epoch `until_epoch`), saving after each; the indices used."""
    ck = fp.Checkpointer(fp.Repo(url, create=True), {"data": loader}, every=1)
    step, seen = ck.resume(), []
    while loader.epoch < until_epoch and (stop_after is None or len(seen) < stop_after):
        for batch in loader:
            seen.append(batch.tolist())
            ck.step(step)
            step += 1
            if len(seen) == stop_after:
                break
    ck.close()
    return [i for b in seen for i in b]


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_resume_mid_epoch_sees_each_sample_once(tmp_path, workers, persistent):
    """Workers fetch four batches ahead of the loop; the resume starts at the loop's count."""
    def loader():
        return fp.ResumableLoader(Indices(), batch_size=4, shuffle=True, seed=1, num_workers=workers,
                                  persistent_workers=persistent)
    expected = _epochs(loader(), 2)
    first = _run(str(tmp_path / "r"), loader(), stop_after=3, until_epoch=2)
    gc.collect()  # the first loader's workers go before the second forks its own
    rest = _run(str(tmp_path / "r"), loader(), stop_after=None, until_epoch=2)
    assert first + rest == expected
    assert sorted(expected[:37]) == list(range(37))


def test_a_plain_dataloader_over_the_sampler_skips_what_workers_fetched():
    """Why the loader exists: the sampler alone records what it handed the workers."""
    sampler = fp.ResumableSampler(37, seed=1)
    it = iter(torch.utils.data.DataLoader(Indices(), batch_size=4, sampler=sampler, num_workers=2))
    next(it), next(it)
    assert sampler.state_dict()["position"] > 8
    del it


def test_resume_with_another_batch_size_and_drop_last(tmp_path):
    """Positions count samples: 3 batches of 4, then batches of 6 from sample 12 on, the one
    sample left over dropped; a resume after the epoch's last batch ends that epoch."""
    url = str(tmp_path / "r")
    sampler = fp.ResumableSampler(37, seed=2)
    first = _run(url, fp.ResumableLoader(Indices(), batch_size=4, shuffle=True, seed=2), 3, 1)
    rest = _run(url, fp.ResumableLoader(Indices(), batch_size=6, shuffle=True, seed=2, drop_last=True), None, 1)
    assert first == sampler.order(0)[:12].tolist()
    assert rest == sampler.order(0)[12:36].tolist()
    ck = fp.Checkpointer(fp.Repo(url), {"data": fp.ResumableLoader(Indices(), batch_size=6, drop_last=True,
                                                                   shuffle=True, seed=2)}, every=1)
    ck.resume()
    loader = ck.state["data"]
    assert loader.epoch == 0 and list(loader) == [] and loader.epoch == 1
    assert next(iter(loader)).tolist() == sampler.order(1)[:6].tolist()
    ck.close()


def test_end_of_epoch_and_epoch_counter(tmp_path):
    loader = fp.ResumableLoader(Indices(), batch_size=10)
    batches = list(loader)
    assert [len(b) for b in batches] == [10, 10, 10, 7] and loader.epoch == 1
    assert loader.state_dict()["position"] == 0
    it = iter(loader)
    next(it)
    assert loader.state_dict() == {**loader.state_dict(), "epoch": 1, "position": 10}
    assert len(it) == 4


def test_a_sampler_state_restores_into_the_loader(tmp_path):
    """A version saved with the sampler in the state resumes a loader over it."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    sampler = fp.ResumableSampler(37, seed=5)
    it = iter(sampler)
    for _ in range(6):
        next(it)
    repo.save({"data": sampler}, step=0)
    loader = fp.ResumableLoader(Indices(), batch_size=3, shuffle=True, seed=5)
    repo.restore({"data": loader}, "main")
    assert next(iter(loader)).tolist() == sampler.order(0)[6:9].tolist()
    with pytest.raises(fp.errors.StateMismatchError, match="saved over 37 items"):
        repo.restore({"data": fp.ResumableLoader(list(range(40)))}, "main")
    repo.close()


def test_distributed_sampler_counts_the_global_position():
    """Each rank's loader advances the global position by the world's batches."""
    sampler = fp.dist.DistributedResumableSampler(37, seed=3, rank=1, world=2)
    loader = fp.ResumableLoader(Indices(), batch_size=4, sampler=sampler, num_workers=2)
    it = iter(loader)
    got = next(it).tolist() + next(it).tolist()
    assert got == sampler.order(0)[1:16:2].tolist()
    assert loader.state_dict()["consumed"] == 16 and sampler.state_dict() != loader.state_dict()  # ran ahead
    resumed = fp.ResumableLoader(Indices(), batch_size=4,
                                 sampler=fp.dist.DistributedResumableSampler(37, seed=3, rank=0, world=1))
    resumed.load_state_dict(loader.state_dict())
    assert next(iter(resumed)).tolist() == sampler.order(0)[16:20].tolist()
    del it


def test_refuses_what_it_cannot_count():
    with pytest.raises(TypeError, match="records its position"):
        fp.ResumableLoader(Indices(), sampler=torch.utils.data.RandomSampler(Indices()))
    with pytest.raises(TypeError, match="not batch_sampler"):
        fp.ResumableLoader(Indices(), batch_sampler=[[0, 1]])
    with pytest.raises(ValueError, match="give the sampler shuffle=True"):
        fp.ResumableLoader(Indices(), shuffle=True, sampler=fp.ResumableSampler(37))


def test_iterating_draws_nothing_from_the_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(fp.ResumableLoader(Indices(), batch_size=8, num_workers=2))
    assert torch.equal(torch.get_rng_state(), before)


def test_sigkill_mid_epoch_resumes_at_the_next_unseen_batch(tmp_path):
    """A real run with two workers, killed while they had batches fetched ahead: the batches
    each step used, after the resume, are those of a run never killed."""
    url, script = str(tmp_path / "r"), os.path.join(HERE, "helpers", "loader_run.py")
    steps = 25
    proc = subprocess.Popen([sys.executable, script, url, str(steps), "4", "2"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines = []
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], procs.CHILD_SECONDS)
        line = proc.stdout.readline() if ready else ""
        assert line, f"the run ended or stalled before its second commit: {lines}"
        lines.append(line.split())
        if line.split() == ["committed", "10"]:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = procs.run([sys.executable, script, url, str(steps), "4", "2"], timeout=procs.CHILD_SECONDS)
    assert again.returncode == 0, again.stderr
    used = {}
    for words in lines + [line.split() for line in again.stdout.splitlines()]:
        if words[0] == "step":
            used[int(words[1])] = [int(w) for w in words[2:]]
    reference = fp.ResumableLoader(Indices(), batch_size=4, shuffle=True, seed=7)
    expected = [b.tolist() for _ in range(3) for b in reference][:steps]
    assert [used[s] for s in range(steps)] == expected
    assert int(again.stdout.split()[1]) > 10  # it resumed past the kill, not from the start


@pytest.mark.parametrize("make", [lambda ds: torch.utils.data.DataLoader(ds, batch_size=2),
                                  lambda ds: torch.utils.data.RandomSampler(ds),
                                  lambda ds: iter(torch.utils.data.DataLoader(ds))])
def test_a_plain_dataloader_in_the_state_points_to_the_loader(tmp_path, make):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    with pytest.raises(fp.errors.UnsupportedTypeError, match=r"build fp.ResumableLoader\(dataset"):
        repo.save({"data": make(Indices())}, step=0)
    with pytest.raises(fp.errors.UnsupportedTypeError, match="give it state_dict"):
        repo.save({"data": Indices()}, step=0)  # a dataset is not a position
    repo.close()
