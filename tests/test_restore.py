"""In-place restore into live objects: strict checks, partial restore, rename, providers."""

import random

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.errors import PrunedVersionError, StateMismatchError


def make_model(seed=0, hidden=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden),
                               torch.nn.Linear(hidden, 2))


def train_one(model, opt):
    loss = model(torch.randn(5, 4)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


class Counter:
    def __init__(self):
        self.n = 0
        self.hist = np.zeros(3)

    def state_dict(self):
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.hist = sd["hist"].copy()


def test_restore_in_place_all_kinds(repo):
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    counter = Counter()
    for _ in range(3):
        train_one(model, opt)
        sched.step()
    counter.n, counter.hist[:] = 5, [1, 2, 3]
    plain = {"weights": torch.arange(6.0), "epoch": 7}
    state = {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "counter": counter,
             "plain": plain}
    repo.save(state, step=3)

    model2 = make_model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    counter2 = Counter()
    weights = torch.zeros(6)
    plain2 = {"weights": weights, "epoch": 0}
    ptr = model2[0].weight.data_ptr()
    repo.restore({"model": model2, "optim": opt2, "sched": sched2, "scaler": scaler2,
                  "counter": counter2, "plain": plain2}, "main")
    assert model2[0].weight.data_ptr() == ptr, "parameters are restored in place"
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name])
    assert s1["param_groups"] == s2["param_groups"]
    assert sched2.state_dict() == sched.state_dict() and sched2.get_last_lr() == sched.get_last_lr()
    assert scaler2.get_scale() == 1024.0
    assert counter2.n == 5 and list(counter2.hist) == [1, 2, 3]
    assert plain2["epoch"] == 7 and plain2["weights"] is weights and torch.equal(weights, torch.arange(6.0))
    train_one(model, opt)
    torch.manual_seed(0)
    train_one(model2, opt2)


def test_strict_errors_list_everything(repo):
    repo.save({"model": make_model(0, hidden=8), "extra": torch.ones(2)})
    bigger = make_model(0, hidden=16)
    half = make_model(0, hidden=8).to(torch.float64)
    with pytest.raises(StateMismatchError) as e:
        repo.restore({"model": bigger, "other": torch.zeros(1)}, "main")
    msg = str(e.value)
    assert "missing in the version (1): other" in msg
    assert "unexpected in the version (1): extra" in msg
    assert "model/0.weight: stored shape [8, 4], live [16, 4]" in msg
    assert "model/1.running_mean" in msg
    with pytest.raises(StateMismatchError, match="stored dtype float32, live float64"):
        repo.restore({"model": half, "extra": torch.ones(2)}, "main")
    repo.restore({"model": half, "extra": torch.ones(2)}, "main", strict=False)
    assert half[0].weight.dtype == torch.float64
    with pytest.raises(StateMismatchError, match="shape"):
        repo.restore({"model": bigger}, "main", strict=False)


def test_objects_with_an_empty_state_restore_strictly(repo, tmp_path):
    """A stateful object whose state_dict() is empty (a disabled GradScaler, a parameterless
    module, a stateless callback) is present in the version: a strict restore and a resume
    accept it, and one stored under another name is still reported missing."""

    class Stateless:
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            assert sd == {}
            self.loaded = True

    model, scaler, plain = make_model(1), torch.amp.GradScaler("cpu", enabled=False), Stateless()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    repo.save({"model": model, "optim": opt, "scaler": scaler, "cb": plain, "act": torch.nn.ReLU()}, step=3)
    fresh, again = make_model(2), Stateless()
    repo.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1),
                  "scaler": torch.amp.GradScaler("cpu", enabled=False), "cb": again, "act": torch.nn.ReLU()})
    assert again.loaded and torch.equal(fresh[0].weight, model[0].weight)
    with pytest.raises(StateMismatchError, match=r"missing in the version \(1\): other"):
        repo.restore({"model": fresh, "optim": opt, "scaler": scaler, "cb": plain, "act": torch.nn.ReLU(),
                      "other": Stateless()})

    def state():
        return {"model": make_model(3), "scaler": torch.amp.GradScaler("cpu", enabled=False), "cb": Stateless()}

    ck = fp.Checkpointer(repo, state(), every=1, branch="ck", preemption=False)
    ck.save(7, sync=True)
    ck.close()
    ck = fp.Checkpointer(repo, state(), every=1, branch="ck", preemption=False)
    assert ck.resume() == 8 and ck.state["cb"].loaded
    ck.close()


def test_partial_restore_and_rename_for_transfer(repo):
    encoder = torch.nn.Linear(4, 8)
    repo.save({"model": {"encoder": encoder.state_dict(), "head": torch.nn.Linear(8, 3).state_dict()},
               "optim": {"lr": 0.1}})

    class Finetune(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Linear(4, 8)
            self.classifier = torch.nn.Linear(8, 5)

    ft = Finetune()
    head_before = ft.classifier.weight.clone()
    repo.restore({"net": ft}, "main", paths=["model/encoder"], rename={"model/encoder": "net/backbone"})
    assert torch.equal(ft.backbone.weight, encoder.weight)
    assert torch.equal(ft.classifier.weight, head_before)
    with pytest.raises(StateMismatchError, match="missing.*net/classifier"):
        repo.restore({"net": ft}, "main", rename={"model/encoder": "net/backbone"})
    part = repo.load("main", paths=["model/head"])
    assert list(part) == ["model"] and list(part["model"]) == ["head"]


def test_rng_state_round_trip(repo):
    rng = fp.RNGState()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    repo.save({"rng": rng})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    repo.restore({"rng": rng}, "main")
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_resumable_sampler_continues_at_next_sample(repo):
    sampler = fp.ResumableSampler(10, seed=4)
    it = iter(sampler)
    first = [next(it) for _ in range(4)]
    repo.save({"data": sampler})
    rest_expected = list(it) + list(iter(sampler))
    fresh = fp.ResumableSampler(10, seed=0)
    repo.restore({"data": fresh}, "main")
    rest = list(iter(fresh)) + list(iter(fresh))
    assert rest == rest_expected
    assert sorted(first + rest[:6]) == list(range(10))
    with pytest.raises(StateMismatchError, match="cannot restore .data. .ResumableSampler.* saved over 10 items"):
        repo.restore({"data": fp.ResumableSampler(11)}, "main")


def test_restore_pruned_version_is_clear(repo):
    for s in range(3):
        repo.save({"w": torch.full((2,), float(s))}, step=s)
    repo.gc(keep=fp.Keep(last=1), grace=0)
    with pytest.raises(PrunedVersionError, match="was pruned .by retention"):
        repo.restore({"w": torch.zeros(2)}, "main~1")


def test_memory_copies_go_to_whichever_task_is_free():
    """A restore's plain memory copies run as a few tasks that each take the next copy when
    done with the last: a task held up on one copy leaves the rest to the others, and every
    copy runs once."""
    import threading
    import time

    from forkpoint.engine.restore import _pooled

    ran, lock = [], threading.Lock()
    slow_started = threading.Event()

    def job(i):
        def run():
            if i == 0:
                slow_started.set()
                time.sleep(0.5)
            else:
                slow_started.wait(5)
            with lock:
                ran.append((i, threading.get_ident()))
        return run

    tasks = _pooled([(100 if i == 0 else 10, job(i)) for i in range(12)], 2)
    assert len(tasks) == 2 and all(size == -(-210 // 2) for size, _ in tasks)
    threads = [threading.Thread(target=fn) for _, fn in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for i, _ in ran) == list(range(12))
    slow_thread = next(tid for i, tid in ran if i == 0)
    assert [i for i, tid in ran if tid == slow_thread] == [0], "the other task took every copy while one slept"
    assert len(_pooled([(5, job(1))], 8)) == 1, "never more tasks than copies"


def test_a_memory_tier_restore_of_many_chunks_is_exact_and_names_a_missing_object():
    from forkpoint.engine import SaveOptions
    from forkpoint.format.objects import object_key

    rng = np.random.default_rng(0)
    state = {f"t{i}": torch.from_numpy(rng.standard_normal((64, 1024)).astype(np.float32)) for i in range(24)}
    repo = fp.Repo("mem://restore-many-chunks", create=True,
                   options=SaveOptions(chunk_bytes=64 << 10, small_leaf_bytes=16 << 10))
    v = repo.save(state)
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    repo.restore(target, v.id)
    assert all(torch.equal(target[k], state[k]) for k in state)
    leaf = next(l for l in repo.manifest(v.id).leaves if l.path == "t7")
    assert len(leaf.chunks) > 1
    repo.store.delete(object_key(leaf.chunks[1].object))
    with pytest.raises(fp.errors.MissingObjectError, match="t7"):
        repo.restore({k: torch.zeros_like(t) for k, t in state.items()}, v.id)
    repo.close()


def test_a_shape_mismatch_is_named_before_the_paths_it_explains(repo):
    """Restoring a model of another shape with a fresh optimizer: the mismatch comes first,
    the stored optimizer state it explains is summarised, and the hint names the part."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    repo.save({"model": model, "optim": opt, "extra": {f"k{i}": torch.ones(1) for i in range(12)}})
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    with pytest.raises(StateMismatchError) as e:
        repo.restore({"model": other, "optim": torch.optim.Adam(other.parameters())}, "main")
    lines = str(e.value).splitlines()
    assert lines[1].startswith("  mismatched (3): model/0.weight: stored shape [64, 16], live [32, 16]"), lines
    unexpected = next(line for line in lines if "unexpected in the version" in line)
    assert unexpected.endswith("extra/k3, and 6 more under extra/"), unexpected
    assert lines[-1].startswith("  a leaf of another shape cannot be restored into 'model':"), lines[-1]


def test_restoring_a_model_alone_is_told_the_paths_that_restore_it(repo):
    """A version holding model and optimizer, restored into a model alone (or with a part the
    version lacks): the hint names the parts that match, and following it restores them."""
    model = make_model(0, hidden=8)
    opt = torch.optim.AdamW(model.parameters())
    repo.save({"model": model, "optim": opt})
    fresh = make_model(1, hidden=8)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(fresh.parameters(), lr=0.1), 1)
    for live in ({"model": fresh}, {"model": fresh, "sched": sched}):
        with pytest.raises(StateMismatchError) as e:
            repo.restore(live, "main")
        assert str(e.value).splitlines()[-1].startswith("  to restore only the parts that match, "
                                                        "pass paths=['model'];"), str(e.value)
        repo.restore(live, "main", paths=["model"])
        assert torch.equal(fresh[0].weight, model[0].weight)


def test_a_namedtuple_restores_strictly_into_a_live_one_and_stays_one(repo):
    """Saved as a tuple, restored into a live namedtuple (also nested in a list): the tensors
    are filled in place, the other values replaced, and the container keeps its type."""
    import collections

    Pair = collections.namedtuple("Pair", "weight count")
    repo.save({"x": Pair(torch.ones(2), 3), "y": [Pair(torch.full((1,), 2.0), (torch.ones(1),))]})
    live = {"x": Pair(torch.zeros(2), 0), "y": [Pair(torch.zeros(1), (torch.zeros(1),))]}
    weight = live["x"].weight
    repo.restore(live, "main")
    assert isinstance(live["x"], Pair) and live["x"].count == 3 and live["x"].weight is weight
    assert torch.equal(weight, torch.ones(2))
    assert isinstance(live["y"][0], Pair) and torch.equal(live["y"][0].count[0], torch.ones(1))
    assert torch.equal(live["y"][0].weight, torch.full((1,), 2.0))


def test_a_compiled_model_and_its_plain_module_share_versions(repo):
    """torch.compile's wrapper adds "_orig_mod." before each state_dict key: saved through the
    wrapper the version holds the plain keys, so it restores into the plain module and into a
    compiled one; state that carries the prefix (a compiled model's state_dict saved as a
    dict, a torch.save file of it imported) restores into the plain module too."""
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))

    model = build(0)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters())
    compiled(torch.randn(4, 3)).sum().backward()
    opt.step()
    repo.save({"model": compiled, "optim": opt})
    assert {leaf.path for leaf in repo.manifest().leaves if leaf.path.startswith("model/")} == \
        {f"model/{k}" for k in model.state_dict()}
    plain, into_compiled = build(1), build(2)
    repo.restore({"model": plain, "optim": torch.optim.AdamW(plain.parameters())}, "main")
    repo.restore({"model": torch.compile(into_compiled, backend="eager")}, "main", paths=["model"])
    for restored in (plain, into_compiled):
        for key, value in model.state_dict().items():
            assert torch.equal(restored.state_dict()[key], value), key

    repo.save({"model": compiled.state_dict()}, branch="prefixed")
    assert any("_orig_mod." in leaf.path for leaf in repo.manifest("prefixed").leaves)
    fresh = build(3)
    repo.restore({"model": fresh}, "prefixed")
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_a_ddp_or_data_parallel_model_and_its_plain_module_share_versions(repo, tmp_path):
    """DDP and DataParallel add "module." before each state_dict key: saved through the
    wrapper the version holds the plain keys; a version whose keys carry the prefix (the
    wrapper's state_dict saved as a dict) restores into the plain module and the wrappers."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        repo.save({"model": ddp})
        repo.save({"model": ddp.state_dict()}, branch="prefixed")
        assert [leaf.path for leaf in repo.manifest("main").leaves] == ["model/weight", "model/bias"]
        for ref in ("main", "prefixed"):
            targets = [torch.nn.Linear(3, 2), torch.nn.DataParallel(torch.nn.Linear(3, 2)),
                       torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))]
            for target in targets:
                repo.restore({"model": target}, ref)
                plain = getattr(target, "module", target)
                assert torch.equal(plain.weight, model.weight) and torch.equal(plain.bias, model.bias), (ref, target)
    finally:
        dist.destroy_process_group()


def test_an_optimizer_built_with_other_parameter_groups_is_named_with_the_version(repo):
    """torch's load_state_dict refuses the saved state: the error names the part, the
    object's type, the version and what to do, and keeps torch's reason."""
    model = make_model(0, hidden=8)
    opt = torch.optim.AdamW(model.parameters())
    v = repo.save({"model": model, "optim": opt})
    grouped = torch.optim.AdamW([{"params": model[0].parameters()},
                                 {"params": [p for m in list(model)[1:] for p in m.parameters()], "lr": 0.1}])
    with pytest.raises(StateMismatchError) as e:
        repo.restore({"model": model, "optim": grouped}, "main")
    message = str(e.value)
    assert message.startswith(f"cannot restore 'optim' (AdamW) from version {v.id}"), message
    assert "different number of parameter groups" in message and "paths=[...]" in message
    repo.restore({"model": model, "optim": grouped}, "main", paths=["model"])


def test_an_optimizer_of_another_class_is_refused_before_anything_is_restored(repo):
    """An AdamW state handed to SGD would replace SGD's learning rate and momentum buffers
    silently (torch accepts it): strict restore names both classes and the part, and leaves
    the live objects untouched; strict=False restores it with a warning; paths= leaves it out."""
    model = make_model(0)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_one(model, adamw)
    v = repo.save({"model": model, "optim": adamw})
    assert repo.manifest(v.id).classes == {"model": "torch.nn.modules.container:Sequential",
                                           "optim": "torch.optim.adamw:AdamW"}
    fresh = make_model(1)
    before = [p.detach().clone() for p in fresh.parameters()]
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(StateMismatchError) as e:
        repo.restore({"model": fresh, "optim": sgd})
    message = str(e.value)
    assert "optim: stored state of a torch.optim.adamw.AdamW, live torch.optim.sgd.SGD" in message, message
    assert "paths=['model']" in message and "model:" not in message.split("\n", 1)[1], message
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert sgd.param_groups[0]["lr"] == 0.5 and not sgd.state

    repo.restore({"model": fresh, "optim": sgd}, paths=["model"])
    assert sgd.param_groups[0]["lr"] == 0.5 and torch.equal(fresh[0].weight, model[0].weight)
    with pytest.warns(UserWarning, match="another class than the one saved: optim: stored state of a "
                                         "torch.optim.adamw.AdamW"):
        repo.restore({"model": fresh, "optim": sgd}, strict=False)
    assert sgd.param_groups[0]["lr"] == 1e-3


def test_class_records_follow_rename_and_do_not_check_modules(repo):
    """The class record is keyed by the stored path, so rename= carries it; a module of another
    class with the same keys (a renamed class) restores, since its keys are what is checked."""
    class Renamed(torch.nn.Linear):
        pass

    lin = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    repo.save({"net": lin, "opt": opt})
    target = Renamed(4, 2)
    repo.restore({"model": target, "optim": torch.optim.SGD(target.parameters(), lr=0.2)},
                 rename={"net": "model", "opt": "optim"})
    assert torch.equal(target.weight, lin.weight)
    with pytest.raises(StateMismatchError, match="optim: stored state of a torch.optim.sgd.SGD, live "
                                                 "torch.optim.adam.Adam"):
        repo.restore({"model": target, "optim": torch.optim.Adam(target.parameters())},
                     rename={"net": "model", "opt": "optim"})


def test_versions_without_class_records_restore_as_before(repo, monkeypatch):
    """A manifest with no `classes` (written before 1.4, by the C library, or holding no
    stateful object) is not checked, and stays byte-for-byte what 1.3 wrote."""
    v = repo.save({"w": torch.ones(3)})
    assert repo.manifest(v.id).classes == {}
    assert b'"classes"' not in repo.store.read(f"versions/{v.id}.json")
    import forkpoint.repo.core
    monkeypatch.setattr(forkpoint.repo.core, "classes_of", lambda objects: {})  # as a 1.3 writer
    lin = torch.nn.Linear(2, 2)
    adam = torch.optim.Adam(lin.parameters(), lr=0.01)
    u = repo.save({"opt": adam})
    assert repo.manifest(u.id).classes == {}
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    repo.restore({"opt": sgd}, u.id)
    assert sgd.param_groups[0]["lr"] == 0.01


def test_a_stateful_object_of_the_users_own_class_may_be_renamed(repo):
    """Only torch's classes are compared: a class of the user's renamed between runs (or a
    script run as __main__ and later imported) restores, its own load_state_dict deciding."""
    class Before(Counter):
        pass

    class After(Counter):
        pass

    saved = Before()
    saved.n = 7
    repo.save({"counter": saved})
    live = After()
    repo.restore({"counter": live})
    assert live.n == 7


def test_diff_names_an_object_saved_from_another_torch_class(repo):
    """The optimizer changed between two runs: diff's first row for it says which classes,
    before the entries that differ; a renamed class of the user's is not a change."""
    class Counted(Counter):
        pass

    lin = torch.nn.Linear(3, 3)
    adamw = torch.optim.AdamW(lin.parameters())
    a = repo.save({"model": lin, "optim": adamw, "counter": Counter()})
    b = repo.save({"model": lin, "optim": torch.optim.SGD(lin.parameters(), lr=0.1), "counter": Counted()},
                  branch="sgd")
    rows = {d.path: d for d in repo.diff(a.id, b.id)}
    assert rows["optim"].status == "changed"
    assert rows["optim"].detail == "class torch.optim.adamw.AdamW -> torch.optim.sgd.SGD"
    assert "counter" not in rows and rows["counter/n"].status == "same"
    assert [d.path for d in repo.diff(a.id, b.id)].index("optim") < [d.path for d in repo.diff(a.id, b.id)].index(
        "optim/param_groups/0/lr")


@pytest.mark.parametrize("build", ["reversed", "fewer"])
def test_an_optimizer_built_over_its_parameters_in_another_order_is_refused(repo, build):
    """torch loads AdamW moments by parameter index and fails only at the next step, with a
    broadcast error; restore names each state tensor that does not fit its parameter and
    how to build the optimizer, and restores nothing."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    train_one(model, opt)
    repo.save({"model": model, "optim": opt})
    params = list(model.parameters())
    live = torch.optim.AdamW(params[::-1] if build == "reversed" else params[:2], lr=0.5)
    with pytest.raises(StateMismatchError) as e:
        repo.restore({"model": model, "optim": live})
    message = str(e.value)
    if build == "reversed":
        assert ("optim/state/0/exp_avg: saved for a parameter of shape [8, 4], the live optimizer's parameter 0 "
                "has shape [2]") in message
    else:
        assert "optim/state/2/exp_avg: the live optimizer's parameter 2 does not exist (it has 2)" in message
    assert "was built over other parameters or in another order" in message and "model.parameters()" in message
    assert not live.state and live.param_groups[0]["lr"] == 0.5
    repo.restore({"model": model, "optim": torch.optim.AdamW(model.parameters())})


def test_optimizers_whose_state_is_not_shaped_like_their_parameters_are_not_shape_checked(repo):
    """LBFGS keeps flat history tensors under its first parameter's index: it restores."""
    model = torch.nn.Linear(3, 2)
    lbfgs = torch.optim.LBFGS(model.parameters(), history_size=3)

    def closure():
        lbfgs.zero_grad()
        loss = model(torch.randn(4, 3)).pow(2).sum()
        loss.backward()
        return loss

    lbfgs.step(closure)
    repo.save({"model": model, "optim": lbfgs})
    again = torch.optim.LBFGS(model.parameters(), history_size=3)
    repo.restore({"model": model, "optim": again})
    assert again.state_dict()["state"][0]["n_iter"] == lbfgs.state_dict()["state"][0]["n_iter"]
