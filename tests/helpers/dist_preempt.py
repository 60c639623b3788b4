"""One rank of a 2-rank gloo run; rank 1 signals itself at step 3 (resilience test)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import forkpoint as fp


def main(url: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    repo = fp.Repo(url, create=rank == 0) if rank == 0 else None
    dist.barrier()
    if repo is None:
        repo = fp.Repo(url)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=100)
    for step in range(50):
        loss = model(torch.randn(4, 16)).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
        ck.step(step)
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
