"""A sampler whose position is global: it resumes at the exact sample on any number of ranks."""

import numpy as np


def _rank_world() -> tuple[int, int]:
    import sys

    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DistributedResumableSampler:
    """Yields this rank's indices of a dataset of `length` items, reshuffled per epoch from `seed`.

    The epoch's order is one global permutation dealt round-robin to the ranks from the
    global position `consumed`. Its state (epoch, consumed) is the same on every rank at a
    step boundary, so it is stored once; restored on any number of ranks, iteration goes on
    at the exact next global sample: none repeated, none skipped. Save only where every rank
    has consumed what it was handed (lockstep steps), and batch it with `fp.ResumableLoader`
    (or a DataLoader with num_workers=0): workers fetch ahead of the loop.
    """

    def __init__(self, length: int, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world: int | None = None):
        if length < 0:
            raise ValueError(f"dataset length must be >= 0, got {length}")
        self.length, self.shuffle, self.seed = int(length), shuffle, int(seed)
        self._rank, self._world = rank, world
        self.epoch = 0
        self.consumed = 0
        self._start = 0
        self._taken = 0

    def _layout(self) -> tuple[int, int]:
        rank, world = _rank_world()
        return (self._rank if self._rank is not None else rank), (self._world if self._world is not None else world)

    def order(self, epoch: int) -> np.ndarray:
        """The global index order of `epoch`."""
        if not self.shuffle:
            return np.arange(self.length)
        return np.random.default_rng([self.seed, epoch]).permutation(self.length)

    def __len__(self) -> int:
        rank, world = self._layout()
        remaining = self.length - self.consumed
        return max(0, -(-(remaining - rank) // world))

    def __iter__(self):
        rank, world = self._layout()
        order = self.order(self.epoch)
        self._start, self._taken = self.consumed, 0
        for g in range(self._start + rank, self.length, world):
            self._taken += 1
            self.consumed = min(self.length, self._start + self._taken * world)
            yield int(order[g])
        self.epoch += 1
        self.consumed = 0

    def after(self, start: dict, taken: int) -> dict:
        """The state_dict once this rank used `taken` samples past the state `start` (every rank
        the same count, as in lockstep steps)."""
        world = self._layout()[1]
        return {**start, "consumed": min(self.length, int(start["consumed"]) + taken * world)}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "length": self.length, "shuffle": self.shuffle}

    def load_state_dict(self, sd: dict) -> None:
        if sd["length"] != self.length:
            raise ValueError(f"sampler was saved over {sd['length']} items but this dataset has {self.length}")
        self.epoch, self.consumed = int(sd["epoch"]), int(sd["consumed"])
        self.seed, self.shuffle = int(sd["seed"]), bool(sd["shuffle"])
