"""Wrong arguments to the newer entry points get clear errors."""

import pytest
import torch

import forkpoint as fp
from forkpoint.engine import Budget, Scheduler
from forkpoint.errors import RefNotFoundError
from forkpoint.policy.interval import YoungDaly, young_daly


def test_tier_and_repo_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 1"):
        fp.tier(str(tmp_path / "a"), keep=0)
    with pytest.raises(ValueError, match="flush_every must be >= 1"):
        fp.tier(str(tmp_path / "a"), flush_every=0)
    with pytest.raises(ValueError, match="at least one store"):
        fp.Repo(tiers=[], create=True)
    with pytest.raises(ValueError, match="either url or tiers"):
        fp.Repo(str(tmp_path / "a"), tiers=[str(tmp_path / "b")], create=True)
    with pytest.raises(ValueError, match="needs a url"):
        fp.Repo()
    with pytest.raises(ValueError, match="on_conflict"):
        fp.Repo(str(tmp_path / "a"), create=True, on_conflict="maybe")
    with pytest.raises(TypeError, match="keep must be an int, got '2'"):
        fp.tier(str(tmp_path / "a"), keep="2")
    with pytest.raises(TypeError, match="flush_every must be an int, got 2.5"):
        fp.tier(str(tmp_path / "a"), flush_every=2.5)


@pytest.mark.parametrize("second", ["{d}/a", "{d}/./a/", "file://{d}/a", "{d}/link"])
def test_a_store_given_twice_as_tiers_is_refused(tmp_path, second):
    """The same store as two tiers would lose versions: evicting from the fast one deletes the
    manifest the slow one is meant to keep."""
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="are the same store"):
        fp.Repo(tiers=[fp.tier(str(tmp_path / "a"), keep=1), second.format(d=tmp_path)], create=True)
    with pytest.raises(ValueError, match="are the same store"):
        fp.Repo(tiers=["mem://same", str(tmp_path / "b"), "mem://same"], create=True)
    repo = fp.Repo(tiers=[fp.tier(str(tmp_path / "a"), keep=1), str(tmp_path / "a" / "below")], create=True)
    ids = [repo.save({"w": torch.full((1000,), float(i))}, step=i).id for i in range(3)]
    repo.close()
    assert [fp.Repo(str(tmp_path / "a" / "below")).load(i)["w"][0].item() for i in ids] == [0.0, 1.0, 2.0]


def test_prefetch_and_where_of_unknown_refs(tmp_path):
    repo = fp.Repo(tiers=[f"mem://{tmp_path.name}", str(tmp_path / "d")], create=True)
    with pytest.raises(RefNotFoundError):
        repo.prefetch(["nosuch"])
    with pytest.raises(RefNotFoundError):
        repo.where("main")
    repo.close()


def test_policy_arguments(repo):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=">= 1 step"):
        fp.Checkpointer(repo, {"m": model}, every=0)
    with pytest.raises(TypeError, match="not a bool"):
        fp.Checkpointer(repo, {"m": model}, every=True)
    with pytest.raises(TypeError, match="should_save"):
        fp.Checkpointer(repo, {"m": model}, every=object())
    with pytest.raises(ValueError, match="max_fraction"):
        YoungDaly(max_fraction=1.5)
    with pytest.raises(ValueError, match="mtbf"):
        YoungDaly(mtbf=-1)
    with pytest.raises(ValueError, match="> 0"):
        young_daly(0.0, 10.0)
    with pytest.raises(ValueError, match="seconds"):
        fp.EverySeconds(0)
    with pytest.raises(ValueError, match="Keep"):
        fp.Keep(best=("loss", 1, "sideways"))


def test_scheduler_rejects_unknown_resources_and_late_submissions():
    sched = Scheduler(Budget(), threads=1)
    with pytest.raises(ValueError, match="unknown resource 'gpu'"):
        sched.submit("x", lambda: 1, priority=0, needs={"gpu": 1})
    assert sched.submit("x", lambda: 1, priority=0, needs={"io:any": 1}).result(5) == 1
    sched.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        sched.submit("x", lambda: 1, priority=0)


def test_save_and_checkpointer_fields_are_checked(tmp_path):
    """A version's step, message, metrics and meta are what resume, retention and log rely on:
    wrong types are refused before anything is written, integer scalars are taken."""
    import numpy as np

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    for bad, match in [({"step": "3"}, "step must be an int or None, got str '3'"),
                       ({"step": 1.5}, "step must be an int"), ({"step": True}, "step must be an int"),
                       ({"message": 5}, "message must be a str"),
                       ({"metrics": [1, 2]}, "metrics must be a dict"), ({"meta": "x"}, "meta must be a dict")]:
        with pytest.raises(TypeError, match=match):
            repo.save({"a": 1}, **bad)
    assert repo.branches() == {}, "nothing was committed"
    v = repo.save({"a": 1}, step=np.int64(7))
    assert v.step == 7 and type(v.step) is int
    assert repo.save({"a": 2}, step=torch.tensor(8)).step == 8
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs an fp.Repo, got str"):
        fp.Checkpointer(str(tmp_path / "r"), {"m": model}, every=1)
    with pytest.raises(TypeError, match="keep must be fp.Keep"):
        fp.Checkpointer(repo, {"m": model}, every=1, keep="3")
    with pytest.raises(ValueError, match="every= takes a step count, 'auto'"):
        fp.Checkpointer(repo, {"m": model}, every="5")
    ck = fp.Checkpointer(repo, {"m": model}, every=1, keep=2, sync=True)
    assert ck.keep == fp.Keep(last=2)
    with pytest.raises(TypeError, match="step must be an int or None, got str"):
        ck.step("9")
    for step in range(9, 13):
        ck.step(step)
    ck.close()
    assert [(v.step, v.pruned) for v in repo.log()][:4] == [(12, False), (11, False), (10, True), (9, True)]


def test_repository_options_are_savefield_names_given_once(tmp_path):
    with pytest.raises(TypeError, match="unknown option.s. codek: a repository takes SaveOptions' fields"):
        fp.Repo(tmp_path / "r", create=True, codek="lossless")
    with pytest.raises(TypeError, match="delta must be True, False, None or fp.Delta"):
        fp.Repo(tmp_path / "r", create=True, delta="yes")
    repo = fp.Repo(tmp_path / "r", create=True, options=fp.SaveOptions(chunk_bytes=1 << 20), codec="lossless",
                   delta=True)
    assert (repo.options.chunk_bytes, repo.options.codec) == (1 << 20, "lossless")
    assert isinstance(repo.options.delta, fp.Delta)
    repo.close()


def test_a_repository_url_nothing_can_serve_is_named_with_what_to_do(tmp_path):
    """An unknown scheme, a backend that is not installed and a path under a file each get a
    StoreUnavailableError naming the repository and what to give instead."""
    import importlib.util

    from forkpoint.errors import StoreUnavailableError

    with pytest.raises(StoreUnavailableError, match=r"htps://x/run: no storage backend serves htps://"):
        fp.Repo("htps://x/run", create=True)
    if importlib.util.find_spec("dropboxdrivefs") is None:
        with pytest.raises(StoreUnavailableError, match=r"dropbox:// backend is not installed"):
            fp.Repo("dropbox://x/run", create=True)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(StoreUnavailableError, match=rf"cannot open repository {afile}/run: Not a directory"):
        fp.Repo(str(afile / "run"), create=True)
    with pytest.raises(StoreUnavailableError, match="cannot create a repository at /proc/forkpoint-run"):
        fp.Repo("/proc/forkpoint-run", create=True)
    assert afile.read_text() == "not a directory"


def test_a_repository_another_process_creates_first_is_opened(tmp_path):
    """create=True racing another creator: the marker appears between the look and the
    exclusive create, and the repository the other process made is opened and used."""
    from forkpoint.storage import LocalStore

    url = str(tmp_path / "r")

    class CreatedMeanwhile(LocalStore):
        looked = False

        def read(self, key):
            if key == "forkpoint.json" and not self.looked:
                self.looked = True
                fp.Repo(url, create=True).close()  # the other process, between look and create
                raise FileNotFoundError(key)
            return super().read(key)

    repo = fp.Repo(CreatedMeanwhile(url), create=True)
    repo.save({"x": torch.ones(2)})
    assert torch.equal(fp.Repo(url).load()["x"], torch.ones(2))
    repo.close()


def test_a_map_location_load_cannot_honour_is_refused_before_reading(tmp_path):
    """A dtype or number is not a place, a device string torch does not parse is named, and a
    device this machine lacks (given directly: before reading; in a dict: at the leaf that goes
    there) says to load on the CPU; the good forms still load."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.save({"w": torch.arange(4.0)})
    with pytest.raises(TypeError, match="map_location=torch.float16 is not a device"):
        repo.load("main", map_location=torch.float16)
    with pytest.raises(ValueError, match="map_location='gpu' is not a device torch knows"):
        repo.load("main", map_location="gpu")
    with pytest.raises(TypeError, match="map_location=0 is not a device"):
        repo.restore({"w": torch.zeros(4)}, "main", map_location=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has no cuda device .* map_location='cpu'"):
            repo.load("main", map_location={"cpu": "cuda:0"})
    assert torch.equal(repo.load("main", map_location=torch.device("cpu"))["w"], torch.arange(4.0))
    assert torch.equal(repo.load("main", map_location=lambda t, device: t + 1)["w"], torch.arange(4.0) + 1)
    assert repo.load("main", map_location="meta")["w"].is_meta
    repo.close()
