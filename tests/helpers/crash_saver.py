"""Saves deterministic numpy states in a loop until killed (used by the crash test).

Prints "ready" once the repository is open, then each step it committed."""

import sys

import numpy as np

import forkpoint as fp
from forkpoint.engine import SaveOptions


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(2_000_000).astype(np.float32),
            "b": np.full(3_000_000, step, dtype=np.int16),
            "small": {f"p{i}": np.arange(100) * step + i for i in range(20)},
            "frozen": np.ones(500_000, dtype=np.float32),
            "step": step}


def main(url: str, branch: str, codec: str = "raw") -> None:
    repo = fp.Repo(url, create=True, options=SaveOptions(chunk_bytes=2 << 20, small_leaf_bytes=64 << 10,
                                                         codec=codec, encode_later=codec != "raw"))
    head = repo.head(branch)
    step = repo.version(head).step + 1 if head else 0
    print("ready", flush=True)
    while True:
        repo.save(state_for(step), branch=branch, step=step)
        print(step, flush=True)
        step += 1


if __name__ == "__main__":
    main(*sys.argv[1:])
