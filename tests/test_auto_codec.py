"""codec="auto": encode a chunk only where the ratio and the encoders' speed beat the store's
write bandwidth, so that compression never makes a save slower; round trips stay exact.
The bandwidths are extreme (1 MB/s, 1e15 B/s) or the speeds set, so that the decisions hold
on a loaded machine."""

import threading
import time

import numpy as np
import pytest

import forkpoint as fp
from forkpoint.engine import save
from forkpoint.engine.meter import DECAY, MIN_MEASURED_BYTES, WriteMeter
from forkpoint.engine.save import ObjectWriter, expected_ratio
from forkpoint.format.codecs import codec_for


def compressible(n=1 << 20):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(n) * 1e-3).astype(np.float32).astype(np.float16).astype(np.float32)


def writer_with_bandwidth(tmp_path, bandwidth):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    writer = ObjectWriter(repo.store, "auto")
    writer.meter.best = bandwidth
    return writer


def test_decision_follows_the_bandwidth(tmp_path):
    writer = writer_with_bandwidth(tmp_path, None)
    data = compressible().view(np.uint8)
    codec = codec_for("auto", 4, True)
    assert not writer.worth_encoding(data, codec, 4), "unknown bandwidth (fast local disk): raw"
    writer.meter.best = 1e6
    assert writer.worth_encoding(data, codec, 4), "a slow store (1 MB/s): encoding saves time"
    writer.meter.best = 1e15
    assert not writer.worth_encoding(data, codec, 4), "an infinitely fast store: never worth it"
    noise = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    writer.meter.best = 1e6
    assert not writer.worth_encoding(noise, codec_for("auto", 1, False), 1), "incompressible: raw"


def test_encoders_on_every_core_outpacing_the_store_encode(tmp_path, monkeypatch):
    """A store a little slower than one encoder: encoding one chunk and then writing it is
    slower than writing it raw, but the save's encoders on two cores outpace the store, so
    a save that encodes every chunk overlaps encoding with writing and finishes sooner."""
    monkeypatch.setattr(save, "CORES", 2)
    data = compressible().view(np.uint8)
    codec = codec_for("auto", 4, True)
    writer = writer_with_bandwidth(tmp_path, 1e9)
    writer.store.encode_speeds[codec.name] = 1e9
    ratio = expected_ratio(data, codec, 4)
    assert 1 / 1e9 + 1 / (ratio * 1e9) > 1 / 1e9, "one chunk encoded then written: slower"
    assert writer.worth_encoding(data, codec, 4), "two encoders at 2 GB/s against 1 GB/s: encode"
    writer.meter.best = 1.5e9
    assert not writer.worth_encoding(data, codec, 4), "2 GB/s is not clearly above 1.5 GB/s: raw"
    monkeypatch.setattr(save, "CORES", 4)
    assert writer.worth_encoding(data, codec, 4), "four cores: encode"


def test_one_slow_encode_does_not_turn_encoding_off(tmp_path):
    writer = writer_with_bandwidth(tmp_path, 1e9)
    codec = codec_for("auto", 4, True)
    writer._encoded(codec, 4 << 20, 1.0)
    assert writer.store.encode_speeds[codec.name] >= 0.7 * save.ASSUMED_ENCODE_SPEED
    for _ in range(30):
        writer._encoded(codec, 4 << 20, 1.0)
    assert writer.store.encode_speeds[codec.name] < 10e6, "a codec that stays slow is believed"


def test_expected_ratio_is_close_to_the_encoded_ratio():
    data = compressible(1 << 22).view(np.uint8)
    codec = codec_for("lossless", 4, True)
    actual = data.nbytes / len(codec.encode(memoryview(data), 4))
    assert expected_ratio(data, codec, 4) == pytest.approx(actual, rel=0.1)
    ints = np.arange(1 << 20, dtype=np.int64).view(np.uint8)
    assert expected_ratio(ints, codec_for("lossless", 8, False), 8) > 2


def test_meter_measures_the_store_while_busy_not_per_write():
    """Four concurrent writes of 4 MiB that each take 50 ms: the store wrote 16 MiB in about
    50 ms, not 4 MiB (what one write's own rate says); idle time between them does not count;
    a slower period later lowers it by at most the decay; failed and unmeasured writes add no bytes."""
    meter = WriteMeter()
    n = 4 << 20

    def write():
        with meter.measuring(n):
            time.sleep(0.05)

    for _ in range(2):
        threads = [threading.Thread(target=write) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.1)
    per_write = n / 0.05
    assert meter.bandwidth > 2 * per_write, meter
    assert meter.inflight == 0 and meter.active == 0
    best = meter.bandwidth
    with meter.measuring(MIN_MEASURED_BYTES):
        time.sleep(0.2)
    assert meter.bandwidth == pytest.approx(DECAY * best), "a slower period decays the best rate, no more"
    with meter.measuring(0):
        time.sleep(0.01)
    with pytest.raises(OSError):
        with meter.measuring(MIN_MEASURED_BYTES * 4):
            raise OSError("disk full")
    assert meter.inflight == 0 and meter.active == 0
    assert meter.bandwidth == pytest.approx(DECAY * best), "nothing measured: unchanged"


def test_auto_round_trips_and_uses_the_store_hint(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="auto")
    repo.store.bandwidth_hint = 1e6
    state = {"w": compressible(), "noise": np.random.default_rng(2).integers(0, 255, 1 << 21, dtype=np.uint8)}
    v = repo.save(state)
    back = repo.load(v.id)
    assert np.array_equal(back["w"], state["w"]) and np.array_equal(back["noise"], state["noise"])
    codecs = {lf.path: {c.codec for c in lf.chunks} for lf in repo.manifest(v.id).leaves}
    assert codecs["w"] == {"float-planes"} and codecs["noise"] == {"raw"}
    assert repo.verify(v.id).ok


def test_a_raw_save_measures_the_store(tmp_path):
    """Raw writes of a real save measure the local disk; the next save's decisions use it."""
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="auto")
    rng = np.random.default_rng(3)
    repo.save({f"w{i}": rng.integers(0, 255, 4 << 20, dtype=np.uint8) for i in range(4)})
    bandwidth = ObjectWriter(repo.store, "auto").meter.bandwidth
    assert bandwidth is not None and bandwidth > 1e6
