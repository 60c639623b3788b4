"""Saves N small versions tagged with its writer name (used by the concurrency test)."""

import sys

import numpy as np

import forkpoint as fp


def main(url: str, branch: str, writer: str, n: int) -> None:
    repo = fp.Repo(url)
    for i in range(n):
        repo.save({"w": np.full(1000, i, dtype=np.float64), "writer": writer, "i": i},
                  branch=branch, step=i, meta={"writer": writer})
    repo.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
