"""A hierarchy of stores: fastest first; versions commit at the top and flush downwards.

Each tier holds a complete repository layout (objects, manifests, refs), so any tier alone
can be read; `keep` bounds how many versions a tier holds (the last tier prunes), and
`flush_every` says which versions go on to the next tier. A `local` tier (node-local disk,
/dev/shm) is reached only by the processes of one node: an fp.dist.Repo then keeps each
node's part of a version there and flushes the parts to the shared tier below; with
`replicas=k` it also copies each node's part to the local tier of k other nodes
(dist/replication.py), bounded by `budget` bytes per node.
"""

import os
from dataclasses import dataclass, field

from ..storage import LocalStore, Store, open_store


@dataclass(frozen=True)
class Tier:
    """One level of the hierarchy: where it lives and how much it keeps."""

    url: str
    keep: int | None = None
    flush_every: int = 1
    storage_options: dict = field(default_factory=dict, hash=False, compare=False)
    local: bool = False
    replicas: int = 0
    budget: int | None = None

    def __post_init__(self):
        for name in ("keep", "flush_every"):
            value = getattr(self, name)
            if not (value is None and name == "keep") and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"tier {self.url}: {name} must be an int, got {value!r}")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"tier {self.url}: keep must be >= 1, got {self.keep}")
        if self.flush_every < 1:
            raise ValueError(f"tier {self.url}: flush_every must be >= 1, got {self.flush_every}")
        for name in ("replicas", "budget"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"tier {self.url}: {name} must be an int >= 0, got {value!r}")
        if (self.replicas or self.budget is not None) and not self.local:
            raise ValueError(f"tier {self.url}: replicas need a node-local tier that outlives the processes "
                             "(e.g. fp.tier('/dev/shm/run', keep=2, local=True, replicas=1))")


def tier(url: str, keep: int | None = None, flush_every: int = 1, local: bool = False,
         replicas: int = 0, budget: int | None = None, **storage_options) -> Tier:
    """Describe a tier: `fp.tier("mem://fast", keep=2)`, `fp.tier("s3://b/run")`,
    `fp.tier("/local/nvme/run", keep=2, local=True)` (each node has its own), and
    `fp.tier("/dev/shm/run", keep=2, local=True, replicas=1)` (each node's part also on a peer)."""
    return Tier(str(url), keep, flush_every, storage_options, local, replicas, budget)


def open_tiers(tiers) -> tuple[list[Tier], list[Store]]:
    """Normalise a list of Tier objects, paths or URLs and open their stores."""
    if not tiers:
        raise ValueError("tiers must name at least one store")
    specs = [t if isinstance(t, Tier) else tier(t) for t in tiers]
    if any(t.replicas for t in specs[1:]):
        raise ValueError("only tier 0 can keep replicas on peer nodes (replicas= on a lower tier)")
    stores: list[Store] = []
    seen: dict[str, str] = {}
    try:
        for spec in specs:
            store = open_store(spec.url, **spec.storage_options)
            stores.append(store)
            place = os.path.realpath(store.root) if isinstance(store, LocalStore) else store.url
            if place in seen:
                raise ValueError(f"tiers {seen[place]!r} and {spec.url!r} are the same store ({place}): each tier "
                                 "must be a store of its own (evicting from one would delete from the other)")
            seen[place] = spec.url
    except BaseException:
        for opened in stores:
            opened.close()
        raise
    return specs, stores


def farthest_next_use(candidates: list[str], future: list[str]) -> str:
    """Belady's choice: the candidate whose next use in `future` is farthest (or never)."""
    position = {}
    for i, vid in enumerate(future):
        position.setdefault(vid, i)
    return max(candidates, key=lambda vid: position.get(vid, len(future) + 1))


__all__ = ["Tier", "tier", "open_tiers", "farthest_next_use"]
