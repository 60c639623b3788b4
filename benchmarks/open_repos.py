"""What idle open repositories cost a save and load in the same process.

A process that opens many repositories and keeps them (a notebook, a test session, a tool
walking many runs) holds each one's scheduler threads. This opens `--open` repositories in
memory, leaves them idle, and times saving two versions of a `--leaves`-leaf state, then
loading and verifying them from a fresh handle, as the count of idle repositories grows
(medians of `--repeats`, each count in its own process so the threads of one do not linger
into the next).

    python -m benchmarks open_repos --open 0 150 --repeats 3
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def one_round(idle: int, leaves: int) -> float:
    """Seconds to save two versions of `leaves` leaves and read them back, with `idle` open."""
    import torch

    import forkpoint as fp

    kept = [fp.Repo(f"mem://idle-{i}-{uuid.uuid4().hex}", create=True) for i in range(idle)]
    url = f"mem://timed-{uuid.uuid4().hex}"
    start = time.perf_counter()
    repo = fp.Repo(url, create=True)
    state = {f"layer{i}": torch.full((4,), float(i)) for i in range(leaves)}
    repo.save(state, step=0)
    state["layer0"] += 1
    repo.save(state, step=1)
    fresh = fp.Repo(url)
    fresh.load("main~1")
    assert fresh.verify().ok
    seconds = time.perf_counter() - start
    del kept
    return seconds


def main() -> None:
    ap = harness.arguments(__doc__.splitlines()[0], repeats=3, directory=False)
    ap.add_argument("--open", type=int, nargs="+", default=[0, 150], help="idle repositories kept open")
    ap.add_argument("--leaves", type=int, default=4000)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(one_round(args.child, args.leaves))
        return
    print(f"{'idle repos':>10}  {'save+load s (median)':>20}  runs")
    for idle in args.open:
        runs = [float(subprocess.run([sys.executable, __file__, "--child", str(idle), "--leaves", str(args.leaves)],
                                     capture_output=True, text=True, check=True).stdout)
                for _ in range(args.repeats)]
        print(f"{idle:>10}  {statistics.median(runs):>20.2f}  {', '.join(f'{r:.2f}' for r in runs)}")


if __name__ == "__main__":
    main()
