"""Stall per checkpoint in a training loop: forkpoint vs torch.save, DCP, DCP async, torchsnapshot.

A ~125M-parameter MLP stack with AdamW (~1.5 GB of state) trains for `--steps` steps with a
checkpoint every 5 steps. The stall per checkpoint is the extra wall time over the loop
without checkpoints, divided by the number of checkpoints. Each run ends by waiting for
every save in flight. Methods run interleaved, `--repeats` times; medians are reported.

    python benchmarks/train_overhead.py --repeats 3
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

import forkpoint as fp

warnings.filterwarnings("ignore")
WIDTH = 3200


def build(params_m: int, device: str = "cpu"):
    torch.manual_seed(0)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt


def train_step(model, opt, batch):
    loss = model(batch).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


class NoCheckpoint:
    name = "no checkpoint"

    def start(self, model, opt, path):
        pass

    def checkpoint(self, step):
        pass

    def finish(self):
        pass


class Forkpoint:
    name = "forkpoint (async)"

    def start(self, model, opt, path):
        self.repo = fp.Repo(path, create=True)
        self.ck = fp.Checkpointer(self.repo, {"model": model, "optim": opt}, every=5)

    def checkpoint(self, step):
        self.ck.save(step)

    def finish(self):
        self.ck.close()
        self.repo.close()


class TorchSave:
    name = "torch.save"

    def start(self, model, opt, path):
        self.model, self.opt, self.path = model, opt, path
        os.makedirs(path)

    def checkpoint(self, step):
        with open(os.path.join(self.path, f"{step}.pt"), "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def finish(self):
        pass


class DCPSave:
    name = "dcp.save"

    def start(self, model, opt, path):
        self.model, self.opt, self.path = model, opt, path

    def checkpoint(self, step):
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()},
                 checkpoint_id=os.path.join(self.path, str(step)))

    def finish(self):
        pass


class DCPAsync(DCPSave):
    name = "dcp.async_save"

    def start(self, model, opt, path):
        super().start(model, opt, path)
        self.future = None
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            dist.init_process_group("gloo", rank=0, world_size=1)

    def checkpoint(self, step):
        import torch.distributed.checkpoint as dcp

        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save({"model": self.model.state_dict(), "optim": self.opt.state_dict()},
                                     checkpoint_id=os.path.join(self.path, str(step)))

    def finish(self):
        if self.future is not None:
            self.future.result()


class TorchSnapshotAsync:
    name = "torchsnapshot.async_take"

    def start(self, model, opt, path):
        self.model, self.opt, self.path = model, opt, path
        self.pending = None

    def checkpoint(self, step):
        import torchsnapshot

        if self.pending is not None:
            self.pending.wait()
        self.pending = torchsnapshot.Snapshot.async_take(
            os.path.join(self.path, str(step)), app_state={"model": self.model, "optim": self.opt})

    def finish(self):
        if self.pending is not None:
            self.pending.wait()


def run(method, steps: int, every: int, scratch: str, params_m: int, device: str = "cpu",
        batch_rows: int = 16) -> tuple[float, int]:
    model, opt = build(params_m, device)
    batch = torch.randn(batch_rows, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    result = timed_loop(method, model, opt, batch, steps, every, os.path.join(scratch, method.name.split()[0]))
    del model, opt
    gc.collect()
    return result


def timed_loop(method, model, opt, batch, steps: int, every: int, path: str) -> tuple[float, int]:
    """(wall seconds, checkpoints) of `steps` training steps with `method` checkpointing every
    `every` (after one untimed warm-up step; the end waits for every save in flight)."""
    train_step(model, opt, batch)
    gc.collect()
    method.start(model, opt, path)
    n = 0
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(model, opt, batch)
        if step % every == 0 and step + every <= steps + 1:
            method.checkpoint(step)
            n += 1
    method.finish()
    wall = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return wall, n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=125)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default="bench-out/train_overhead.json")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda to train on the GPU")
    ap.add_argument("--batch", type=int, default=16, help="rows per training batch")
    ap.add_argument("--only", default=None,
                    help="comma-separated method names to run (e.g. 'forkpoint (async),dcp.async_save'); "
                         "the loop without checkpoints always runs")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    methods = [NoCheckpoint(), Forkpoint(), TorchSave(), DCPSave(), DCPAsync()]
    try:
        import torchsnapshot  # noqa: F401

        methods.append(TorchSnapshotAsync())
    except Exception as e:  # optional peer
        print(f"skipping torchsnapshot: {e}", file=sys.stderr)
    if args.only:
        wanted = set(args.only.split(",")) | {"no checkpoint"}
        unknown = wanted - {m.name for m in methods}
        if unknown:
            ap.error(f"unknown methods {sorted(unknown)}; choose from {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in wanted]
    scratch = tempfile.mkdtemp(prefix="fp-train-", dir=args.dir)
    walls = {m.name: [] for m in methods}
    count = {}
    for rep in range(args.repeats):
        for m in methods:
            wall, n = run(m, args.steps, args.every, scratch, args.params_m, args.device, args.batch)
            walls[m.name].append(wall)
            count[m.name] = n
            print(f"rep {rep} {m.name}: {wall:.2f} s, {n} checkpoints", file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.median(walls["no checkpoint"])
    print(f"\n{args.device}, batch {args.batch}: {args.steps} steps, checkpoint every {args.every}, "
          f"{args.repeats} runs, medians; "
          f"no-checkpoint loop {base:.2f} s ({base / args.steps:.2f} s/step)\n")
    print("| method | wall (s) | checkpoints | stall per checkpoint (s) |")
    print("|---|---|---|---|")
    out = {}
    for m in methods:
        wall = statistics.median(walls[m.name])
        n = count[m.name]
        stall = (wall - base) / n if n else 0.0
        out[m.name] = {"wall_s": wall, "checkpoints": n, "stall_s": stall, "runs": walls[m.name]}
        print(f"| {m.name} | {wall:.2f} | {n} | {stall:.2f} |")
    peers = [v["stall_s"] for k, v in out.items() if k not in ("no checkpoint", "forkpoint (async)")]
    if peers and "forkpoint (async)" in out:
        print(f"\nforkpoint stall / best peer stall = {out['forkpoint (async)']['stall_s'] / min(peers):.3f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
