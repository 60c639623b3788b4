"""State providers: objects that capture and restore state not held in tensors.

`RNGState` covers Python, numpy and torch (CPU and CUDA) generators; `ResumableSampler`
yields dataset indices and resumes at the exact next sample.
"""

import random
import sys

import numpy as np


class RNGState:
    """Captures and restores the global random generators of Python, numpy and torch."""

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        sd = {
            "python": {"version": version, "state": np.asarray(internal, dtype=np.uint64),
                       "gauss": gauss},
            "numpy": {"name": name, "keys": keys.copy(), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        }
        torch = sys.modules.get("torch")
        if torch is not None:
            sd["torch"] = torch.get_rng_state()
            if torch.cuda.is_available():
                sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        py = sd["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
        n = sd["numpy"]
        np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
        if "torch" in sd:
            import torch

            torch.set_rng_state(sd["torch"].cpu())
            if "cuda" in sd and torch.cuda.is_available():
                states = sd["cuda"][: torch.cuda.device_count()]
                torch.cuda.set_rng_state_all([s.cpu() for s in states])


class ResumableSampler:
    """Yields indices of a dataset of `length` items, reshuffled per epoch from `seed`.

    Its state is (epoch, position): restored, iteration continues at the exact next index.
    Position counts indices handed out, so with DataLoader workers that prefetch, save
    only at points where the loop has consumed what was handed out (e.g. num_workers=0).
    """

    def __init__(self, length: int, shuffle: bool = True, seed: int = 0):
        if length < 0:
            raise ValueError(f"dataset length must be >= 0, got {length}")
        self.length = int(length)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return self.length

    def order(self, epoch: int) -> np.ndarray:
        """Return the index order of `epoch`."""
        if not self.shuffle:
            return np.arange(self.length)
        return np.random.default_rng([self.seed, epoch]).permutation(self.length)

    def __iter__(self):
        order = self.order(self.epoch)
        while self.position < self.length:
            index = int(order[self.position])
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "length": self.length, "shuffle": self.shuffle}

    def load_state_dict(self, sd: dict) -> None:
        if sd["length"] != self.length:
            raise ValueError(
                f"sampler was saved over {sd['length']} items but this dataset has {self.length}"
            )
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])
        self.seed, self.shuffle = int(sd["seed"]), bool(sd["shuffle"])
