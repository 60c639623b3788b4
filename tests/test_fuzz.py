"""Fuzzing of everything read from storage: manifests, ref records and objects (every codec,
the C kernels behind the float codec included). Any input may be refused, only ever with a
ForkpointError; a crash, a hang or another exception fails. `make test` runs a bounded number
of examples; `make fuzz` (FORKPOINT_FUZZ_EXAMPLES) runs many more. Inputs that once failed
are kept in tests/fuzz_corpus/ and replayed here as regression tests.
"""

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forkpoint as fp
from forkpoint.errors import ForkpointError
from forkpoint.codecs.registry import CODECS
from forkpoint.format.manifest import Manifest, _record_id
from forkpoint.format.objects import content_hash, decode_object, pack_header
from forkpoint.format.refs import decode_record, encode_record

EXAMPLES = int(os.environ.get("FORKPOINT_FUZZ_EXAMPLES", "150"))
CORPUS = os.path.join(os.path.dirname(__file__), "fuzz_corpus")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="FORKPOINT_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


def _payloads() -> dict[str, tuple[bytes, str, int]]:
    """Valid objects (bytes, name, decoded length) of each codec and float-codec layout."""
    rng = np.random.default_rng(0)
    moments = (np.abs(rng.standard_normal((64, 256))) * np.logspace(-8, -2, 256)).astype(np.float32)
    weights = rng.standard_normal(1 << 16).astype(np.float32)
    delta = np.zeros(1 << 16, np.uint32)
    delta[rng.integers(0, delta.size, 500)] = rng.integers(1, 2**20, 500)
    sources = {
        "float32": (weights.tobytes(), 4, 0),
        "bf16 rows": (moments.view(np.uint16)[:, 1::2].copy().tobytes(), 2, 128),
        "sparse delta": (delta.tobytes(), 4, 0),
        "positive": (np.abs(weights).tobytes(), 4, 256),
        "float64": (rng.standard_normal(4096).tobytes(), 8, 0),
        "ints": (np.arange(20000, dtype=np.int64).tobytes(), 8, 0),
    }
    out = {}
    for name, (data, itemsize, row) in sources.items():
        for codec in CODECS.values():
            if codec.name == "float-planes" and itemsize == 1:
                continue
            payload = b"".join(bytes(memoryview(p).cast("B")) for p in codec.pieces(data, itemsize, row=row))
            out[f"{name} {codec.name}"] = (pack_header(codec.id, len(data)) + payload, content_hash(data), len(data))
    return out


PAYLOADS = _payloads()


def mutated(base: bytes, edits, cut) -> bytes:
    data = bytearray(base)
    for where, value in edits:
        data[where % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    return bytes(data)


edits = st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=8)
# edits near the front hit headers and tables, where lies about sizes live
head_edits = st.lists(st.tuples(st.integers(0, 600), st.integers(0, 255)), max_size=6)


def refuse_only_cleanly(fn, *args):
    try:
        fn(*args)
    except ForkpointError:
        pass


@FUZZ
@given(name=st.sampled_from(sorted(PAYLOADS)), edits=edits, head=head_edits,
       cut=st.none() | st.integers(0, 1 << 30))
def test_objects_of_every_codec_decode_or_are_refused(name, edits, head, cut):
    blob, digest, length = PAYLOADS[name]
    data = mutated(blob, edits + head, cut)
    refuse_only_cleanly(decode_object, data, digest, "fuzzed", True, length)


def _manifest_record() -> dict:
    import torch

    repo = fp.Repo("mem://fuzz-manifest", create=True)
    v = repo.save({"w": torch.arange(12.0).reshape(3, 4), "s": torch.tensor(2), "l": [1, 2.5, "x", None, b"ab"],
                   "n": np.arange(5), "d": {"k": torch.ones(2, dtype=torch.bfloat16)}, "t": torch.float16})
    return json.loads(repo.store.read(f"versions/{v.id}.json"))


RECORD = _manifest_record()
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=12),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=6)


def _places(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _places(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _places(v, path + (i,))


PLACES = [p for p in _places(RECORD) if p and p[0] not in ("id", "format", "format_version")]


def _set(record, path, value):
    node = record
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PLACES), json_values), min_size=1, max_size=3))
def test_crafted_manifests_load_or_are_refused(tmp_path_factory, changes):
    """A manifest changed anywhere and re-sealed under its new id (what an attacker writes):
    parsing it and, when it parses, loading every leaf of it raise ForkpointError or succeed."""
    record = json.loads(json.dumps(RECORD))
    for path, value in changes:
        try:
            _set(record, path, value)
        except (KeyError, IndexError, TypeError):
            pass
    record["id"] = ""
    try:
        record["id"] = _record_id(record)
    except (ValueError, TypeError):  # not JSON any more (NaN, keys of two types): no file to craft
        return
    data = json.dumps(record).encode()
    repo = fp.Repo("mem://fuzz-manifest")
    repo.store.write(f"versions/{record['id']}.json", [data])
    try:
        Manifest.from_bytes(data, "fuzzed")
        repo.load(record["id"])
    except ForkpointError:
        pass
    finally:
        repo.store.delete(f"versions/{record['id']}.json")
        repo.close()


@FUZZ
@given(data=st.binary(max_size=300) | st.builds(
    lambda e, cut: mutated(encode_record(7, "ab" * 12, 1.5, "w"), e, cut), edits, st.none() | st.integers()))
def test_ref_records_decode_or_are_refused(data):
    refuse_only_cleanly(decode_record, data, "fuzzed", 7)


def corpus_cases():
    if not os.path.isdir(CORPUS):
        return []
    return sorted(os.path.join(CORPUS, f) for f in os.listdir(CORPUS) if f.endswith(".bin"))


@pytest.mark.parametrize("path", corpus_cases(), ids=os.path.basename)
def test_inputs_that_once_failed_are_refused_cleanly(path):
    """Each corpus file, `<target>-<name>.bin`: a JSON first line (the target, its arguments and
    why the input is kept), then the input, which must be refused with a ForkpointError."""
    with open(path, "rb") as f:
        head, data = f.read().split(b"\n", 1)
    args = json.loads(head)
    with pytest.raises(ForkpointError):
        if args["target"] == "object":
            decode_object(data, args["digest"], "corpus", True, args["length"])
        elif args["target"] == "manifest":
            Manifest.from_bytes(data, "corpus")
        else:
            decode_record(data, "corpus", args.get("seq"))


def test_the_fuzzed_payloads_cover_every_codec_and_float_layout():
    from forkpoint.codecs import floatcodec

    names = {n.rsplit(" ", 1)[-1] for n in PAYLOADS} | {n.split(" ")[-1] for n in PAYLOADS}
    assert {c.name for c in CODECS.values()} <= names
    versions = {PAYLOADS[n][0][16] for n in PAYLOADS if n.endswith("float-planes")}
    assert len(versions) >= 3, versions  # plain, grid/seven-bit, matched rows or sparse
    for blob, digest, length in PAYLOADS.values():
        assert content_hash(decode_object(blob, digest, "seed", True, length)) == digest
    assert struct.calcsize("<BBHQI") == 16 and floatcodec.VERSION >= 6
