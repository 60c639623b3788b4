"""State providers: objects that capture and restore state not held in tensors.

`RNGState` covers Python, numpy and torch (CPU and CUDA) generators; `ResumableSampler`
yields dataset indices and resumes at the exact next sample; `RankLocal` marks state that
differs per rank.
"""

import random
import sys

import numpy as np


class RNGState:
    """Captures and restores the global random generators of Python, numpy and torch.

    It is rank-local: in a distributed save each rank's generators are kept. Restored on a
    different number of ranks, each rank takes rank 0's saved state and then reseeds every
    generator from it and its new rank (`on_world_change`), so ranks draw distinct,
    reproducible streams."""

    rank_local = True

    def on_world_change(self, rank: int, world: int) -> None:
        """Reseed all generators from the restored state and `rank` (after a change of world size)."""
        import blake3

        seed_src = np.random.get_state(legacy=True)[1].tobytes() + f"/{rank}/{world}".encode()
        seed = int.from_bytes(blake3.blake3(seed_src).digest()[:8], "little") & ((1 << 63) - 1)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.manual_seed(seed)

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


class RankLocal:
    """Marks a stateful object (or plain state) whose value differs per rank: a distributed
    save keeps every rank's value. When the number of ranks changed, `on_resize` says what
    each rank restores: "error" (refuse), "first" (rank 0's value) or "skip" (leave it)."""

    rank_local = True

    def __init__(self, obj, on_resize: str = "error"):
        if on_resize not in ("error", "first", "skip"):
            raise ValueError(f"on_resize must be 'error', 'first' or 'skip', got {on_resize!r}")
        self.obj, self.on_resize = obj, on_resize

    def state_dict(self):
        sd = getattr(self.obj, "state_dict", None)
        return sd() if callable(sd) else self.obj

    def load_state_dict(self, sd) -> None:
        load = getattr(self.obj, "load_state_dict", None)
        if callable(load):
            load(sd)
        else:
            self.obj = sd


class ResumableSampler:
    """Yields indices of a dataset of `length` items, reshuffled per epoch from `seed`.

    Its state is (epoch, position): restored, iteration continues at the exact next index.
    Position counts indices handed out, and DataLoader workers fetch batches ahead of the
    loop: give it to `fp.ResumableLoader` (which counts what the loop consumed) rather than
    to a plain DataLoader with num_workers > 0.
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

    def after(self, start: dict, taken: int) -> dict:
        """The state_dict once `taken` samples past the state `start` were used (a loader that
        counts what the loop consumed asks this; the sampler itself may have run ahead)."""
        return {**start, "position": min(self.length, int(start["position"]) + taken)}

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
