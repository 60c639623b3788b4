"""Stall per checkpoint in a training loop: forkpoint vs torch.save, DCP, DCP async, torchsnapshot.

A ~125M-parameter MLP stack with AdamW (~1.5 GB of state) trains for `--steps` steps with a
checkpoint every 5 steps. The stall per checkpoint is the extra wall time over the loop
without checkpoints, divided by the number of checkpoints. Each run ends by waiting for
every save in flight. Methods run interleaved, `--repeats` times; medians are reported.

    python benchmarks/train_overhead.py --repeats 3
"""

import gc
import os
import shutil
import statistics
import sys
import time
import warnings

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import WIDTH, train_step  # noqa: E402  (other benchmarks import them from here)

warnings.filterwarnings("ignore")


def build(params_m: int, device: str = "cpu"):
    """(model, optimizer): the standard MLP with AdamW, not yet stepped."""
    return harness.mlp_adamw(params_m, lr=1e-5, device=device)


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


METHODS = ["no checkpoint", "forkpoint (async)", "torch.save", "dcp.save", "dcp.async_save", "torchsnapshot.async_take"]


def main():
    ap = harness.arguments(__doc__, repeats=3, json_path="bench-out/train_overhead.json", methods=METHODS[1:])
    ap.add_argument("--params-m", type=int, default=125)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda to train on the GPU")
    ap.add_argument("--batch", type=int, default=16, help="rows per training batch")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    methods = [NoCheckpoint(), Forkpoint(), TorchSave(), DCPSave(), DCPAsync()]
    if harness.optional("torchsnapshot"):
        methods.append(TorchSnapshotAsync())
    methods = harness.only(ap, methods, args.only, always=("no checkpoint",))
    scratch = harness.scratch(args.dir, prefix="fp-train-")
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
    out, rows = {}, []
    for m in methods:
        wall = statistics.median(walls[m.name])
        n = count[m.name]
        stall = (wall - base) / n if n else 0.0
        out[m.name] = {"wall_s": wall, "checkpoints": n, "stall_s": stall, "runs": walls[m.name]}
        rows.append([m.name, f"{wall:.2f}", n, f"{stall:.2f}"])
    harness.table(["method", "wall (s)", "checkpoints", "stall per checkpoint (s)"], rows)
    peers = [v["stall_s"] for k, v in out.items() if k not in ("no checkpoint", "forkpoint (async)")]
    if peers and "forkpoint (async)" in out:
        print(f"\nforkpoint stall / best peer stall = {out['forkpoint (async)']['stall_s'] / min(peers):.3f}")
    harness.write_json(args.json, out)


if __name__ == "__main__":
    main()
