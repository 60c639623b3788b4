"""codec="auto": each store learns from its own saves whether writing auto chunks encoded or
raw is faster, tries the other way now and then, and never encodes what does not compress;
round trips stay exact."""

import threading
import time

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.engine.autocodec import EXPLORE_FIRST, EXPLORE_MAX, AutoChoice, BusyMeter, choice_for

MiB = 1 << 20


def compressible(n=1 << 20, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 1e-3).astype(np.float32).astype(np.float16).astype(np.float32)


def picks(choice, n):
    return [choice.pick() for _ in range(n)]


def test_untried_ways_first_then_the_faster_with_explorations_spaced_out():
    choice = AutoChoice()
    assert choice.pick() is False, "raw first"
    choice.record(False, 100 * MiB, 1.0)
    assert choice.pick() is True, "then encoded"
    choice.record(True, 100 * MiB, 2.0)
    run = picks(choice, EXPLORE_FIRST)
    assert run == [False] * (EXPLORE_FIRST - 1) + [True], "raw is faster; the 8th save tries encoding"
    choice.record(True, 100 * MiB, 2.0)
    assert choice.interval == 2 * EXPLORE_FIRST, "encoding lost again: explore half as often"
    for _ in range(10):
        picks(choice, choice.interval - 1)
        assert choice.pick() is True
        choice.record(True, 100 * MiB, 2.0)
    assert choice.interval == EXPLORE_MAX
    picks(choice, EXPLORE_MAX - 1)
    assert choice.pick() is True
    choice.record(True, 100 * MiB, 0.2)  # the store got slower (or the codec faster): encoding wins
    assert choice.faster() is True and choice.interval == EXPLORE_FIRST
    assert picks(choice, EXPLORE_FIRST) == [True] * (EXPLORE_FIRST - 1) + [False]


def test_slow_stores_try_encoding_first_and_small_saves_teach_nothing():
    choice = AutoChoice()
    assert choice.pick(encoded_first=True) is True
    choice.record(True, MiB, 0.001)
    assert choice.rates == {}, "1 MiB written: too little to measure"


def test_busy_meter_counts_only_time_with_writes_in_progress():
    meter = BusyMeter()

    def write(seconds):
        meter.start()
        time.sleep(seconds)
        meter.finish(MiB)

    for _ in range(2):
        threads = [threading.Thread(target=write, args=(0.05,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.2)
    assert meter.nbytes == 8 * MiB and meter.active == 0
    assert 0.09 < meter.busy < 0.3, "two overlapped bursts of ~50 ms; the 0.4 s of gaps not counted"


def chunk_codecs(repo, v):
    return {lf.path: {c.codec for c in lf.chunks} for lf in repo.manifest(v.id).leaves}


def test_saves_to_a_real_disk_measure_both_ways_and_follow_the_faster(tmp_path):
    """Real saves: the first writes raw, the second encodes (what compresses), and each
    measures its writing; the third follows whichever was faster on this disk."""
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="auto")
    noise = np.random.default_rng(1).integers(0, 255, 4 * MiB, dtype=np.uint8)
    states = [{"w": compressible(4 * MiB, seed), "noise": noise + seed} for seed in range(3)]
    choice = choice_for(repo.store)
    v1 = repo.save(states[0])
    assert chunk_codecs(repo, v1) == {"w": {"raw"}, "noise": {"raw"}}, choice
    v2 = repo.save(states[1])
    assert chunk_codecs(repo, v2) == {"w": {"float-planes"}, "noise": {"raw"}}, ("incompressible stays raw", choice)
    assert set(choice.rates) == {False, True} and all(r > 0 for r in choice.rates.values()), choice
    expected = "float-planes" if choice.faster() else "raw"
    v3 = repo.save(states[2])
    assert chunk_codecs(repo, v3)["w"] == {expected}, choice
    for v, state in zip((v1, v2, v3), states):
        back = repo.load(v.id)
        assert np.array_equal(back["w"], state["w"]) and np.array_equal(back["noise"], state["noise"])
        assert repo.verify(v.id).ok


def test_auto_encodes_first_on_a_store_known_to_be_slow(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="auto")
    repo.store.bandwidth_hint = 1e6
    state = {"w": compressible(), "noise": np.random.default_rng(2).integers(0, 255, 1 << 21, dtype=np.uint8)}
    v = repo.save(state)
    back = repo.load(v.id)
    assert np.array_equal(back["w"], state["w"]) and np.array_equal(back["noise"], state["noise"])
    assert chunk_codecs(repo, v) == {"w": {"float-planes"}, "noise": {"raw"}}
    assert repo.verify(v.id).ok


def test_what_auto_learnt_carries_over_to_the_next_job(tmp_path):
    """A job's saves leave the rates in the repository; the next job (a new Repo on the same
    path) starts from them instead of trying both ways again; gc keeps the record."""
    path = str(tmp_path / "r")
    repo = fp.Repo(path, create=True, codec="auto")
    for seed in range(2):
        repo.save({"w": compressible(4 * MiB, seed)})
    learnt = dict(choice_for(repo.store).rates)
    repo.close()
    again = fp.Repo(path, codec="auto")
    choice = choice_for(again.store)
    assert choice.rates.keys() == learnt.keys() and all(
        choice.rates[k] == pytest.approx(learnt[k]) for k in learnt)
    best, explores = choice.faster(), choice.since + 1 >= choice.interval
    v = again.save({"w": compressible(4 * MiB, 7)})
    assert chunk_codecs(again, v)["w"] == {"float-planes" if best != explores else "raw"}, \
        "the save took the way the rates it started from said (its own rate is learnt after)"
    again.gc()
    assert again.store.exists("stats/auto-codec.json")
    assert again.verify(v.id).ok


@pytest.mark.parametrize("record", [b"not json", b'{"format": "forkpoint.auto-codec", "format_version": [1, 1], "rates": {"raw": -1}, "interval": 8}',
                                    b'{"format": "something else", "rates": {}, "interval": 8}',
                                    b'{"format": "forkpoint.auto-codec", "format_version": [2, 0], "rates": {}, "interval": 8}'])
def test_a_damaged_auto_record_is_ignored_with_a_warning(tmp_path, caplog, record):
    path = str(tmp_path / "r")
    fp.Repo(path, create=True).close()
    repo = fp.Repo(path, codec="auto")
    repo.store.write("stats/auto-codec.json", [record])
    with caplog.at_level("WARNING", logger="forkpoint"):
        v = repo.save({"w": compressible(4 * MiB)})
    assert "auto-codec.json" in caplog.text
    assert chunk_codecs(repo, v)["w"] == {"raw"}, "starts afresh: raw first"
    assert choice_for(repo.store).rates.keys() == {False}


def test_a_failed_write_counts_no_bytes(tmp_path):
    from forkpoint.engine.objectwriter import ObjectWriter

    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="auto")
    writer = ObjectWriter(repo.store, "auto")
    with pytest.raises(OSError):
        with writer._measured(8 * MiB, True):
            raise OSError("No space left on device")
    with writer._measured(MiB, True):
        pass
    with writer._measured(MiB, False):
        pass
    assert writer.auto_meter.nbytes == MiB and writer.auto_meter.active == 0


def test_a_flush_encodes_auto_objects_where_the_tier_below_measures_encoding_faster(tmp_path):
    """codec="auto" on tiers: saves into the fast tier stay raw; a flush encodes the raw auto
    objects as it copies them where the lower tier's AutoChoice (learnt from flushes) says
    encoded writes are faster there, and copies them raw where it says raw; each tier alone
    reads back bit-exactly, and flushes teach the lower tier's AutoChoice."""
    fast, slow, plain = f"mem://{tmp_path.name}", str(tmp_path / "slow"), str(tmp_path / "plain")
    states = [{"w": compressible(3 * MiB, seed=i), "n": np.arange(300_000) // 7} for i in range(3)]
    repo = fp.Repo(tiers=[fast, slow], create=True, codec="auto")
    choice_for(repo.stores[0]).rates.update({False: 2e9, True: 1e9})  # raw saves win up there
    choice_for(repo.stores[1]).rates.update({False: 1e8, True: 4e8})  # encoded writes win below
    ids = [repo.save(s, step=i).id for i, s in enumerate(states)]
    repo.drain()
    assert set(repo.stored_codecs(ids[-1]).values()) == {"raw"}, "the fast tier holds raw objects"
    below = fp.Repo(slow)
    codecs = set(below.stored_codecs(ids[-1]).values())
    assert "float-planes" in codecs, codecs
    assert below.du()["objects_bytes"] < 0.8 * sum(v.logical_bytes for v in repo.log())
    for vid, state in zip(ids, states):
        got = below.load(vid)
        assert np.array_equal(got["w"], state["w"]) and np.array_equal(got["n"], state["n"])
    assert below.verify().ok
    learnt = choice_for(repo.stores[1]).rates
    assert set(learnt) == {False, True} and learnt[True] != 4e8, "the flushes were measured"
    choice_for(repo.stores[0]).rates.update({False: 1e8, True: 4e9})  # now saves encode up there too
    encoded = {"w": compressible(3 * MiB, seed=9), "n": np.arange(300_000) // 5}
    vid = repo.save(encoded, step=3).id
    repo.drain()
    assert repo.stats()["flush_errors"] == []
    assert "float-planes" in set(repo.stored_codecs(vid).values()), "encoded at the save"
    got = fp.Repo(slow).load(vid)
    assert np.array_equal(got["w"], encoded["w"]) and np.array_equal(got["n"], encoded["n"])
    assert fp.Repo(slow).verify(vid).ok
    repo.close()

    other = fp.Repo(tiers=[f"mem://{tmp_path.name}-2", plain], create=True, codec="auto")
    choice_for(other.stores[0]).rates.update({False: 2e9, True: 1e9})
    choice_for(other.stores[1]).rates.update({False: 4e8, True: 1e8})  # raw writes win there
    vid = other.save(states[0]).id
    other.drain()
    assert set(fp.Repo(plain).stored_codecs(vid).values()) == {"raw"}
    other.close()


def test_a_flush_that_would_encode_a_damaged_object_fails_and_commits_nothing_below(tmp_path):
    """A raw object damaged on the fast tier is never encoded under its name: the flush fails,
    names it, and the lower tier gets neither the object nor the version."""
    import os

    from forkpoint.format.objects import object_key

    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    repo = fp.Repo(tiers=[fp.tier(fast, flush_every=2), slow], create=True, codec="auto")
    choice_for(repo.stores[0]).rates.update({False: 2e9, True: 1e9})
    choice_for(repo.stores[1]).rates.update({False: 1e8, True: 4e8})
    w = compressible(3 * MiB, seed=4)
    first = repo.save({"w": w, "n": np.arange(10)}, step=0)
    obj = repo.manifest(first.id).leaves[0].chunks[0].object
    path = os.path.join(fast, object_key(obj))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 8)
    second = repo.save({"w": w, "n": np.arange(10) + 1}, step=1)  # reuses the damaged object
    repo.drain()
    errors = repo.stats()["flush_errors"]
    assert [e["version"] for e in errors] == [second.id] and obj in errors[0]["error"]
    assert "does not match its hash" in errors[0]["error"]
    assert not os.path.exists(os.path.join(slow, object_key(obj)))
    assert fp.Repo(slow).branches() == {}, "nothing was committed below"
    repo.close()
