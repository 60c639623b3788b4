"""A tiny DeepSpeed ZeRO-1 run on CPU checkpointing through forkpoint; writes its final
parameters to --out."""

import argparse
import os
import socket
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=None)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tag", default=None)
    p.add_argument("--decoupled", action="store_true")
    p.add_argument("--dist", action="store_true", help="several ranks (under torchrun): fp.dist.Repo")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    import forkpoint as fp

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = torch.distributed.get_rank()
    if a.repo:
        repo = fp.dist.Repo(a.repo, create=True, timeout=120) if a.dist else fp.Repo(a.repo, create=True)
        fp.deepspeed.install(engine, repo, decoupled=a.decoupled)
    start = 0
    if a.resume:
        _, client = engine.load_checkpoint(a.dir, tag=a.tag)
        start = client["next_step"] if client is not None else 0
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(a.steps)]
    ran = 0
    for step in range(start, a.steps):
        x, y = data[step]
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        ran += 1
        if (step + 1) % a.save_every == 0:
            engine.save_checkpoint(a.dir, client_state={"next_step": step + 1})
    if a.repo:
        engine.checkpoint_engine.cleanup()
    if rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                    "ran": ran}, a.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where torch's gloo threads sometimes abort the process
