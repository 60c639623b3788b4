"""Trains over a ResumableLoader with worker processes until `steps`, resuming its branch.

Prints "step <n> <indices>" for each batch the loop used and "committed <n>" once the save
of step n is durable (every `commit_every` steps), so a test can SIGKILL it mid-epoch."""

import sys

import torch

import forkpoint as fp


class Indices(torch.utils.data.Dataset):
    """Item i is i: the batches say which samples the loop saw."""

    def __len__(self):
        return 37

    def __getitem__(self, i):
        return i


def main(url: str, steps: int, batch_size: int, workers: int, commit_every: int = 5) -> None:
    loader = fp.ResumableLoader(Indices(), batch_size=batch_size, shuffle=True, seed=7, num_workers=workers)
    ck = fp.Checkpointer(fp.Repo(url, create=True), {"data": loader}, every=1)
    step = ck.resume()
    while step < steps:
        for batch in loader:
            print("step", step, *batch.tolist(), flush=True)
            ck.step(step)
            if step % commit_every == 0:
                ck.wait()
                print("committed", step, flush=True)
            step += 1
            if step == steps:
                break
    ck.close()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
