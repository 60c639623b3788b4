"""Version manifests: the JSON record that makes a version exist.

A manifest holds the version's identity and lineage, its metrics and metadata, the
environment that wrote it, the skeleton of the state tree and the table of stored leaves.
"""

import html
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import blake3

from ..errors import CorruptObjectError, FormatError
from .validate import check_manifest, check_record

FORMAT_VERSION = (1, 4)
MAX_MANIFEST_BYTES = 1 << 30
MANIFEST_KIND = "forkpoint.version"


def check_format(record: dict, kind: str, where: str) -> None:
    """Raise FormatError unless `record` is of `kind` and of a major version this reader knows."""
    if not isinstance(record, dict) or record.get("format") != kind:
        raise FormatError(f"{where} is not a {kind} record")
    version = record.get("format_version")
    if not (isinstance(version, list) and len(version) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in version)):
        raise FormatError(f"{where} has no valid format_version")
    if version[0] > FORMAT_VERSION[0]:
        raise FormatError(
            f"{where} uses format {version[0]}.{version[1]}, newer than this forkpoint reads "
            f"({FORMAT_VERSION[0]}.x); upgrade forkpoint to read it"
        )


@dataclass(slots=True)
class Chunk:
    """One box of a leaf: `offsets`/`lengths` in the global shape, bytes at object[start:start+size]."""

    offsets: list[int]
    lengths: list[int]
    hash: str
    object: str
    start: int
    size: int
    codec: str = "raw"
    lossy: dict | None = None
    delta: dict | None = None

    @property
    def objects(self) -> list[str]:
        """Every object this chunk's bytes come from: a delta chunk's chain, then its own."""
        return [*self.delta["chain"], self.object] if self.delta else [self.object]

    def to_json(self) -> dict:
        """The chunk as a JSON record (optional fields only where set; dicts are shared, not copied)."""
        d = {"offsets": list(self.offsets), "lengths": list(self.lengths), "hash": self.hash,
             "object": self.object, "start": self.start, "size": self.size, "codec": self.codec}
        if self.lossy is not None:
            d["lossy"] = self.lossy
        if self.delta is not None:
            d["delta"] = self.delta
        return d

    @property
    def standalone(self) -> bool:
        """True when the chunk is a whole object by itself (not packed, not a delta)."""
        return self.object == self.hash and self.start == 0 and self.delta is None


@dataclass(slots=True)
class Leaf:
    """A stored array-like leaf: kind, dtype, global shape and the chunks that cover it."""

    path: str
    kind: str
    dtype: str
    shape: list[int]
    nbytes: int
    chunks: list[Chunk] = field(default_factory=list)
    device: str = "cpu"
    alias_of: int | None = None

    @property
    def digest(self) -> tuple:
        """Identity of the leaf's content: equal digests mean equal bytes, dtype and shape."""
        return (self.kind, self.dtype, tuple(self.shape), tuple(c.hash for c in self.chunks))

    @staticmethod
    def from_json(d: dict) -> "Leaf":
        """Parse a leaf record, ignoring fields a later minor format version may add."""
        chunks = [Chunk(**_known(Chunk, c)) for c in d.get("chunks", [])
                  if c.get("object") != "" or c.get("size") != 0]  # empty leaves written before 1.1 fixes
        return Leaf(**{**_known(Leaf, d), "chunks": chunks})

    def to_json(self) -> dict:
        """The leaf as a JSON record (built field by field: `dataclasses.asdict` deep-copies, and cost
        most of a many-leaf commit)."""
        d = {"path": self.path, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
             "nbytes": self.nbytes, "chunks": [c.to_json() for c in self.chunks], "device": self.device}
        if self.alias_of is not None:
            d["alias_of"] = self.alias_of
        return d

    @property
    def lossy(self) -> dict | None:
        """How this leaf was stored lossily (mode, significand bits kept, the largest relative
        error measured at save time), or None when it is stored exactly."""
        infos = [c.lossy for c in self.chunks if c.lossy]
        if not infos:
            return None
        return {**infos[0], "max_rel_error": max(i["max_rel_error"] for i in infos)}


def _record_id(record: dict) -> str:
    """The version id a manifest record should have: 24 hex digits of blake3 over its
    canonical JSON with `id` empty (what `Manifest.seal` computed when it was written)."""
    return blake3.blake3(_canonical({**record, "id": ""})).hexdigest()[:24]


def _canonical(record: dict) -> bytes:
    """A record's canonical JSON: sorted keys, no spaces, no NaN."""
    return _canonical_text(record).encode()


_quote = json.encoder.encode_basestring_ascii


def _ints(values) -> str:
    return "[" + ",".join(map(str, values)) + "]"


def _chunk_canonical(c: Chunk) -> str:
    """`_canonical(c.to_json())` as text, written directly (keys in sorted order)."""
    parts = ['{"codec":', _quote(c.codec)]
    if c.delta is not None:
        parts += [',"delta":', _canonical_text(c.delta)]
    parts += [',"hash":', _quote(c.hash), ',"lengths":', _ints(c.lengths)]
    if c.lossy is not None:
        parts += [',"lossy":', _canonical_text(c.lossy)]
    parts += [',"object":', _quote(c.object), ',"offsets":', _ints(c.offsets), ',"size":', str(int(c.size)),
              ',"start":', str(int(c.start)), "}"]
    return "".join(parts)


def _leaf_canonical(leaf: Leaf) -> str:
    """`_canonical(leaf.to_json())` as text, written directly (a leaf table of many leaves is
    most of a manifest, and the generic encoder sorts and checks every record)."""
    head = '{"chunks":[' if leaf.alias_of is None else f'{{"alias_of":{int(leaf.alias_of)},"chunks":['
    return "".join((head, ",".join(map(_chunk_canonical, leaf.chunks)), '],"device":', _quote(leaf.device),
                    ',"dtype":', _quote(leaf.dtype), ',"kind":', _quote(leaf.kind), ',"nbytes":',
                    str(int(leaf.nbytes)), ',"path":', _quote(leaf.path), ',"shape":', _ints(leaf.shape), "}"))


def _canonical_text(value) -> str:
    """`_canonical` as text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _known(cls, record: dict) -> dict:
    return {k: v for k, v in record.items() if k in cls.__dataclass_fields__}


@dataclass
class Version:
    """The public record of one immutable checkpoint version."""

    id: str
    parents: list[str]
    branch: str
    step: int | None
    time: float
    message: str = ""
    metrics: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    logical_bytes: int = 0
    stored_bytes: int = 0
    env: dict = field(default_factory=dict)
    pruned: bool = False
    tiers: list = field(default_factory=list)

    def summary(self) -> dict:
        """Return the record as plain JSON data."""
        return asdict(self)

    def _repr_html_(self) -> str:
        """A table of the record for Jupyter (every value escaped)."""
        rows = [("id", self.id), ("branch", self.branch), ("step", self.step), ("parents", ", ".join(self.parents)),
                ("message", self.message), ("metrics", self.metrics), ("meta", self.meta),
                ("bytes", f"logical {self.logical_bytes}, newly stored {self.stored_bytes}"),
                ("pruned", self.pruned)]
        return html_table("forkpoint version", rows)


@dataclass
class Manifest:
    """A version record plus its state skeleton and leaf table; `classes` names the class of
    each stateful object (optimizer, scheduler, module) by the state path it was saved at."""

    version: Version
    tree: Any
    leaves: list[Leaf]
    pickle: bool = False
    classes: dict[str, str] = field(default_factory=dict)

    def objects(self) -> set[str]:
        """The digests of every object this manifest's chunks are stored in."""
        return {o for leaf in self.leaves for c in leaf.chunks for o in c.objects}

    def to_bytes(self) -> bytes:
        """Serialize to canonical JSON (sorted keys, no spaces)."""
        head, tail = self._canonical_around_id()
        return head + _quote(self.version.id)[1:-1].encode() + tail

    def _canonical_around_id(self) -> tuple[bytes, bytes]:
        """The manifest's canonical JSON split where the id's value goes: each top-level field
        is encoded once, and the leaf table (most of a many-leaf manifest) written directly."""
        record = {f.name: getattr(self.version, f.name) for f in fields(self.version)}  # not copied
        top = {"format": MANIFEST_KIND, "format_version": list(FORMAT_VERSION), **record,
               "tree": self.tree, "pickle": self.pickle}
        if self.classes:  # absent when empty: such manifests stay as 1.3 wrote them
            top["classes"] = self.classes
        del top["id"]
        text = {k: _canonical_text(v) for k, v in top.items()}
        text["leaves"] = "[" + ",".join(map(_leaf_canonical, self.leaves)) + "]"
        keys = sorted(text)
        head = "{" + "".join(f"{_quote(k)}:{text[k]}," for k in keys if k < "id") + '"id":"'
        tail = '"' + "".join(f",{_quote(k)}:{text[k]}" for k in keys if k > "id") + "}"
        return head.encode(), tail.encode()

    def seal(self) -> bytes:
        """Set the version id (24 hex digits of blake3 over the manifest with an empty id) and
        return the manifest's bytes."""
        head, tail = self._canonical_around_id()
        hasher = blake3.blake3(head)
        hasher.update(tail)
        self.version.id = hasher.hexdigest()[:24]
        return head + self.version.id.encode() + tail

    @staticmethod
    def from_bytes(data: bytes, where: str) -> "Manifest":
        """Parse and check a manifest (any bytes-like `data`, e.g. a memory tier's view of a
        large one); raise FormatError naming `where` if it is unusable."""
        data = data if isinstance(data, bytes) else bytes(data)
        record = _parsed(data, where)
        _check_id(record, data, where)
        check_manifest(record, where)
        version = _version_of(record)
        leaves = [Leaf.from_json(d) for d in record.get("leaves", [])]
        return Manifest(version, record.get("tree"), leaves, bool(record.get("pickle", False)),
                        dict(record.get("classes", {})))


def version_from_bytes(data: bytes, where: str) -> Version:
    """The Version record of a manifest, checked against its id like `Manifest.from_bytes`,
    without parsing its leaf table (what a log of a many-leaf history needs)."""
    data = data if isinstance(data, bytes) else bytes(data)
    cut = _without_leaves(data)
    if cut is None:
        return Manifest.from_bytes(data, where).version
    record = _parsed(cut, where)
    _check_id(record, data, where)
    check_record(record, where)
    return _version_of(record)


def _parsed(data: bytes, where: str) -> dict:
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest {where} is {len(data)} bytes, over the limit of {MAX_MANIFEST_BYTES}")
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"manifest {where} is not valid JSON ({e}); it may be truncated") from None
    except RecursionError:
        raise FormatError(f"manifest {where} is nested too deeply to be a manifest") from None
    check_format(record, MANIFEST_KIND, f"manifest {where}")
    return record


def _version_of(record: dict) -> Version:
    return Version(**{k: record[k] for k in Version.__dataclass_fields__ if k in record})


_LEAVES_START, _LEAVES_END = b',"leaves":[', b'],"logical_bytes":'


def _without_leaves(data: bytes) -> bytes | None:
    """A canonical manifest's bytes with an empty leaf table, or None when they do not have the
    canonical layout. Inside JSON strings every quote is escaped, so the first `],"logical_bytes":`
    after the table's start is its end (the key that sorts next)."""
    start = data.find(_LEAVES_START)
    if start < 0:
        return None
    end = data.find(_LEAVES_END, start)
    if end < 0:
        return None
    return data[:start + len(_LEAVES_START)] + data[end:]


def stub_bytes(version: Version) -> bytes:
    """The record that replaces a pruned version's manifest: its lineage fields, no tree or
    leaves, and `stub_hash` (format 1.3), blake3 of the stub's canonical JSON with that field
    empty, so that damage to a stub is found (it keeps the id of the version it replaces)."""
    version = Version(**{**asdict(version), "pruned": True})
    record = json.loads(Manifest(version, None, [], False).to_bytes())
    record["stub_hash"] = blake3.blake3(_canonical({**record, "stub_hash": ""})).hexdigest()
    return _canonical(record)


def _check_stub(record: dict, where: str) -> None:
    """Raise CorruptObjectError unless a stub's `stub_hash` matches it (stubs written before
    format 1.3 have none and are only checked against the schema)."""
    if "stub_hash" not in record:
        return
    if blake3.blake3(_canonical({**record, "stub_hash": ""})).hexdigest() != record["stub_hash"]:
        raise CorruptObjectError(f"pruned record {where} does not match its stub_hash: it was corrupted or "
                                 "edited, and the history behind it cannot be trusted")


def _check_id(record: dict, data: bytes, where: str) -> None:
    """Raise CorruptObjectError unless the manifest's bytes hash to its id (stubs of pruned
    versions carry their version's id and are checked by their stub_hash). Canonical bytes are
    hashed as they are, the id's value left out; other layouts are re-encoded first."""
    if record.get("pruned") is True:
        _check_stub(record, where)
        return
    vid = record.get("id")
    if isinstance(vid, str):
        marker = f'"id":"{vid}"'.encode()
        at = data.find(marker)
        if at >= 0:
            hasher = blake3.blake3(data[:at + 6])
            hasher.update(data[at + len(marker) - 1:])
            if hasher.hexdigest()[:24] == vid:
                return
    try:
        recomputed = _record_id(record)
    except ValueError:  # NaN or infinities, which the canonical form refuses
        recomputed = None
    if recomputed != vid:
        raise CorruptObjectError(f"manifest {where} does not match its id {vid!r}: it was corrupted or edited")


def html_table(caption: str, rows) -> str:
    """An HTML table of (name, value) rows with every text escaped."""
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                   f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table><caption>{html.escape(caption)}</caption>{body}</table>"
