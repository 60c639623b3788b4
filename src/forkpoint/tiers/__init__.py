"""A hierarchy of stores: fastest first; versions commit at the top and flush downwards.

Each tier holds a complete repository layout (objects, manifests, refs), so any tier alone
can be read; `keep` bounds how many versions a tier holds (the last tier prunes), and
`flush_every` says which versions go on to the next tier.
"""

from dataclasses import dataclass, field

from ..storage import Store, open_store


@dataclass(frozen=True)
class Tier:
    """One level of the hierarchy: where it lives and how much it keeps."""

    url: str
    keep: int | None = None
    flush_every: int = 1
    storage_options: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"tier {self.url}: keep must be >= 1, got {self.keep}")
        if self.flush_every < 1:
            raise ValueError(f"tier {self.url}: flush_every must be >= 1, got {self.flush_every}")


def tier(url: str, keep: int | None = None, flush_every: int = 1, **storage_options) -> Tier:
    """Describe a tier: `fp.tier("mem://fast", keep=2)`, `fp.tier("s3://b/run")`."""
    return Tier(str(url), keep, flush_every, storage_options)


def open_tiers(tiers) -> tuple[list[Tier], list[Store]]:
    """Normalise a list of Tier objects, paths or URLs and open their stores."""
    if not tiers:
        raise ValueError("tiers must name at least one store")
    specs = [t if isinstance(t, Tier) else tier(t) for t in tiers]
    return specs, [open_store(t.url, **t.storage_options) for t in specs]


def farthest_next_use(candidates: list[str], future: list[str]) -> str:
    """Belady's choice: the candidate whose next use in `future` is farthest (or never)."""
    position = {}
    for i, vid in enumerate(future):
        position.setdefault(vid, i)
    return max(candidates, key=lambda vid: position.get(vid, len(future) + 1))


__all__ = ["Tier", "tier", "open_tiers", "farthest_next_use"]
