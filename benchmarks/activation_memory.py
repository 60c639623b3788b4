"""Activation memory against step time on a transformer stack: fp.adjoint.checkpoint_graph at
three budgets against plain backprop, torch.utils.checkpoint per block, checkpoint_sequential
and torch.compile's activation memory budget (three settings).

Each method runs in a fresh process: one warm-up step, then `--steps` timed training steps
(forward, backward); the peak extra heap in use over the timed steps (sampled, glibc's
mallinfo2) and the median step time are printed, with a digest of the gradients, which must
be the same for every method but torch.compile's (its kernels round differently).

    python -m benchmarks activation_memory [--blocks 8] [--width 256] [--seq 256] [--batch 8]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention and MLP sections, each with a residual."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def build(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    x = torch.randn(args.batch, args.seq, args.width)
    return model, x


def method_fn(method: str, model, x):
    """The forward of `method` ("plain", "per-block", "sequential:K", "compile:BUDGET", "fp:K")."""
    kind, _, arg = method.partition(":")
    ckpt = torch.utils.checkpoint
    if kind == "plain":
        return model
    if kind == "per-block":
        return lambda inp: _per_block(model, inp)
    if kind == "sequential":
        return lambda inp: ckpt.checkpoint_sequential(model, int(arg), inp, use_reentrant=False)
    if kind == "compile":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(arg)
        return torch.compile(model)
    if kind == "fp":
        return fp.adjoint.checkpoint_graph(model, x, memory_budget=int(arg) * x.nbytes)
    raise ValueError(method)


def _per_block(model, x):
    for block in model:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return x


def one(method: str, args) -> None:
    """Run `method` in this process; print median step seconds, peak extra heap MiB, digest."""
    from adjoint import HeapPeak

    torch.set_num_threads(2)
    model, x = build(args)
    forward = method_fn(method, model, x)
    forward(x).square().mean().backward()  # warm-up (and compilation)
    model.zero_grad(set_to_none=True)
    times = []
    with HeapPeak() as heap:
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            forward(x).square().mean().backward()
            times.append(time.perf_counter() - started)
    digest = sum(float(p.grad.double().sum()) for p in model.parameters())
    print(statistics.median(times), (heap.peak - heap.base) / 2**20, digest)


def main():
    parser = harness.arguments(__doc__.splitlines()[0], repeats=None, directory=False)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args.one, args)
        return
    stage_mib = args.batch * args.seq * args.width * 4 / 2**20
    methods = {"plain backprop": "plain", "torch.utils.checkpoint, each block": "per-block",
               "torch checkpoint_sequential (2 segments)": "sequential:2",
               "torch checkpoint_sequential (4 segments)": "sequential:4",
               "torch.compile, activation_memory_budget=0.5": "compile:0.5",
               "torch.compile, activation_memory_budget=0.2": "compile:0.2",
               "torch.compile, activation_memory_budget=0.05": "compile:0.05",
               f"fp checkpoint_graph, budget 8 stage inputs ({8 * stage_mib:.0f} MiB)": "fp:8",
               f"fp checkpoint_graph, budget 4 stage inputs ({4 * stage_mib:.0f} MiB)": "fp:4",
               f"fp checkpoint_graph, budget 2 stage inputs ({2 * stage_mib:.0f} MiB)": "fp:2"}
    print(f"\n### {args.blocks} transformer blocks, width {args.width}, sequence {args.seq}, batch {args.batch} "
          f"(one stage input = {stage_mib:.0f} MiB); median of {args.steps} steps, each method in a fresh process\n")
    print("| method | step (s) | peak extra heap in use (MiB) | gradient digest |")
    print("|---|---|---|---|")
    argv = ["--blocks", str(args.blocks), "--width", str(args.width), "--seq", str(args.seq),
            "--batch", str(args.batch), "--steps", str(args.steps)]
    for name, method in methods.items():
        out = subprocess.run([sys.executable, __file__, "--one", method, *argv], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1][:120]} | | |")
            continue
        seconds, mib, digest = (float(v) for v in out.stdout.split()[-3:])
        print(f"| {name} | {seconds:.2f} | {mib:.0f} | {digest:.9e} |", flush=True)


if __name__ == "__main__":
    main()
