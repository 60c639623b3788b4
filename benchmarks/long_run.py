"""Many small saves in one process: save time at the start and the end of the run, time spent
in Python's full (generation 2) garbage collections, objects left reachable and peak RSS.
What it checks: a long run does not accumulate what finished saves used, and a save does not
get slower as the branch's history grows.

    python benchmarks/long_run.py --saves 1000 --dir /work
    python benchmarks/long_run.py --checkpointer --saves 3000 --dir /work

`--history`: `--saves` versions of a state of `--leaves` small tensors, then, each in a fresh
process (medians of `--repeats`), `forkpoint log` and a retention plan (`repo.prune_plan`),
which read every version's record.

    python benchmarks/long_run.py --history --saves 40 --leaves 20000 --dir /work

`--checkpointer`: a training loop of a small model with a Checkpointer saving asynchronously
every step and keeping the last 3 (retention after each commit): the median step time of the
first and the last 500 steps, how many versions retention had not pruned yet when the loop
ended, and how long `close()` waits for what is still in flight.
"""

import collections
import gc
import os
import resource
import shutil
import sys
import time

import numpy as np

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def main() -> None:
    ap = harness.arguments(__doc__, repeats=3)
    ap.add_argument("--saves", type=int, default=1000)
    ap.add_argument("--leaves", type=int, default=40)
    ap.add_argument("--checkpointer", action="store_true")
    ap.add_argument("--history", action="store_true")
    args = ap.parse_args()
    if args.checkpointer:
        checkpointer_steps(args)
        return
    if args.history:
        history_reads(args)
        return
    collections_ = collections.defaultdict(lambda: [0, 0.0])
    started = {}

    def timed_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            entry = collections_[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]

    gc.callbacks.append(timed_gc)
    path = harness.scratch(args.dir, prefix="fp-long-run-")
    repo = fp.Repo(os.path.join(path, "r"), create=True)
    state = {f"w{i}": np.random.default_rng(i).standard_normal(50_000).astype(np.float32)
             for i in range(args.leaves)}
    first = last = 0.0
    for i in range(args.saves):
        state["w0"][0] = i
        t0 = time.perf_counter()
        repo.save(state, step=i)
        elapsed = time.perf_counter() - t0
        first += elapsed if i < 100 else 0.0
        last += elapsed if i >= args.saves - 100 else 0.0
    repo.drain()
    gc.collect()
    full = collections_[2]
    report(repo, path, f"{args.saves} saves of {args.leaves} leaves: first 100 {first:.2f} s, last 100 "
           f"{last:.2f} s; {full[0]} full collections taking {full[1]:.2f} s; {len(gc.get_objects())} "
           f"objects reachable; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
           f"{ref_records(repo)} ref records of main")


def ref_records(repo) -> int:
    """How many records the branch head `main` has in the repository's first tier."""
    return len(repo.store.list("refs/heads/main"))


def report(repo, path: str, line: str) -> None:
    """Print which forkpoint ran and `line`, then close the repository and remove `path`."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}")
    print(line)
    repo.close()
    shutil.rmtree(path, ignore_errors=True)


def checkpointer_steps(args) -> None:
    import statistics

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = harness.scratch(args.dir, prefix="fp-long-ck-")
    repo = fp.Repo(os.path.join(path, "r"), create=True)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1, keep=fp.Keep(last=3))
    passes = []
    gc = repo.gc
    repo.gc = lambda *a, **k: passes.append(gc(*a, **k)) or passes[-1]
    steps = []
    for step in range(args.saves):
        t0 = time.perf_counter()
        model(torch.randn(32, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ck.step(step)
        steps.append(time.perf_counter() - t0)
    live = sum(not v.pruned for v in repo.log("main"))
    t0 = time.perf_counter()
    ck.close()
    closing = time.perf_counter() - t0
    window = min(500, args.saves // 2)
    report(repo, path, f"{args.saves} steps, a checkpoint every step, keep last 3: median step, first "
           f"{window} {statistics.median(steps[:window]) * 1e3:.1f} ms, last {window} "
           f"{statistics.median(steps[-window:]) * 1e3:.1f} ms; loop {sum(steps):.1f} s; close() "
           f"{closing:.2f} s; {live} versions not pruned yet before close(); "
           f"{len(repo.log('main'))} versions in the log, {ref_records(repo)} ref records; {len(passes)} gc "
           f"passes deleted {sum(p.deleted_objects for p in passes)} objects")


def history_reads(args) -> None:
    import statistics
    import subprocess
    import sys

    import torch

    path = harness.scratch(args.dir, prefix="fp-long-history-")
    url = os.path.join(path, "r")
    repo = fp.Repo(url, create=True)
    state = {f"layer{i}": torch.full((16,), float(i)) for i in range(args.leaves)}
    for i in range(args.saves):
        state["layer0"] += 1
        repo.save(state, step=i)
    repo.close()
    commands = {
        "forkpoint log": [sys.executable, "-m", "forkpoint.cli.main", "log", "-r", url],
        "repo.prune_plan(fp.Keep(last=3))": [sys.executable, "-c", "import forkpoint as fp, sys; "
                                             "print(len(fp.Repo(sys.argv[1]).prune_plan(fp.Keep(last=3))))", url],
    }
    print(f"forkpoint from {os.path.dirname(fp.__file__)}")
    for name, command in commands.items():
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
        print(f"{name} in a fresh process, {args.saves} versions of {args.leaves} leaves: "
              f"{statistics.median(times):.2f} s (median of {args.repeats})")
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
