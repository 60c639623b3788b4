"""The one encoding rule (engine.encoding.route_chunk), with the save's measurements injected:
no test here depends on this machine's load or timing."""

from dataclasses import dataclass, field

import pytest

import forkpoint as fp
from forkpoint.engine.encoding import route_chunk


@dataclass
class Writer:
    """What a save's ObjectWriter measured: whether raw saves measure faster (`later` applies
    then, where it `defers`), and whether codec="auto" encodes this save."""

    raw_faster: bool = False
    auto_encodes: bool = True
    defers: bool = False

    def encodes_later(self, policy) -> bool:
        return self.defers and policy in ("lossless", "zstd") and self.raw_faster

    def encodes_auto(self) -> bool:
        return self.auto_encodes


@dataclass
class Pacer:
    """What the pacer's memory picked for this save (`paced` False: written raw)."""

    paced: bool = True
    counted: list = field(default_factory=list)

    def add(self, nbytes: int) -> None:
        self.counted.append(nbytes)


def route(policy, writer=None, pacer=None, itemsize=4, floating=True, kind="torch", deltas=False):
    return route_chunk(policy, itemsize, floating, kind, deltas, writer or Writer(), pacer or Pacer(), 1 << 20)


def test_raw_is_raw_and_lossless_is_encoded_ahead_by_a_paced_task():
    r = route("raw")
    assert (r.policy, r.encodes, r.raw_now, r.ahead) == ("raw", False, True, False)
    pacer = Pacer()
    r = route("lossless", pacer=pacer)
    assert (r.policy, r.encodes, r.raw_now, r.ahead) == ("lossless", True, False, True)
    assert pacer.counted == [1 << 20], "the pacer counts the chunks it may encode"


def test_a_save_the_pacer_times_faster_raw_writes_its_lossless_chunks_raw():
    r = route("lossless", pacer=Pacer(paced=False))
    assert (r.policy, r.encodes, r.raw_now, r.ahead) == ("raw", False, True, False)


@pytest.mark.parametrize("encodes", [True, False])
def test_auto_follows_the_stores_learnt_choice(encodes):
    r = route("auto", writer=Writer(auto_encodes=encodes))
    assert (r.encodes, r.raw_now, r.ahead) == (encodes, not encodes, False)


def test_encode_later_writes_raw_now_only_where_raw_saves_measure_faster():
    later = route("lossless", writer=Writer(defers=True, raw_faster=True))
    assert (later.later, later.encodes, later.raw_now) == (True, False, True)
    now = route("lossless", writer=Writer(defers=True, raw_faster=False))
    assert (now.later, now.encodes, now.raw_now, now.ahead) == (False, True, False, False)


def test_lossy_rounds_supported_floats_and_leaves_integers_exact():
    mode = fp.Lossy(rel_error=1e-3)
    r = route(mode, pacer=Pacer(paced=False))
    assert r.lossy is mode and r.ahead, "a lossy chunk is rounded even where the save writes raw"
    assert route(mode, itemsize=8, floating=False).lossy is None


def test_deltas_apply_to_tensor_chunks_under_any_policy_but_raw():
    assert route("lossless", deltas=True).delta and not route("lossless", deltas=True).ahead
    assert not route("raw", deltas=True).delta
    assert not route("lossless", deltas=True, kind="bytes").delta
