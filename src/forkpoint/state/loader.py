"""A torch DataLoader whose position is part of the state: it resumes at the first sample the
training loop has not seen, however many batches its workers had fetched ahead.

A sampler in the state of a plain DataLoader records the indices it handed out, and with
`num_workers > 0` the workers fetch `prefetch_factor` batches each ahead of the loop, so a
resume from it skips those. This loader counts the batches its iterator gave the loop
instead, and the sampler (`fp.ResumableSampler`, or `fp.dist.DistributedResumableSampler`
across ranks) starts each iteration at that count. Imports torch, so `forkpoint` loads this
module on first use of `fp.ResumableLoader`.
"""

import torch
from torch.utils.data import DataLoader

from .providers import ResumableSampler


def _is_position_sampler(sampler) -> bool:
    """Whether `sampler` can say where it stands after a count of its samples was used."""
    return all(callable(getattr(sampler, name, None)) for name in ("state_dict", "load_state_dict", "after"))


class ResumableLoader(DataLoader):
    """A DataLoader over `dataset` (map-style) whose state_dict is the next unseen sample.

    Put it in the state (`{"data": loader}`); `resume()` restores it, and the next
    `iter(loader)` goes on within the epoch it stopped in. `sampler=None` makes a
    `fp.ResumableSampler(len(dataset), shuffle, seed)`; any other sampler must be a
    position sampler (`fp.ResumableSampler`, `fp.dist.DistributedResumableSampler`).
    Positions count samples, so a resume with another `batch_size` starts at the same
    sample. The loader gets its own generator, seeded by `seed` and the epoch, so
    iterating it draws nothing from the global torch RNG and each epoch's worker seeds
    are the same in a resumed run. The rest of the arguments are DataLoader's.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool = False, seed: int = 0,
                 sampler=None, drop_last: bool = False, generator: torch.Generator | None = None, **kwargs):
        if kwargs.get("batch_sampler") is not None:
            raise TypeError("ResumableLoader batches its own sampler's indices: give sampler= (a position "
                            "sampler) and batch_size=, not batch_sampler=")
        if sampler is None:
            sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed)
        elif not _is_position_sampler(sampler):
            raise TypeError(f"ResumableLoader needs a sampler that records its position "
                            f"(fp.ResumableSampler or fp.dist.DistributedResumableSampler), got "
                            f"{type(sampler).__qualname__}; shuffle with shuffle=True, seed=...")
        elif shuffle:
            raise ValueError("shuffle=True is for the sampler ResumableLoader makes; with sampler=..., "
                             "give the sampler shuffle=True instead")
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                         generator=generator if generator is not None else torch.Generator(), **kwargs)
        self.seed = int(seed)
        self._point = sampler.state_dict()

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (from 0)."""
        return int(self._point["epoch"])

    def __iter__(self):
        self.sampler.load_state_dict(self._point)
        # one stream per epoch: a resumed run draws the same worker base seed for its epoch
        self.generator.manual_seed((self.seed * 2 ** 20 + self.epoch) % 2 ** 63)
        return _CountingIterator(self, super().__iter__(), dict(self._point))

    def state_dict(self) -> dict:
        """The sampler's state at the first sample the loop has not been given."""
        return dict(self._point)

    def load_state_dict(self, sd: dict) -> None:
        """Continue at `sd` (a state_dict of this loader or of its sampler) from the next iter()."""
        self.sampler.load_state_dict(sd)
        self._point = self.sampler.state_dict()


class _CountingIterator:
    """The DataLoader's iterator, counting what it hands the loop into the loader's position."""

    def __init__(self, loader: ResumableLoader, inner, start: dict):
        self._loader, self._inner, self._start = loader, inner, start
        self._per_batch = loader.batch_size or 1
        self._taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._inner)
        except StopIteration:
            self._loader._point = self._loader.sampler.state_dict()  # the sampler ran out: next epoch
            raise
        self._taken += self._per_batch
        self._loader._point = self._loader.sampler.after(self._start, self._taken)
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)
