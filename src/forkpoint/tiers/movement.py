"""Moving versions between tiers: copy objects and manifests, sweep what a tier no longer needs.

Objects are immutable and named by content, so a copy is a plain byte copy that is skipped
when the destination already has the name; durability comes before the manifest.
"""

import time
from typing import Callable

from ..errors import CorruptObjectError
from ..format.objects import decode_object, object_key
from ..storage import Store


def object_keys(manifest) -> set[str]:
    """Return the storage keys of every object a manifest refers to."""
    return {object_key(o) for o in manifest.objects()}


def copy_object(sources: list[Store], dst: Store, key: str, pmap=None) -> int:
    """Copy `key` to `dst` from the first source that has it; return bytes copied (0 if present).
    Into a trusted store (whose reads are not re-hashed) only a copy that verifies goes (checked
    with `pmap`, a parallel `map`, where given)."""
    if dst.exists(key):
        dst.touch(key)
        return 0
    damaged = None
    for src in sources:
        try:
            data = _source_bytes(src, key)
            if dst.trusted and not src.trusted:
                decode_object(data, key.rsplit("/", 1)[-1], f"{src.url}/{key}", pmap=pmap)
        except FileNotFoundError:
            continue
        except CorruptObjectError as e:
            damaged = e
            continue
        dst.write(key, [data])
        return len(data)
    if damaged is not None:
        raise damaged
    raise FileNotFoundError(f"{key} is in no tier")


def _source_bytes(src: Store, key: str):
    """An object's bytes for a copy: mapped where the store can (no read into fresh memory, and
    page-aligned, so a disk destination writes large ones with direct I/O), else read."""
    mapped = src.map(key, 0, None)
    return src.read(key) if mapped is None else mapped


def copy_manifest(src: Store, dst: Store, vid: str) -> None:
    """Durably copy a version's manifest (call after its objects are durable on `dst`)."""
    key = f"versions/{vid}.json"
    dst.write(key, [src.read(key)])
    dst.barrier([key])


def sweep(store: Store, live: set[str], pinned: Callable[[str], bool],
          min_age: float = 0.0) -> tuple[int, int]:
    """Delete object keys of `store` not in `live` and not pinned; return (objects, bytes).

    The caller holds the lock that savers take around their existence checks, and computed
    `live` under it, so no object can gain a reference while it is being deleted. Where other
    processes write to the store (their saves in flight are unknown here), `min_age` spares
    objects written or reused in the last `min_age` seconds.
    """
    count = freed = 0
    recent = time.time() - min_age
    for key in store.list("objects"):
        if key in live or pinned(key.rsplit("/", 1)[-1]):
            continue
        try:
            if min_age and store.mtime(key) > recent:
                continue
            size = store.size(key)
        except FileNotFoundError:
            continue
        store.delete(key)
        count += 1
        freed += size
    return count, freed
