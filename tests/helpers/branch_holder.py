"""A run that holds a branch: saves one step with a Checkpointer, says so, waits for stdin."""

import sys

import torch

import forkpoint as fp


def main(url: str, branch: str) -> None:
    model = torch.nn.Linear(4, 4)
    ck = fp.Checkpointer(fp.Repo(url, create=True), {"model": model}, every=1, branch=branch, sync=True)
    ck.step(ck.resume())
    print("holding", flush=True)
    sys.stdin.read()
    ck.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
