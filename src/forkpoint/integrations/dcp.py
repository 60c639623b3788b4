"""PyTorch Distributed Checkpoint storage backends that read and write forkpoint versions.

`dcp.save(sd, storage_writer=Writer(repo, branch="main"))` stores every rank's items as
forkpoint objects (content-addressed, so unchanged tensors are not written again) and the
coordinator commits one version in `finish`; `dcp.load(sd, storage_reader=Reader(repo, ref))`
reads any version, including versions saved natively by forkpoint, each rank reading only
the boxes it asks for. Pickled objects that DCP stores as bytes are loaded by DCP itself
(torch.load) only when the caller's planner asks for them.
"""

import io
from dataclasses import dataclass

import numpy as np

from ..engine.restore import ReadRequest
from ..engine.parallel import parallel_map
from ..format.manifest import Chunk, Leaf, Manifest, Version
from ..format.objects import content_hash
from ..repo.records import environment
from ..state.flatten import flatten, unflatten, walk_skeleton
from ..state.leaves import torch_leaf

PACK_ITEM_BYTES = 1 << 20


@dataclass
class StoredItem:
    """Where one DCP write item's bytes live (its storage_data)."""

    hash: str
    object: str
    start: int
    size: int
    codec: str
    written: int = 0
    value: dict | None = None
    """A plain value (numbers, strings, lists and dicts of them) as its skeleton node, stored
    in the manifest instead of DCP's pickled bytes, so repo.load returns the value itself."""


def _storage_classes():
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    return StorageWriter, StorageReader


def _done(value):
    """A torch Future already holding `value` (DCP's storage calls return futures)."""
    from torch.futures import Future

    fut = Future()
    fut.set_result(value)
    return fut


def _fqn(keys: tuple) -> str:
    return ".".join(str(k) for k in keys)


def make_writer_class():
    StorageWriter, _ = _storage_classes()

    class Writer(StorageWriter):
        """DCP StorageWriter committing a forkpoint version on `branch` of `repo`."""

        def __init__(self, repo, branch: str = "main", step: int | None = None, message: str = "",
                     metrics: dict | None = None, meta: dict | None = None):
            super().__init__()
            self.repo, self.branch, self.step = repo, branch, step
            self.message, self.metrics, self.meta = message, metrics or {}, meta or {}
            self.version: Version | None = None
            self.is_coordinator = True
            self.session = None

        def reset(self, checkpoint_id=None) -> None:
            self.version = None

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return False

        def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
            self.is_coordinator = is_coordinator

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def write_data(self, plan, planner):
            if self.session is None:  # this process's gc spares its objects until the commit
                self.session = self.repo.begin_save(self.branch, check_holder=self.is_coordinator)
            results = _write_items(self.session, plan, planner)
            if not self.is_coordinator:
                self._end_session()
            return _done(results)

        def finish(self, metadata, results) -> None:
            record = Version("", [], self.branch, self.step, 0.0, self.message, self.metrics, self.meta,
                             env=environment())
            manifest = _manifest_of(metadata, results, record)
            try:
                session = self.session or self.repo.begin_save(self.branch)
                self.version = session.commit(manifest)
            finally:
                self._end_session()

        def _end_session(self) -> None:
            if self.session is not None:
                self.session.close()
            self.session = None

        def storage_meta(self):
            return None

    return Writer


def _write_items(session, plan, planner) -> list:
    """Store one rank's DCP write items as objects through `session` (small ones packed into
    one object, plain values kept as skeleton nodes), make them durable, and return DCP's
    WriteResults, whose storage_data say where each item's bytes live."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    writer = session.writer()
    results, pack, pack_items = [], [], []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO and (node := _plain_node(planner, item)) is not None:
            results.append(WriteResult(item.index, 0, StoredItem("", "", 0, 0, "raw", 0, node)))
            continue
        if item.type == WriteItemType.BYTE_IO:
            buf = planner.resolve_data(item)
            data = np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()
        else:
            tensor = planner.resolve_data(item).detach()
            data = torch_leaf(tensor, item.index.fqn, copy=False).data
        if data.nbytes < PACK_ITEM_BYTES:
            pack.append(data)
            pack_items.append((item, content_hash(data, parallel_map), data.nbytes))
            continue
        digest = content_hash(data, parallel_map)
        before = writer.stored_bytes
        codec = writer.put(digest, data)
        results.append(WriteResult(item.index, data.nbytes, StoredItem(
            digest, digest, 0, data.nbytes, codec, writer.stored_bytes - before)))
    if pack:
        blob = np.concatenate(pack) if len(pack) > 1 else pack[0]
        digest = content_hash(blob, parallel_map)
        before = writer.stored_bytes
        codec = writer.put(digest, blob)
        offset, written = 0, writer.stored_bytes - before
        for item, item_hash, n in pack_items:
            results.append(WriteResult(item.index, n, StoredItem(item_hash, digest, offset, n, codec, written)))
            offset, written = offset + n, 0
    session.make_durable(writer.written)
    return results


def _manifest_of(metadata, results, record: Version) -> Manifest:
    """The manifest of a DCP save: every rank's stored items as leaves (tensors by their DCP
    chunks, bytes items as byte leaves, plain values in the skeleton), under `record`."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    where = {r.index: r.storage_data for rank in results for r in rank}
    leaves, keys, values, byte_fqns = [], [], [], []
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    for fqn, md in metadata.state_dict_metadata.items():
        keys.append(tuple(paths.get(fqn, (fqn,))))
        if isinstance(md, BytesStorageMetadata) and _lookup(where, fqn, None).value is not None:
            values.append(_lookup(where, fqn, None).value)
            continue
        if isinstance(md, BytesStorageMetadata):
            stored = _lookup(where, fqn, None)
            chunk = Chunk([0], [stored.size], stored.hash, stored.object, stored.start, stored.size, stored.codec)
            leaf = Leaf(fqn, "bytes", "uint8", [stored.size], stored.size, [chunk])
            byte_fqns.append(fqn)
        else:
            leaf = _tensor_leaf(fqn, md, where)
        values.append({"t": "leaf", "i": len(leaves)})
        leaves.append(leaf)
    planner_data = _jsonable(metadata.planner_data) if metadata.planner_data is not None else None
    record.meta = {**record.meta, "dcp": {"bytes": byte_fqns, "planner_data": planner_data}}
    record.logical_bytes = sum(leaf.nbytes for leaf in leaves)
    record.stored_bytes = sum(s.written for s in where.values())
    return Manifest(record, _nest(keys, values), leaves)


def _tensor_leaf(fqn: str, md, where: dict) -> Leaf:
    """The leaf of a DCP tensor item: one chunk per DCP chunk, where its bytes were stored."""
    chunks = []
    for c in md.chunks:
        stored = _lookup(where, fqn, c.offsets)
        chunks.append(Chunk(list(c.offsets), list(c.sizes), stored.hash, stored.object, stored.start, stored.size,
                            stored.codec))
    count = int(np.prod(list(md.size), dtype=np.int64))
    dtype = str(md.properties.dtype).removeprefix("torch.")
    return Leaf(fqn, "torch", dtype, list(md.size), md.properties.dtype.itemsize * count, chunks)


def _nest(paths: list[tuple], nodes: list[dict]) -> dict:
    """A skeleton of nested dicts holding each node at its key path."""
    root = {"t": "dict", "k": [], "v": []}
    for path, node in zip(paths, nodes):
        cur = root
        for key in path[:-1]:
            if key not in cur["k"]:
                cur["k"].append(key)
                cur["v"].append({"t": "dict", "k": [], "v": []})
            cur = cur["v"][cur["k"].index(key)]
        cur["k"].append(path[-1])
        cur["v"].append(node)
    return root


def _plain_node(planner, item) -> dict | None:
    """The skeleton node of a DCP bytes item whose object is plain data (no tensor, nothing
    that needs pickle), or None (it is then stored as DCP's bytes)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return None
    try:
        skeleton, flat = flatten(lookup(item.index))
    except Exception:  # a type only pickle can store: DCP's bytes keep it
        return None
    return skeleton if not flat else None


def _lookup(where: dict, fqn: str, offsets):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return where[MetadataIndex(fqn, offsets)]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def make_reader_class():
    _, StorageReader = _storage_classes()

    class Reader(StorageReader):
        """DCP StorageReader over version `ref` of `repo` (saved by Writer or by forkpoint)."""

        def __init__(self, repo, ref: str = "main"):
            super().__init__()
            self.repo, self.ref = repo, ref

        def reset(self, checkpoint_id=None) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id) -> bool:
            return False

        def read_metadata(self, *args, **kwargs):
            self.manifest = self.repo.readable(self.ref)
            metadata, self.scalars = _dcp_metadata(self.manifest)
            return metadata

        def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
            self.storage_data = metadata.storage_data

        def prepare_local_plan(self, plan):
            return plan

        def prepare_global_plan(self, plans):
            return plans

        def read_data(self, plan, planner):
            _read_items(self.repo, self.manifest.version.id, self.storage_data, self.scalars, plan, planner)
            return _done(None)

    return Reader


def _dcp_metadata(m: Manifest):
    """(DCP Metadata of version manifest `m`, {fqn: skeleton node} of its plain values): every
    leaf DCP can read (tensors by their chunks, DCP's own bytes items) and value as an item."""
    import torch
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       Metadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    dcp_meta = m.version.meta.get("dcp", {})
    dcp_bytes = set(dcp_meta.get("bytes", []))
    scalars = {}
    state, storage = {}, {}
    for keys, node in _dcp_items(m.tree):
        fqn = _fqn(keys)
        if node.get("t") != "leaf":
            scalars[fqn] = node
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = fqn
            continue
        leaf = m.leaves[node["i"]]
        if leaf.alias_of is not None:
            leaf = m.leaves[leaf.alias_of]
        if leaf.kind == "bytes" and fqn in dcp_bytes:
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = leaf
        elif leaf.kind in ("torch", "numpy"):
            dtype = getattr(torch, leaf.dtype) if leaf.kind == "torch" else \
                torch.from_numpy(np.empty(0, dtype=leaf.dtype)).dtype
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.lengths)) for c in leaf.chunks]
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(leaf.shape), chunks)
            for c in leaf.chunks:
                storage[MetadataIndex(fqn, torch.Size(c.offsets))] = (leaf, c)
    planner_data = dcp_meta.get("planner_data")
    if planner_data is not None:
        planner_data = {k: tuple(v) if isinstance(v, list) else v for k, v in planner_data.items()}
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage), scalars


def _read_items(repo, vid: str, storage_data: dict, scalars: dict, plan, planner) -> None:
    """Read one rank's DCP load items of version `vid` from `repo` into the planner's targets
    (a tensor item reads only the box it asks for)."""
    import torch
    from torch.distributed.checkpoint.planner import LoadItemType

    for req in plan.items:
        where = storage_data[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            if isinstance(where, str):
                blob = io.BytesIO()
                torch.save(_scalar(scalars[where]), blob)
                blob.seek(0)
            else:
                buf = np.empty(where.nbytes, dtype=np.uint8)
                repo.read_into([ReadRequest(where, buf)], vid)
                blob = io.BytesIO(buf.tobytes())
            planner.load_bytes(req, blob)
            continue
        leaf, chunk = where
        offsets = [c + o for c, o in zip(chunk.offsets, req.storage_offsets)]
        lengths = list(req.lengths)
        dtype = getattr(torch, leaf.dtype) if leaf.kind == "torch" else \
            torch.from_numpy(np.empty(0, dtype=leaf.dtype)).dtype
        tmp = torch.empty(lengths, dtype=dtype)
        flat = tmp.reshape(-1).view(torch.uint8) if tmp.numel() else torch.empty(0, dtype=torch.uint8)
        single = Leaf(leaf.path, leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes, [chunk], leaf.device)
        repo.read_into([ReadRequest(single, flat.numpy(), (offsets, lengths))], vid)
        target = planner.resolve_tensor(req).detach()
        target.copy_(tmp)
        planner.commit_tensor(req, target)


def _dcp_items(node: dict, keys: tuple = ()):
    """(keys, node) of what DCP sees as one item: leaves, scalars, and lists or tuples that
    hold neither leaves nor dicts (DCP stores those whole, as one value)."""
    t = node.get("t")
    if t in ("dict", "odict"):
        for k, v in zip(node["k"], node["v"]):
            yield from _dcp_items(v, keys + (k,))
    elif t in ("list", "tuple", "ranks"):
        if any(n.get("t") in ("leaf", "dict", "odict") for _, _, n in walk_skeleton(node)) or any(
                v.get("t") in ("dict", "odict") for v in node["v"]):
            for i, v in enumerate(node["v"]):
                yield from _dcp_items(v, keys + (i,))
        else:
            yield keys, node
    else:
        yield keys, node


def _scalar(node: dict):
    return unflatten(node, [], "dcp item")


_classes: dict = {}


def __getattr__(name: str):
    if name in ("Writer", "Reader"):
        if name not in _classes:
            _classes[name] = make_writer_class() if name == "Writer" else make_reader_class()
        return _classes[name]
    raise AttributeError(name)


