"""Round trips of state trees: random trees, every dtype, views, aliases, Python values."""

import argparse
import dataclasses
import datetime
import enum
import math
import pathlib
import random
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import forkpoint as fp
from forkpoint.errors import UnsupportedTypeError


def assert_tree_equal(a, b):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.numel():
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=64),
                    st.complex_numbers(allow_nan=False, allow_infinity=False))
arrays = hnp.arrays(st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_,
                                     np.complex64]),
                    hnp.array_shapes(min_dims=0, max_dims=3, max_side=6))
tensors = arrays.map(lambda a: torch.from_numpy(a.copy()))
keys = st.one_of(st.text(min_size=1, max_size=8), st.integers(0, 50))
trees = st.recursive(st.one_of(scalars, arrays, tensors),
                     lambda children: st.one_of(st.lists(children, max_size=4),
                                                st.tuples(children, children),
                                                # keys 0 and "0" share a state path: refused by design
                                                st.lists(st.tuples(keys, children), max_size=4,
                                                         unique_by=lambda kv: str(kv[0])).map(dict)),
                     max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees)
def test_random_trees_round_trip(repo, tree):
    v = repo.save({"t": tree})
    assert_tree_equal({"t": tree}, repo.load(v.id))


def all_torch_dtypes():
    """Every dtype this torch defines, except the quantized ones (refused with a clear error)."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return sorted((d for d in dtypes if not str(d).startswith(("torch.qint", "torch.quint"))), key=str)


@pytest.mark.parametrize("dtype", all_torch_dtypes(), ids=str)
def test_every_torch_dtype(repo, dtype):
    raw = torch.randint(0, 256, (7, 5 * torch.tensor([], dtype=dtype).element_size()), dtype=torch.uint8)
    t = raw.view(dtype)
    if dtype.is_floating_point and dtype.itemsize >= 2 and not str(dtype).startswith("torch.float8"):
        t = torch.randn(7, 5).to(dtype)
    scalar = raw[0, :torch.tensor([], dtype=dtype).element_size()].view(dtype).reshape(())
    state = {"x": t, "scalar": scalar, "empty": raw[:0].view(dtype)}
    repo.save(state)
    out = repo.load()
    for k in state:
        assert out[k].dtype == dtype
        assert_tree_equal(state[k], out[k])


def test_non_contiguous_views_and_requires_grad(repo):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    p = torch.nn.Parameter(torch.randn(3, 3))
    state = {"t": base.t(), "slice": base[::2, 3:7], "exp": torch.ones(1, 4).expand(5, 4),
             "conj": torch.randn(3, dtype=torch.complex64).conj(), "param": p}
    repo.save(state)
    out = repo.load()
    for k in ("t", "slice", "exp", "conj"):
        assert torch.equal(out[k], state[k].resolve_conj()), k
        assert out[k].is_contiguous()
    assert torch.equal(out["param"], p.detach())


def test_numpy_and_python_values(repo):
    state = {"a": np.arange(12, dtype=">i4").reshape(3, 4), "f": np.float32(2.5), "i": np.int64(7),
             "big": b"x" * 10000, "none": None, "s": "héllo/~", "key/with~slash": 1,
             0: "int key", "nan": float("nan"), "inf": -float("inf"), "c": 1 + 2j,
             "dtype": torch.bfloat16, "device": torch.device("cpu")}
    repo.save(state)
    out = repo.load()
    np.testing.assert_array_equal(out["a"], state["a"])
    assert out["f"] == np.float32(2.5) and isinstance(out["f"], np.float32)
    assert out["i"] == 7 and isinstance(out["i"], np.int64)
    assert out["big"] == state["big"] and out[0] == "int key" and out["key/with~slash"] == 1
    assert math.isnan(out["nan"]) and out["inf"] == -float("inf") and out["c"] == 1 + 2j
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert out["s"] == "héllo/~" and out["none"] is None


def test_tied_weights_stored_once_and_restored_shared(repo):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(1000, 256)
            self.head = torch.nn.Linear(256, 1000, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    v = repo.save({"model": m})
    assert v.logical_bytes == 1000 * 256 * 4
    assert v.stored_bytes < 1.1 * 1000 * 256 * 4
    out = repo.load()
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    m2 = Tied()
    repo.restore({"model": m2}, "main")
    assert m2.emb.weight is m2.head.weight
    assert torch.equal(m2.emb.weight, m.emb.weight)


class Thing:
    def __init__(self):
        self.x = 3


def test_empty_leaves_have_no_chunks_and_later_saves_build_on_them(repo):
    """A version whose only small leaves are empty used to record a chunk of object "" (its
    pack had no bytes), and every later save on the branch then failed reading the head."""
    from forkpoint.format.manifest import Leaf

    first = repo.save({"e": torch.empty(0, 3), "n": np.zeros((0,), np.float32), "b": b""})
    assert [leaf.chunks for leaf in repo.manifest(first.id).leaves] == [[], []]
    second = repo.save({"e": torch.empty(0, 3), "x": torch.ones(3)})
    assert repo.load(first.id)["e"].shape == (0, 3) and torch.equal(repo.load()["x"], torch.ones(3))
    live = {"e": torch.empty(0, 3), "x": torch.zeros(3)}
    repo.restore(live)
    assert torch.equal(live["x"], torch.ones(3)) and repo.verify().problems == []
    assert {d.path: d.status for d in repo.diff(first.id, second.id)}["e"] == "same"
    legacy = {"path": "e", "kind": "torch", "dtype": "float32", "shape": [0, 3], "nbytes": 0, "device": "cpu",
              "chunks": [{"offsets": [0, 0], "lengths": [0, 3], "hash": "a" * 64, "object": "", "start": 0,
                          "size": 0, "codec": "raw"}]}
    assert Leaf.from_json(legacy).chunks == []  # what such versions recorded reads as no chunk


def test_unsupported_type_needs_pickle(repo):
    with pytest.raises(UnsupportedTypeError, match=r"state path 'cfg/thing'.*Thing.*allow_pickle"):
        repo.save({"cfg": {"thing": Thing()}})
    assert repo.head("main") is None
    v = repo.save({"cfg": {"thing": Thing()}}, allow_pickle=True)
    with pytest.raises(UnsupportedTypeError, match="cfg/thing.*pickle"):
        repo.load(v.id)
    assert repo.load(v.id, allow_pickle=True)["cfg"]["thing"].x == 3


COMMON_VALUES = {
    "args": (lambda: argparse.Namespace(lr=0.1, epochs=3), "vars(args)", {"lr": 0.1, "epochs": 3}),
    "cfg": (lambda: _Config(), "dataclasses.asdict(cfg)", {"lr": 0.1, "layers": [2, 3]}),
    "color": (lambda: _Color.RED, "color.value (or .name)", 1),
    "seen": (lambda: {3, 1, 2}, "sorted(seen) (or list)", [1, 2, 3]),
    "where": (lambda: pathlib.Path("/data/run"), "str(where)", "/data/run"),
    "started": (lambda: datetime.datetime(2026, 1, 2, 3, 4), "started.isoformat()", "2026-01-02T03:04:00"),
    "budget": (lambda: datetime.timedelta(minutes=2), "budget.total_seconds()", 120.0),
}


class _Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Config:
    lr: float = 0.1
    layers: list = dataclasses.field(default_factory=lambda: [2, 3])


@pytest.mark.parametrize("name", sorted(COMMON_VALUES))
def test_a_common_value_without_pickle_is_refused_with_the_plain_form_to_store(repo, name):
    """The values a torch.save checkpoint often holds (an argparse Namespace, a dataclass
    config, an enum, a set, a path, a time) are refused with the expression that stores
    them as plain data, and that expression's value saves and loads back as it is."""
    make, expression, plain = COMMON_VALUES[name]
    with pytest.raises(UnsupportedTypeError, match=rf"state path 'run/{name}' holds a value of type .*: "
                                                   rf"store {re.escape(expression)} instead"):
        repo.save({"run": {name: make()}})
    value = make()
    converted = eval(expression.split(" (or")[0], {"dataclasses": dataclasses, name: value})
    repo.save({"run": {name: converted}})
    assert repo.load()["run"][name] == plain


def test_unsupported_tensor_kinds(repo):
    with pytest.raises(UnsupportedTypeError, match="quantized tensor"):
        repo.save({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)})
    with pytest.raises(UnsupportedTypeError, match="sparse"):
        repo.save({"s": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedTypeError, match="sparse tensor .*sparse_csr"):
        repo.save({"s": torch.eye(3).to_sparse_csr()})
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
        with pytest.raises(UnsupportedTypeError, match=r"state path 'n/t' holds a nested tensor.*unbind"):
            repo.save({"n": {"t": nested}})
    with pytest.raises(UnsupportedTypeError, match="object"):
        repo.save({"o": np.array([object()], dtype=object)})
    with pytest.raises(UnsupportedTypeError, match=r"state path 'm/w' is a meta tensor.*to_empty"):
        repo.save({"m": {"w": torch.empty(3, 2, device="meta")}})
    assert not repo.branches()


def test_keys_that_share_a_path_are_refused_before_anything_is_written(repo):
    """An int key and its digits as a str key would give two leaves one path, which a restore
    cannot tell apart (it once committed such a version and then failed to restore it)."""
    repo.save({"w": torch.ones(2)})
    head = repo.head()
    for state in ({"opt": {1: torch.zeros(3), "1": torch.ones(3)}}, {"a": {"1": 2, 1: torch.ones(3)}}):
        with pytest.raises(UnsupportedTypeError, match=r"state path '(opt|a)' has dict keys .* share the state path '(opt|a)/1'"):
            repo.save(state)
    assert repo.head() == head and repo.verify().ok
    state = {"opt": {1: torch.zeros(3), "2": torch.ones(3), "a/b": torch.full((2,), 3.0), "a~1b": torch.ones(1)}}
    repo.save(state)
    out = {"opt": {1: torch.empty(3), "2": torch.empty(3), "a/b": torch.empty(2), "a~1b": torch.empty(1)}}
    repo.restore(out)
    assert all(torch.equal(out["opt"][k], state["opt"][k]) for k in state["opt"])


def test_map_location_and_device_recorded(repo):
    repo.save({"w": torch.ones(3)})
    assert repo.manifest().leaves[0].device == "cpu"
    out = repo.load(map_location="meta")
    assert out["w"].device.type == "meta"
    assert repo.load(map_location={"cpu": "meta"})["w"].device.type == "meta", "a dict maps saved devices"
    assert repo.load(map_location={"cuda:1": "cuda:0"})["w"].device.type == "cpu", "others stay where saved"
    seen = []
    got = repo.load(map_location=lambda t, saved_on: seen.append(saved_on) or t.double())["w"]
    assert seen == ["cpu"] and got.dtype == torch.float64


def test_large_leaf_is_chunked_and_small_leaves_packed(tmp_path):
    from forkpoint.engine import SaveOptions

    r = fp.Repo(str(tmp_path / "r"), create=True,
                options=SaveOptions(chunk_bytes=1 << 20, small_leaf_bytes=64 << 10))
    big = torch.randn(1000, 1000)
    small = {f"s{i}": torch.full((10,), float(i)) for i in range(50)}
    r.save({"big": big, **small})
    m = r.manifest()
    big_leaf = next(leaf for leaf in m.leaves if leaf.path == "big")
    assert len(big_leaf.chunks) == 4
    assert [c.offsets[0] for c in big_leaf.chunks] == [0, 262, 524, 786]
    small_objects = {leaf.chunks[0].object for leaf in m.leaves if leaf.path.startswith("s")}
    assert len(small_objects) == 1
    out = r.load()
    assert torch.equal(out["big"], big) and torch.equal(out["s7"], small["s7"])
    r.close()


def test_memory_store_and_zstd_codec(tmp_path):
    r = fp.Repo("mem://t1", create=True, codec="zstd")
    state = {"z": torch.zeros(1 << 18), "r": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)}
    r.save(state)
    r.drain()
    assert r.du()["objects_bytes"] < (1 << 20) + 100_000
    assert set(r.du()["codecs"]) == {"zstd", "raw"}
    out = r.load()
    assert torch.equal(out["z"], state["z"]) and torch.equal(out["r"], state["r"])
    r.close()


RNGS = {
    "numpy Generator": (lambda: np.random.default_rng(7), "rng.bit_generator.state",
                        lambda state: _set(np.random.default_rng(), "bit_generator", state).random()),
    "numpy RandomState": (lambda: np.random.RandomState(7), "rng.get_state()",
                          lambda state: _call(np.random.RandomState(), "set_state", state).rand()),
    "random.Random": (lambda: random.Random(7), "rng.getstate()",
                      lambda state: _call(random.Random(), "setstate", state).random()),
    "torch.Generator": (lambda: torch.Generator().manual_seed(7), "rng.get_state()",
                        lambda state: torch.rand(1, generator=_call(torch.Generator(), "set_state", state)).item()),
}


def _set(obj, attribute, value):
    getattr(obj, attribute).state = value
    return obj


def _call(obj, method, value):
    getattr(obj, method)(value)
    return obj


@pytest.mark.parametrize("kind", sorted(RNGS))
def test_a_random_generator_is_refused_with_its_state_to_store_and_that_state_resumes_it(repo, kind):
    """A generator object of numpy, Python or torch in the state: the error names its state
    expression, and that state, saved and loaded, continues the same stream."""
    make, expression, next_draw = RNGS[kind]
    with pytest.raises(UnsupportedTypeError, match=rf"store {re.escape(expression)} instead"):
        repo.save({"rng": make()})
    saved = make()
    repo.save({"rng": eval(expression, {"rng": saved})})
    reference = make()
    expected = next_draw(eval(expression, {"rng": reference}))
    assert next_draw(repo.load()["rng"]) == expected
