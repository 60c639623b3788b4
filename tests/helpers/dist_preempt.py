"""One rank of a 2-rank gloo run; rank 1 signals itself at step 3 (resilience test).

Ranks meet through a file (FP_TEST_RENDEZVOUS, no port that another test could take first)
and print every thread's stack if still running after STACKS_AFTER seconds."""

import datetime
import faulthandler
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import forkpoint as fp


STACKS_AFTER = float(os.environ.get("FP_TEST_STACKS_AFTER", 90))


def main(url: str) -> None:
    faulthandler.dump_traceback_later(STACKS_AFTER)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['FP_TEST_RENDEZVOUS']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
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
