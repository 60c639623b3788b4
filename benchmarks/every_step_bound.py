"""How much of the every-step memory-tier loop's cost is the content hash: a bound.

Runs the loop of `tiers_restore.py --sections every-step` (the 125M-parameter MLP + AdamW,
a checkpoint every step into a memory tier, every 10th version flushed to local disk) in
rounds, each round four loops in an order that rotates:
- no checkpoint;
- forkpoint as it is;
- forkpoint with the content hash left out: each chunk is named by a counter instead of the
  blake3 of its bytes, so it is still copied, committed, evicted and flushed, never hashed;
- no checkpoint, but a plain `copy_` of every tensor of the state into buffers allocated
  beforehand, in the loop after each step (no library at all).
The third is not a mode of the library (its repositories are thrown away): it measures what
removing or deferring the hash could at most gain. The fourth is what any checkpoint of this
state must at least do each step: copy it out of the live tensors, which the next optimizer
step overwrites.

    python benchmarks/every_step_bound.py --rounds 3 --dir /work
"""

import contextlib
import itertools
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from tiers_restore import WIDTH, every_step_loop, state_tensors  # noqa: E402
from train_overhead import build, train_step  # noqa: E402

import forkpoint.engine.chunksave as save_pipeline  # noqa: E402
from forkpoint.format.objects import BLOCK_BYTES, DIGEST_BYTES  # noqa: E402



@contextlib.contextmanager
def unhashed():
    """Within the block, the save pipeline names each chunk by a counter (a block table of
    zeros of the right length) instead of hashing it."""
    counter = itertools.count(1)

    def name(data):
        n = int(data.nbytes)
        blocks = -(-n // BLOCK_BYTES) if n > BLOCK_BYTES else 0
        return f"{next(counter):064x}", bytes(DIGEST_BYTES * blocks)

    def copy_and_name(src, dst):
        save_pipeline.np.copyto(dst[:src.nbytes], src)
        return name(dst[:src.nbytes])

    saved = save_pipeline.hash_with_table, save_pipeline._copy_and_hash
    save_pipeline.hash_with_table, save_pipeline._copy_and_hash = name, copy_and_name
    try:
        yield
    finally:
        save_pipeline.hash_with_table, save_pipeline._copy_and_hash = saved


def copy_loop(steps, params_m, batch) -> dict:
    """The loop without checkpoints, each step followed by a `copy_` of every tensor of the
    state into buffers faulted in beforehand."""
    model, opt = build(params_m, "cpu")
    train_step(model, opt, batch)
    tensors = state_tensors(model, opt)
    copies = [torch.empty_like(t) for t in tensors]
    for c, t in zip(copies, tensors):
        c.copy_(t)
    t0, c0 = time.perf_counter(), os.times()
    durations = []
    for _ in range(steps):
        s0 = time.perf_counter()
        train_step(model, opt, batch)
        for c, t in zip(copies, tensors):
            c.copy_(t)
        durations.append(time.perf_counter() - s0)
    wall, c1 = time.perf_counter() - t0, os.times()
    return {"wall": wall, "loop": wall, "median": statistics.median(durations), "durations": durations,
            "cpu": (c1.user - c0.user) + (c1.system - c0.system), "setup": 0.0, "flushed": 0}


def main():
    ap = harness.arguments(__doc__, repeats=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--params-m", type=int, default=125)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    batch = torch.randn(args.batch, WIDTH, generator=torch.Generator().manual_seed(1))
    scratch = harness.scratch(args.dir, prefix="fp-bound-")
    modes = ["no checkpoint", "forkpoint", "forkpoint, hash left out", "a plain copy_ of the state each step"]
    runs = {m: [] for m in modes}
    print("| round | loop | wall (s) | slowdown | median step (s) | median slowdown | extra CPU per step (core-s) | flushed to disk (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            done = {}
            for m in order:
                if m == modes[3]:
                    done[m] = copy_loop(args.steps, args.params_m, batch)
                else:
                    with unhashed() if m == modes[2] else contextlib.nullcontext():
                        done[m] = every_step_loop(scratch, args.steps, args.params_m, "cpu", batch, m != modes[0])
                runs[m].append(done[m])
            base = done["no checkpoint"]
            for m in modes:
                d = done[m]
                print(f"| {r + 1} | {m} | {d['wall']:.2f} | {(d['wall'] / base['wall'] - 1) * 100:.0f}% | "
                      f"{d['median']:.2f} | {(d['median'] / base['median'] - 1) * 100:.0f}% | "
                      f"{(d['cpu'] - base['cpu']) / args.steps:.2f} | {d['flushed'] / 1e9:.2f} |",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    copies = [r["floor"][1] for r in runs[modes[0]]]
    print(f"\nA copy_ of the state with nothing else running: {min(copies):.3f}–{max(copies):.3f} s; "
          f"steps without checkpoints: {min(r['median'] for r in runs[modes[0]]):.2f}–"
          f"{max(r['median'] for r in runs[modes[0]]):.2f} s (medians per round)")
    print("\nMedians over rounds of each round's slowdown against its own no-checkpoint loop:")
    for m in modes[1:]:
        wall = statistics.median(d["wall"] / b["wall"] - 1 for d, b in zip(runs[m], runs[modes[0]]))
        med = statistics.median(d["median"] / b["median"] - 1 for d, b in zip(runs[m], runs[modes[0]]))
        print(f"- {m}: wall {wall * 100:.0f}%, median step {med * 100:.0f}%")


if __name__ == "__main__":
    main()
