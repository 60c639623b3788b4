"""Retention: which versions of a branch keep their data."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keep:
    """Keep the newest `last`, every version whose step is a multiple of `every`, the `best`
    k by a metric (name, k, "min"|"max"), and tagged versions (when `tags`)."""

    last: int | None = None
    every: int | None = None
    best: tuple | None = None
    tags: bool = True

    def __post_init__(self):
        if self.last is not None and self.last < 1:
            raise ValueError(f"Keep(last=...) must be >= 1, got {self.last}")
        if self.every is not None and self.every < 1:
            raise ValueError(f"Keep(every=...) must be >= 1, got {self.every}")
        if self.best is not None:
            if len(self.best) != 3 or self.best[2] not in ("min", "max") or self.best[1] < 1:
                raise ValueError(f"Keep(best=...) must be (metric, k >= 1, 'min'|'max'), got {self.best}")

    def select(self, versions: list, tagged: set[str]) -> set[str]:
        """Return the ids to keep among `versions` (one branch's, newest first)."""
        keep: set[str] = set()
        if self.last:
            keep.update(v.id for v in versions[: self.last])
        if self.every:
            keep.update(v.id for v in versions if v.step is not None and v.step % self.every == 0)
        if self.best:
            name, k, mode = self.best
            scored = [v for v in versions if isinstance(v.metrics.get(name), (int, float))]
            scored.sort(key=lambda v: v.metrics[name], reverse=(mode == "max"))
            keep.update(v.id for v in scored[:k])
        if self.tags:
            keep.update(v.id for v in versions if v.id in tagged)
        return keep
