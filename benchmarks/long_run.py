"""Many small saves in one process: save time at the start and the end of the run, time spent
in Python's full (generation 2) garbage collections, objects left reachable and peak RSS.
What it checks: a long run does not accumulate what finished saves used.

    python benchmarks/long_run.py --saves 1000 --dir /work
"""

import argparse
import collections
import gc
import os
import resource
import shutil
import tempfile
import time

import numpy as np

import forkpoint as fp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=1000)
    ap.add_argument("--leaves", type=int, default=40)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
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
    path = tempfile.mkdtemp(prefix="fp-long-run-", dir=args.dir)
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
    print(f"forkpoint from {os.path.dirname(fp.__file__)}")
    print(f"{args.saves} saves of {args.leaves} leaves: first 100 {first:.2f} s, last 100 {last:.2f} s; "
          f"{full[0]} full collections taking {full[1]:.2f} s; {len(gc.get_objects())} objects reachable; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    repo.close()
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
