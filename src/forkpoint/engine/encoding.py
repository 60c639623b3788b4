"""Raw or encoded, and which codec: the one place a chunk's way to the store is decided.

The rule (`route_chunk`, per chunk of a save; the codec policy of a leaf is that of the first
`codec` rule whose path glob matches it):
1. "raw": written raw.
2. `fp.Lossy(...)`: the values are rounded first (float dtypes the mode supports), then the
   chunk goes on as under "lossless".
3. With deltas (`fp.Delta`), a tensor chunk under any policy but "raw" is stored as a delta
   against its parent's value where that codes smaller (engine.delta, at its write).
4. "auto": encoded in saves the store's AutoChoice picks for encoding (it times saves written
   each way and keeps what it learnt in the store, engine.autocodec), else raw.
5. "lossless", "zstd" and lossy: encoded before the write, by a task of its own, paced
   (engine.pacing): on a store that paces encoding (local disk), a chunk is encoded only while
   the store, not the CPU, bounds the save, and a save the pacer's memory times as faster raw
   is written raw; a store that does not pace (memory, remote: `Store.paces_encoding`) has
   every chunk encoded. Saves of fewer than twice the I/O slots' chunks encode them all. For
   the smallest checkpoint whatever it costs, `repo.compact()` encodes what a save left raw.
6. With `encode_later`, a chunk under "lossless" or "zstd" is written raw where raw saves
   measure faster on the store, and encoded in place after the commit (background
   compaction, repo/compaction.py); `repo.compact()` does the same for any version later.
An encoding that is not MIN_GAIN (codecs.registry) smaller than the raw bytes is stored raw.
Flushes to a slower tier apply rule 4 to the destination store (repo/placement.py).
"""

import fnmatch
from dataclasses import dataclass

import numpy as np

from ..codecs.registry import POLICIES, codec_for
from ..codecs.lossy import Lossy, supports


def codec_rules(codec) -> list[tuple[str, str]]:
    """Normalise `codec` (a policy, or {path glob: policy} with an optional "*" default) into
    ordered (pattern, policy) rules ending with a catch-all."""
    items = list(codec.items()) if isinstance(codec, dict) else [("*", codec)]
    rules = []
    for pattern, policy in items:
        policy = "raw" if policy == "none" else policy
        if not isinstance(policy, Lossy) and policy not in POLICIES:
            raise ValueError(f"codec must be one of {POLICIES + ('none',)} or fp.Lossy(...), "
                             f"got {policy!r} for {pattern!r}")
        rules.append((pattern, policy))
    rules.sort(key=lambda r: r[0] == "*")
    if rules[-1][0] != "*":
        rules.append(("*", "raw"))
    return rules


def policy_for(rules: list[tuple[str, str]], path: str) -> str:
    """The policy of the first of `rules` (from codec_rules) whose pattern matches `path`."""
    return next(policy for pattern, policy in rules if fnmatch.fnmatchcase(path, pattern))


ENCODING_POLICIES = ("lossless", "zstd")


def policy_codec(policy, itemsize: int, floating: bool):
    """The codec a chunk under `policy` is encoded with (a lossy policy's rounded values go
    through the lossless codec)."""
    return codec_for("lossless" if isinstance(policy, Lossy) else policy, itemsize, floating)


def pack_kind(d) -> tuple[int, bool]:
    """(element size, floating) a pack of leaves like `d` is coded by (see packed_element)."""
    return packed_element(*element_kind(d))


def packed_element(itemsize: int, floating: bool) -> tuple[int, bool]:
    """(element size, floating) a pack holding leaves of these elements is coded by:
    floating-point leaves pack by element size, so that the float codec splits each pack into
    the right planes; everything else packs together and is coded as bytes."""
    return (itemsize, True) if floating else (1, False)


def element_kind(d) -> tuple[int, bool]:
    """(bytes per element, whether it is floating point) of a leaf's data."""
    return element_of(d.kind, d.dtype, d.local_shape, int(d.data.nbytes))


def element_of(kind: str, dtype: str, shape, nbytes: int) -> tuple[int, bool]:
    """(bytes per element, whether it is floating point) of `nbytes` of `shape` elements of
    a `kind` leaf of `dtype` (what chooses a chunk's codec). A complex element counts as its
    two floats, so codecs and lossy rounding see the real and imaginary parts apart."""
    count = int(np.prod(shape)) if shape else 1
    itemsize = nbytes // count if count else 1
    floating = kind in ("torch", "numpy") and dtype.startswith(("float", "bfloat", "complex"))
    if floating and dtype.startswith("complex") and itemsize > 1:
        itemsize //= 2
    return itemsize, floating


def row_elements(shape, nbytes: int, itemsize: int) -> int:
    """Elements (of `itemsize`) in one index of dim 0 of a leaf of `shape` and `nbytes`: the
    rows a chunk holds whole (chunks split dim 0); 0 for fewer than two dimensions."""
    if len(shape) < 2 or not shape[0] or itemsize < 1:
        return 0
    return nbytes // shape[0] // itemsize



@dataclass(frozen=True)
class ChunkRoute:
    """How one chunk goes to the store (see route_chunk): the `policy` it is written under
    (made "raw" where the rule says so), `lossy` rounding, whether it may become a `delta`,
    whether it is written raw and encoded `later`, whether it `encodes` at all, whether it is
    known to be raw at its capture (`raw_now`: the store's own object buffer can hold it), and
    whether it is encoded `ahead` of its write by a paced task."""

    policy: object
    lossy: Lossy | None
    delta: bool
    later: bool
    encodes: bool
    raw_now: bool
    ahead: bool


def route_chunk(policy, itemsize: int, floating: bool, kind: str, deltas: bool, writer, pacer,
                nbytes: int) -> ChunkRoute:
    """The route of a chunk of `nbytes` under `policy`, of elements of `itemsize` (`floating`)
    in a leaf of `kind`, by the module's rule. `deltas`: the save stores deltas; `writer` (an
    ObjectWriter: `encodes_later`, `encodes_auto`, `defers`) and `pacer` (an EncodePacer:
    `add`, `paced`) hold what the save measured; a chunk encoded ahead is counted by the pacer."""
    lossy = policy if isinstance(policy, Lossy) and supports(itemsize, floating) else None
    delta = deltas and policy != "raw" and kind in ("torch", "numpy")
    later = lossy is None and not delta and writer.encodes_later(policy)
    encodes = not later and (policy in ENCODING_POLICIES or (policy == "auto" and writer.encodes_auto()))
    raw_now = policy == "raw" or later or (policy == "auto" and not encodes and not delta)
    ahead = (not raw_now and not delta and policy != "auto" and not writer.defers
             and policy_codec(policy, itemsize, floating).id != 0)
    if ahead:
        pacer.add(nbytes)
        if lossy is None and not pacer.paced:  # the pacer's memory times this save faster raw
            return ChunkRoute("raw", None, False, False, False, True, False)
    return ChunkRoute(policy, lossy, delta, later, encodes, raw_now, ahead)
