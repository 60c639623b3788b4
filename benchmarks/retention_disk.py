"""Disk used by a Checkpointer that keeps the last few versions.

A training loop stand-in (a sleep per step) changes a state of `--mb` MB every step and a
Checkpointer saves it asynchronously every `--every` steps with keep=fp.Keep(last=3) and the
default gc grace period (600 s). After each step the script sums the sizes under objects/;
it reports the peak and the value when the loop ends (before close) and after close, against
what the 3 kept versions need.

    python benchmarks/retention_disk.py --steps 40 --step-seconds 1 --mb 64 --dir /work
"""

import os
import shutil
import sys
import time

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def objects_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(os.path.join(root, "objects")):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except FileNotFoundError:
                pass
    return total


def main() -> None:
    ap = harness.arguments(__doc__, repeats=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--step-seconds", type=float, default=1.0)
    ap.add_argument("--mb", type=int, default=64)
    args = ap.parse_args()
    root = harness.scratch(args.dir, prefix="fp-retention-")
    try:
        repo = fp.Repo(os.path.join(root, "repo"), create=True)
        state = {"w": torch.randn(args.mb << 18)}
        ck = fp.Checkpointer(repo, state, every=args.every, keep=fp.Keep(last=3))
        peak, start = 0, time.perf_counter()
        for step in range(args.steps):
            time.sleep(args.step_seconds)
            ck.wait_capture()
            state["w"].normal_()
            ck.step(step)
            peak = max(peak, objects_bytes(repo.url))
        at_end = objects_bytes(repo.url)
        loop = time.perf_counter() - start
        ck.close()
        after = objects_bytes(repo.url)
        need = 3 * state["w"].nbytes
        saved = len(repo.log())
        repo.close()
        mb = 1 << 20
        print(f"state {state['w'].nbytes / mb:.0f} MB, {saved} versions saved in {loop:.1f} s; "
              f"3 kept need {need / mb:.0f} MB")
        print(f"objects on disk: peak {peak / mb:.0f} MB ({peak / need:.2f}x), at loop end "
              f"{at_end / mb:.0f} MB ({at_end / need:.2f}x), after close {after / mb:.0f} MB ({after / need:.2f}x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
