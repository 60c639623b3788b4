"""The scheduler's own cost: a save-shaped DAG of no-op tasks, and real saves.

`dag`: N captures (each needing 1 of 2 CPU workers and 8 of a 64-unit window), N writes (each
after its capture, one of 4 I/O slots, giving the window back) and one commit after all the
writes, on 8 + 1 threads as a repository runs them; tasks do nothing, so the wall and CPU time
are the scheduler's. `save`: saves of benchmarks/codecs.py's fp32 MLP state (24
Linear(1024, 1024) + AdamW, 302 MB) to local disk, codec "none" and "lossless", each followed
by `drain()`; process CPU seconds and wall seconds per save. `many`: the same for a state of
4000 tensors of 64 KiB saved as 4000 chunks (`SaveOptions(small_leaf_bytes=32 KiB)`, codec
"none", 256 MB), about 8000 tasks a save, then restores of it into the state (from the page
cache). With `--other SRC`, each measurement runs in a fresh process for this checkout and for
SRC (`PYTHONPATH`), alternating, `--repeats` times; medians.

    .venv/bin/python benchmarks/scheduler.py --other /tmp/base/src --repeats 5 --dir /work
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

HERE = Path(__file__).resolve().parent
SIZES = (500, 2000, 8000)


def dag(n: int) -> dict:
    from forkpoint.engine import Budget, Priority, Scheduler

    sched = Scheduler(Budget(window_bytes=64, cpu_workers=2, default_io_slots=4), threads=8,
                      background_threads=1)
    cpu, wall = time.process_time(), time.perf_counter()
    with sched.batch():
        writes = []
        for _ in range(n):
            cap = sched.submit("capture", int, priority=Priority.CAPTURE, needs={"window": 8, "cpu": 1},
                               frees={"cpu": 1})
            writes.append(sched.submit("write", int, priority=Priority.WRITE, needs={"io:t": 1},
                                       frees={"io:t": 1, "window": 8}, deps=[cap]))
        commit = sched.submit("commit", int, priority=Priority.COMMIT, deps=writes)
    commit.result()
    out = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    sched.shutdown()
    return out


def timed(action, repeats: int, before=lambda: None) -> dict:
    """Median process CPU and wall seconds of `action()` over `repeats` calls, each after
    `before()` (untimed)."""
    cpu, wall = [], []
    for _ in range(repeats):
        before()
        c, w = time.process_time(), time.perf_counter()
        action()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {"cpu": statistics.median(cpu), "wall": statistics.median(wall)}


def saves(directory: str, repeats: int) -> dict:
    import importlib.util
    sys.path.append(str(HERE))

    import forkpoint as fp
    spec = importlib.util.spec_from_file_location("bench_codecs", HERE / "codecs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import torch
    state = bench.trained_state(torch.float32)
    out = {}
    for codec in ("none", "lossless"):
        path = tempfile.mkdtemp(dir=directory, prefix="sched-bench-")
        repo = fp.Repo(path, create=True, codec=codec)
        repo.save(state)
        repo.drain()
        out[codec] = timed(lambda: (repo.save(state), repo.drain()), repeats,
                           before=lambda: bench.train_step(state, torch.float32))
        repo.close()
        shutil.rmtree(path)
    return out


def many_chunks(directory: str, repeats: int) -> dict:
    import torch

    import forkpoint as fp
    from forkpoint.engine.save import SaveOptions
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(16384) for i in range(4000)}
    path = tempfile.mkdtemp(dir=directory, prefix="sched-bench-")
    repo = fp.Repo(path, create=True, codec="none", options=SaveOptions(small_leaf_bytes=32 << 10))
    out = timed(lambda: (repo.save(state), repo.drain()), repeats,
                before=lambda: [t.add_(1e-3) for t in state.values()])
    out.update({f"restore {key}": v for key, v in timed(lambda: repo.restore(state), repeats).items()})
    repo.close()
    shutil.rmtree(path)
    return out


def child(args) -> None:
    if args.child == "dag":
        print(json.dumps({str(n): dag(n) for n in SIZES}))
    elif args.child == "many":
        print(json.dumps(many_chunks(args.dir, args.saves)))
    else:
        print(json.dumps(saves(args.dir, args.saves)))


def run_child(src: str, what: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, __file__, "--child", what, "--dir", args.dir, "--saves", str(args.saves)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = harness.arguments(__doc__, repeats=3, dir_default=tempfile.gettempdir())
    ap.add_argument("--other", help="another checkout's src directory to compare with")
    ap.add_argument("--saves", type=int, default=3, help="saves per codec in each save process")
    ap.add_argument("--child", choices=("dag", "save", "many"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sources = {"this": str(HERE.parent / "src")}
    if args.other:
        sources["other"] = args.other
    runs = {name: {"dag": [], "save": [], "many": []} for name in sources}
    for i in range(args.repeats):
        for name in (list(sources) if i % 2 == 0 else list(reversed(sources))):
            for what in ("dag", "save", "many"):
                runs[name][what].append(run_child(sources[name], what, args))
    print("| measure | " + " | ".join(sources) + " |")
    print("|---|" + "---|" * len(sources))
    for n in SIZES:
        for key in ("wall", "cpu"):
            row = [statistics.median(r[str(n)][key] for r in runs[name]["dag"]) * 1e6 / (2 * n + 1)
                   for name in sources]
            print(f"| DAG of {2 * n + 1} tasks: {key} us per task | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    for codec in ("none", "lossless"):
        for key in ("wall", "cpu"):
            row = [statistics.median(r[codec][key] for r in runs[name]["save"]) for name in sources]
            print(f"| save, codec {codec}: {key} s | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    for key in ("wall", "cpu", "restore wall", "restore cpu"):
        row = [statistics.median(r[key] for r in runs[name]["many"]) for name in sources]
        what = "restore" if key.startswith("restore") else "save"
        print(f"| {what} of 4000 chunks: {key.split()[-1]} s | " + " | ".join(f"{v:.3f}" for v in row) + " |")


if __name__ == "__main__":
    main()
