"""Deltas against the parent version: chosen only where smaller, bounded chains, bit-exact
restores of every version, gc keeping the bases a kept version needs, corruption caught."""

import json
import shutil
import threading

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.errors import CorruptObjectError

torch = pytest.importorskip("torch")


def chains(repo, vid):
    """{path: [(codec, op, chain length)]} of a version's chunks."""
    return {leaf.path: [(c.codec, (c.delta or {}).get("op"), len((c.delta or {}).get("chain", [])))
                        for c in leaf.chunks] for leaf in repo.manifest(vid).leaves}


def train_like(steps, seed=0):
    """States of a slowly changing float32 weight, a bf16 copy, an int64 counter table and a frozen part."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 1024, generator=g)
    counts = torch.arange(400_000, dtype=torch.int64)
    frozen = torch.randn(256, 1024, generator=g)
    for _ in range(steps):
        w.add_(torch.randn(w.shape, generator=g) * 1e-4)
        counts.add_(torch.randint(0, 3, counts.shape, generator=g))
        yield {"w": w.clone(), "w16": w.to(torch.bfloat16), "counts": counts.clone(), "frozen": frozen}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("reopen", [False, True], ids=["cached-base", "base-read-back"])
def test_chain_round_trips_and_is_bounded(tmp_path, reopen):
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless", delta=fp.Delta(max_chain=3))
    states, ids = [], []
    for i, state in enumerate(train_like(7)):
        if reopen:
            repo.close()
            repo = fp.Repo(url, codec="lossless", delta=fp.Delta(max_chain=3))
        ids.append(repo.save(state, step=i, sync=i % 2 == 0) if i % 2 == 0 else repo.save(state, step=i, sync=False).wait())
        states.append(state)
    ids = [v.id for v in ids]
    expected_chain = [0, 1, 2, 0, 1, 2, 0]
    for i, vid in enumerate(ids):
        got = chains(repo, vid)
        assert [n for _, _, n in got["w"]] == [expected_chain[i]], (i, got["w"])
        assert got["counts"][0][1] == ("sub" if expected_chain[i] else None), "integers use subtraction"
        assert got["frozen"] == chains(repo, ids[0])["frozen"], "an unchanged chunk reuses its record"
    m0, m1 = repo.manifest(ids[0]), repo.manifest(ids[1])
    assert m1.version.stored_bytes < 0.75 * m0.version.stored_bytes
    fresh = fp.Repo(url)
    for vid, state in zip(ids, states):
        assert same(fresh.load(vid), state), vid
    assert fresh.verify().problems == []


def test_delta_only_where_smaller(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", delta=True)
    g = torch.Generator().manual_seed(1)
    repo.save({"w": torch.randn(512, 1024, generator=g)})
    v = repo.save({"w": torch.randn(512, 1024, generator=g)})
    assert chains(repo, v.id)["w"] == [("float-planes", None, 0)], "unrelated values are stored in full"
    raw = fp.Repo(str(tmp_path / "raw"), create=True, codec="raw", delta=True)
    w = torch.randn(512, 1024, generator=g)
    raw.save({"w": w})
    w[0, 0] += 1
    v = raw.save({"w": w})
    assert chains(raw, v.id)["w"] == [("raw", None, 0)], "no delta without a codec that can shrink it"
    assert torch.equal(raw.load(v.id)["w"], w)


def test_gc_keeps_the_bases_of_kept_versions(tmp_path):
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless", delta=fp.Delta(max_chain=4))
    states = list(train_like(6))
    for i, state in enumerate(states):
        repo.save(state, step=i)
    head = repo.log()[0]
    assert [n for _, _, n in chains(repo, head.id)["w"]] == [1], "the head is a delta on step 4's full chunk"
    report = repo.gc(keep=fp.Keep(last=1), grace=0)
    assert report.deleted_objects > 0, "versions 0-3 and their objects were released"
    assert same(fp.Repo(url).load(head.id), states[-1])
    assert fp.Repo(url).verify().problems == []


def test_du_says_what_each_branch_holds_and_what_deleting_it_frees(tmp_path):
    """A branch's held bytes count the delta bases its kept versions need; its exclusive bytes
    are what deleting it and a gc free (measured on the store)."""
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless", delta=fp.Delta(max_chain=4))
    states = list(train_like(7))
    for i, state in enumerate(states[:4]):
        repo.save(state, step=i)
    repo.fork("main", "alt")
    for i, state in enumerate(states[4:], start=4):
        repo.save({**state, "w": state["w"] + 1}, branch="alt", step=i)
    repo.gc(keep=fp.Keep(last=1), grace=0)
    head = repo.manifest("main")
    needed = {o for leaf in head.leaves for c in leaf.chunks for o in c.objects}
    assert any(c.delta for leaf in head.leaves for c in leaf.chunks), "the kept head is stored as deltas"
    usage = repo.du()["branches"]
    on_store = lambda objs: sum(repo.store.size(f"objects/{o[:2]}/{o}") for o in objs)
    assert usage["main"]["held_bytes"] == on_store(needed) > usage["main"]["stored_bytes"]
    before = repo.du()["objects_bytes"]
    repo.delete_branch("alt")
    repo.gc(grace=0)
    assert before - repo.du()["objects_bytes"] == usage["alt"]["exclusive_bytes"] > 0
    assert repo.du()["branches"]["main"]["exclusive_bytes"] == repo.du()["objects_bytes"]
    assert same(fp.Repo(url).load("main"), states[3])


def test_corrupt_base_is_caught_and_named(tmp_path):
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless", delta=True)
    states = list(train_like(3))
    for state in states:
        repo.save(state)
    leaf = next(lf for lf in repo.manifest("main").leaves if lf.path == "w")
    base = leaf.chunks[0].delta["chain"][0]
    path = tmp_path / "r" / "objects" / base[:2] / base
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=base):
        fp.Repo(url).load("main")
    assert any(base in p for p in fp.Repo(url).verify("main").problems)


def test_flushed_tier_holds_the_whole_chain(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    repo = fp.Repo(tiers=[str(fast), str(slow)], create=True, codec="lossless", delta=True)
    states = list(train_like(4))
    for state in states:
        repo.save(state)
    repo.drain()
    repo.close()
    shutil.rmtree(fast)
    again = fp.Repo(tiers=[str(fast), str(slow)], create=True)
    for v, state in zip(again.log()[::-1], states):
        assert same(again.load(v.id), state)


def test_values_are_unchanged_by_chain_arithmetic():
    from forkpoint.codecs.delta import apply_delta, make_delta

    rng = np.random.default_rng(0)
    for dtype, op in [(np.int64, "sub"), (np.uint8, "sub"), (np.float32, "xor"), (np.float16, "xor")]:
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            a, b = (rng.integers(info.min, info.max, 1001, dtype=dtype, endpoint=True).view(np.uint8) for _ in "ab")
        else:
            a, b = (rng.standard_normal(1001).astype(dtype).view(np.uint8) for _ in "ab")
        d = make_delta(op, a, b, np.dtype(dtype).itemsize)
        acc = b.copy()
        apply_delta(op, acc, d, np.dtype(dtype).itemsize)
        assert np.array_equal(acc, a)


def test_bad_delta_options_and_records_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_chain"):
        fp.Delta(max_chain=0)
    with pytest.raises(TypeError, match="delta must be"):
        fp.Repo(str(tmp_path / "x"), create=True, delta="yes")
    url = str(tmp_path / "r")
    repo = fp.Repo(url, create=True, codec="lossless", delta=True)
    for state in train_like(2):
        repo.save(state)
    vid = repo.resolve("main")
    path = tmp_path / "r" / "versions" / f"{vid}.json"
    record = path.read_text()
    assert '"op":"xor"' in record
    path.write_text(record.replace('"op":"xor"', '"op":"rot13"'))
    with pytest.raises(CorruptObjectError, match="does not match its id"):
        fp.Repo(url).load(vid)
    from forkpoint.format.manifest import _record_id

    forged = json.loads(path.read_text())
    forged["id"] = _record_id(forged)
    (tmp_path / "r" / "versions" / f"{forged['id']}.json").write_text(json.dumps(forged))
    with pytest.raises(CorruptObjectError, match="invalid delta record"):
        fp.Repo(url).load(forged["id"])


def test_cached_bases_are_recycled_and_overlapping_or_failed_saves_stay_exact(tmp_path, monkeypatch):
    """A save that alone reads the in-memory bases copies its values into them (the cache never
    holds two versions); saves in flight together share the bases and take none; a save that
    fails half-way leaves the next one exact (the bases it took are read back from storage)."""
    from forkpoint.engine.delta import DeltaPlan
    from forkpoint.engine.objectwriter import ObjectWriter

    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", delta=fp.Delta(max_chain=50), workers=16)
    states = list(train_like(6))
    versions = [repo.save(states[0], step=0), repo.save(states[1], step=1)]
    before = {a.ctypes.data for a in repo._delta_values.values()}
    versions.append(repo.save(states[2], step=2))
    after = {a.ctypes.data for a in repo._delta_values.values()}
    assert before and after == before, "the new values went into the parent's buffers"

    # Two saves in flight: the second takes a base from the cache and holds it while the first
    # stores its values; the first must not have copied them into that base.
    real_put, real_base, real_remember = ObjectWriter.put, DeltaPlan._base, DeltaPlan._remember
    second_holds_base, first_remembered, first_plan = threading.Event(), threading.Event(), []

    writers = []

    def held_put(self, *args, **kwargs):
        writers[:] = writers or [self]
        if writers[0] is self:
            second_holds_base.wait(10)
        return real_put(self, *args, **kwargs)

    def held_base(self, leaf, chunk):
        base = real_base(self, leaf, chunk)
        if first_plan and self is not first_plan[0]:
            second_holds_base.set()
            first_remembered.wait(2)
        return base

    def remember(self, *args):
        real_remember(self, *args)
        if first_plan and self is first_plan[0] and second_holds_base.is_set():
            first_remembered.set()

    monkeypatch.setattr(ObjectWriter, "put", held_put)
    monkeypatch.setattr(DeltaPlan, "_base", held_base)
    monkeypatch.setattr(DeltaPlan, "_remember", remember)
    first = repo.save(states[3], step=3, sync=False)
    first_plan.extend(repo._delta_plans)
    second = repo.save(states[4], step=4, sync=False)
    versions += [first.wait(), second.wait()]
    assert second_holds_base.is_set() and first_remembered.is_set(), "the two saves overlapped"
    monkeypatch.setattr(DeltaPlan, "_base", real_base)
    calls = []

    def failing_put(self, digest, data, *args, **kwargs):
        calls.append(digest)
        if len(calls) == 3:
            raise OSError("disk went away")
        return real_put(self, digest, data, *args, **kwargs)

    monkeypatch.setattr(ObjectWriter, "put", failing_put)
    with pytest.raises(OSError, match="disk went away"):
        repo.save(states[5], step=5)
    monkeypatch.setattr(ObjectWriter, "put", real_put)
    versions.append(repo.save(states[5], step=5))
    assert any(c[1] for c in chains(repo, versions[-1].id)["w"]), "the last save still stores a delta"
    fresh = fp.Repo(str(tmp_path / "r"))
    expected = states[:5] + [states[5]]
    for v, state in zip(versions, expected):
        assert same(fresh.load(v.id), state), v.step
    assert fresh.verify().problems == []


def test_a_chunks_value_estimate_is_kept_for_its_next_saves(tmp_path, monkeypatch):
    """A delta save estimates its delta's coded size every save and its value's on the chunk's
    first delta save and every 8th after (the figure is kept in between); unrelated values
    are stored in full at once, however recent the kept figure."""
    from forkpoint.engine import delta as delta_module

    estimated = []
    real = delta_module._sample_coded

    def counting(codec, data, itemsize):
        estimated.append(data.nbytes)
        return real(codec, data, itemsize)

    real_delta = delta_module._delta_sample_coded

    def counting_delta(codec, op, value, base, itemsize):
        estimated.append(value.nbytes)
        return real_delta(codec, op, value, base, itemsize)

    monkeypatch.setattr(delta_module, "_sample_coded", counting)
    monkeypatch.setattr(delta_module, "_delta_sample_coded", counting_delta)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", delta=fp.Delta(max_chain=100))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 1024, generator=g)
    states, ids, per_save = [], [], []
    for step in range(11):
        w = w + torch.randn(w.shape, generator=g) * 1e-4
        before = len(estimated)
        ids.append(repo.save({"w": w}, step=step).id)
        per_save.append(len(estimated) - before)
        states.append(w)
    assert per_save == [0, 2, 1, 1, 1, 1, 1, 1, 1, 2, 1], per_save
    assert all(chains(repo, vid)["w"][0][1] == "xor" for vid in ids[1:]), "every later save is a delta"
    for step in range(11, 13):
        w = torch.randn(w.shape, generator=g)
        ids.append(repo.save({"w": w}, step=step).id)
        states.append(w)
    assert [chains(repo, vid)["w"][0][1] for vid in ids[11:]] == [None, None], "unrelated values: full"
    fresh = fp.Repo(str(tmp_path / "r"))
    for vid, state in zip(ids, states):
        assert torch.equal(fresh.load(vid)["w"], state), vid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_delta_is_estimated_from_the_samples_and_made_only_where_chosen(tmp_path, monkeypatch, dtype):
    """The estimate of a chunk's delta made from the delta of its value's and base's samples
    is the estimate of the whole delta's sample (small and large chunks); a delta that does not
    code smaller is never made in full, one that does is, and every version loads exact."""
    from forkpoint.engine import delta as delta_module
    from forkpoint.codecs.registry import codec_for
    from forkpoint.codecs.delta import make_delta, op_for

    g = torch.Generator().manual_seed(5)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    codec = codec_for("lossless", itemsize, dtype.is_floating_point)
    op = op_for(str(dtype).removeprefix("torch."))
    for n in (3000, 300_000, 2_000_000):
        if dtype.is_floating_point:
            base = torch.randn(n, generator=g).to(dtype)
            value = (base.float() + torch.randn(n, generator=g) * 1e-3).to(dtype)
        else:
            base = torch.randint(0, 1 << 40, (n,), generator=g)
            value = base + torch.randint(0, 3, (n,), generator=g)
        v, b = (t.view(torch.uint8).numpy() for t in (value, base))
        assert delta_module._delta_sample_coded(codec, op, v, b, itemsize) == \
            delta_module._sample_coded(codec, make_delta(op, v, b, itemsize), itemsize), n

    made = []
    real = delta_module.make_delta
    monkeypatch.setattr(delta_module, "make_delta", lambda op, value, base, *a, **k: (
        made.append(value.nbytes), real(op, value, base, *a, **k))[1])
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", delta=fp.Delta())
    w = torch.randn(1024, 1024, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 1 << 40, (1024, 1024), generator=g)
    states = [w]
    repo.save({"w": w})
    unrelated = torch.randn(w.shape, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(0, 1 << 40, w.shape, generator=g)
    states.append(unrelated)
    ids = [repo.version("main").id, repo.save({"w": unrelated}).id]
    assert chains(repo, ids[1])["w"][0][1] is None and w.numel() * itemsize not in made, "rejected: never made"
    close = (unrelated.float() * (1 + 1e-2 * torch.randn(w.shape, generator=g))).to(dtype) \
        if dtype.is_floating_point else unrelated + torch.randint(0, 3, w.shape, generator=g)
    states.append(close)
    ids.append(repo.save({"w": close}).id)
    assert chains(repo, ids[2])["w"][0][1] is not None and w.numel() * itemsize in made, "chosen: made in full"
    fresh = fp.Repo(str(tmp_path / "r"))
    for vid, state in zip(ids, states):
        assert torch.equal(fresh.load(vid)["w"], state), vid
