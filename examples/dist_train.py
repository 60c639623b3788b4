"""FSDP2 training with forkpoint: every rank writes its shards asynchronously, rank 0 commits
one version, and a restart may use a different number of ranks.

    torchrun --nproc_per_node 2 examples/dist_train.py --repo /tmp/dist-run --steps 20
    torchrun --nproc_per_node 3 examples/dist_train.py --repo /tmp/dist-run --steps 40   # resumes
    srun --ntasks 4 python examples/dist_train.py --repo $SCRATCH/run --steps 1000      # see slurm/dist.sbatch

Rank and world size come from torchrun's or srun's environment (fp.dist.init_from_env).
The data order is one global permutation per epoch (fp.dist.DistributedResumableSampler),
so a restart on any number of ranks continues at the exact next sample.
"""

import argparse

import torch
from torch.distributed.fsdp import fully_shard

import forkpoint as fp

DATASET, WIDTH = 4096, 256


def sample(index: int) -> torch.Tensor:
    """Synthetic data: sample `index` of a fixed dataset."""
    return torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    args = parser.parse_args()

    launch = fp.dist.init_from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 512), torch.nn.Tanh(), torch.nn.Linear(512, WIDTH))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = fp.dist.DistributedResumableSampler(DATASET, seed=0)
    repo = fp.dist.Repo(args.repo, create=True, timeout=120)
    ck = fp.Checkpointer(repo, {"train": fp.dist.TrainState(model, opt), "data": sampler, "rng": fp.RNGState()},
                         every=args.every, keep=fp.Keep(last=3))
    start = ck.resume()
    if launch.rank == 0:
        print(f"rank 0 of {launch.world} ({launch.launcher}): starting at step {start}", flush=True)
    batches = iter(sampler)
    for step in range(start, args.steps):
        indices = []
        while len(indices) < args.batch:
            try:
                indices.append(next(batches))
            except StopIteration:
                batches = iter(sampler)
        x = torch.stack([sample(i) for i in indices])
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ck.step(step, metrics={"loss": float(loss)})
    ck.close()
    if launch.rank == 0:
        print(f"done at step {args.steps - 1}; newest version {repo.head('main')}", flush=True)
    repo.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        del model, opt, ck
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
