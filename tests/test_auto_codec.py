"""codec="auto": encode a chunk only where the sample's ratio and encode speed beat the store's
write bandwidth, so that compression never makes a save slower; round trips stay exact.
The bandwidths are extreme (1 MB/s, 1e15 B/s) so that the decisions hold on a loaded machine."""

import numpy as np

import forkpoint as fp
from forkpoint.engine.save import ObjectWriter
from forkpoint.format.codecs import codec_for


def compressible(n=1 << 20):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(n) * 1e-3).astype(np.float32).astype(np.float16).astype(np.float32)


def test_decision_follows_the_bandwidth(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    writer = ObjectWriter(repo.store, "auto")
    data = compressible().view(np.uint8)
    codec = codec_for("auto", 4, True)
    writer.write_bandwidth = None
    assert not writer.worth_encoding(data, codec, 4), "unknown bandwidth (fast local disk): raw"
    writer.write_bandwidth = 1e6
    assert writer.worth_encoding(data, codec, 4), "a slow store (1 MB/s): encoding saves time"
    writer.write_bandwidth = 1e15
    assert not writer.worth_encoding(data, codec, 4), "an infinitely fast store: never worth it"
    noise = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    writer.write_bandwidth = 1e6
    assert not writer.worth_encoding(noise, codec_for("auto", 1, False), 1), "incompressible: raw"


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
