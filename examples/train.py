"""A training script that survives preemption: run it under SLURM or torchrun (see the
scripts beside it). It resumes from the newest version, saves on the automatic interval,
and on SIGTERM/SIGUSR1 (or near the walltime) saves and exits with code 75.

    python examples/train.py --repo runs/demo --steps 2000
"""

import argparse
import os

import torch
import torch.distributed as dist

import forkpoint as fp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--requeue", action="store_true", help="scontrol requeue on preemption")
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = fp.ResumableSampler(10_000, seed=0)
    data = torch.randn(10_000, 64, generator=torch.Generator().manual_seed(1))
    if rank == 0:
        fp.Repo(args.repo, create=True).close()
    if dist.is_initialized():
        dist.barrier()
    repo = fp.Repo(args.repo)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt, "rng": fp.RNGState(), "data": sampler},
                         every="auto", keep=fp.Keep(last=3), preemption=fp.Preemption(requeue=args.requeue))
    step = ck.resume()
    indices = iter(sampler)
    while step < args.steps:
        batch = []
        for _ in range(32):
            try:
                batch.append(next(indices))
            except StopIteration:
                indices = iter(sampler)
        x = data[batch]
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        ck.step(step, metrics={"loss": loss.item()})
        step += 1
    ck.save(step - 1, message="end of run")
    ck.close()
    if rank == 0:
        print(ck.policy.explain())


if __name__ == "__main__":
    main()
