"""A simulation's checkpoint stall: what a save of numpy arrays costs the time-step loop.

numpy counts no writes, so an asynchronous save of arrays that the loop updates in place
must copy them before the loop goes on: a Checkpointer's `step()` returns once they are
copied and writes them in the background. This times that call beside its floor (one
`np.copyto` of the arrays into buffers kept from round to round), a synchronous
`repo.save`, and `np.save` of each array with fsync; the state is `--arrays` float64 arrays
of `--mib` MiB in all, updated in place before each checkpoint (medians of `--repeats`; the
previous save is waited for outside the timed call).

    python -m benchmarks sim_stall --mib 1024 --repeats 5
"""

import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import forkpoint as fp  # noqa: E402


@dataclass
class Method:
    name: str
    checkpoint: Callable[[int], None]   # the timed call, at step `step`
    settle: Callable[[], None]          # untimed: wait for what the call left running
    close: Callable[[], None]


NAMES = ["np.copyto (floor)", "Checkpointer.step", "repo.save (sync)", "np.save + fsync"]


def methods(arrays: dict, where: str) -> list[Method]:
    """The methods of NAMES, over `arrays`, writing under `where`."""
    buffers = {k: np.empty_like(a) for k, a in arrays.items()}
    for b in buffers.values():
        b.fill(0)  # fault the pages in, as a warmed staging pool is

    def copy(step):
        for k, a in arrays.items():
            np.copyto(buffers[k], a)

    ck_repo = fp.Repo(os.path.join(where, "checkpointer"), create=True)
    ck = fp.Checkpointer(ck_repo, arrays, every=1, keep=fp.Keep(last=2))
    sync_repo = fp.Repo(os.path.join(where, "sync"), create=True)
    npy = os.path.join(where, "npy")
    os.makedirs(npy)

    def np_save(step):
        for k, a in arrays.items():
            with open(os.path.join(npy, f"{k}.npy"), "wb") as f:
                np.save(f, a)
                f.flush()
                os.fsync(f.fileno())

    def sync_save(step):
        sync_repo.save(arrays, step=step)
        sync_repo.gc(keep=fp.Keep(last=2))

    nothing = lambda: None  # noqa: E731
    calls = [(copy, nothing, nothing), (ck.step, ck.wait, lambda: (ck.close(), ck_repo.close())),
             (sync_save, nothing, sync_repo.close), (np_save, nothing, nothing)]
    return [Method(name, *call) for name, call in zip(NAMES, calls)]


def main() -> None:
    ap = harness.arguments(__doc__.splitlines()[0], repeats=5, methods=NAMES)
    ap.add_argument("--mib", type=int, default=1024, help="MiB of arrays in all")
    ap.add_argument("--arrays", type=int, default=4, help="how many arrays the MiB are split into")
    args = ap.parse_args()
    where = harness.scratch(args.dir)
    n = args.mib * 2**20 // 8 // args.arrays
    arrays = {f"field{i}": np.random.default_rng(i).random(n) for i in range(args.arrays)}
    chosen = harness.only(ap, methods(arrays, where), args.only)
    seconds = {m.name: [] for m in chosen}
    step = 0
    for _, order in harness.rounds(chosen, args.repeats):
        for m in order:
            for a in arrays.values():
                a += 1e-3                      # the time step, in place
            start = time.perf_counter()
            m.checkpoint(step)
            seconds[m.name].append(time.perf_counter() - start)
            m.settle()
            step += 1
    for m in chosen:
        m.close()
    floor = statistics.median(seconds[NAMES[0]]) if NAMES[0] in seconds else None
    print(f"{args.mib} MiB in {args.arrays} float64 arrays, medians of {args.repeats} rounds\n")
    harness.table(["method", "stall s (median)", "x floor", "rounds"],
                  [[name, f"{statistics.median(s):.3f}", f"{statistics.median(s) / floor:.2f}" if floor else "",
                    ", ".join(f"{x:.3f}" for x in s)] for name, s in seconds.items()])
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
