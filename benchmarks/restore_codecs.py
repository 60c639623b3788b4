"""Restore speed per codec: the 24M-parameter MLP + AdamW state of benchmarks/codecs.py, saved
once with each codec, then restored in place into a copy of the model and optimizer
(medians of runs after the first, so the objects are in the page cache: what decoding costs).

    python benchmarks/restore_codecs.py --repeats 9 --dir /work
"""

import argparse
import copy
import importlib.util
import os
import shutil
import statistics
import tempfile
import time

import torch

import forkpoint as fp


def trained_state(dtype):
    """The state benchmarks/codecs.py saves (loaded by path: `codecs` is also a stdlib module)."""
    spec = importlib.util.spec_from_file_location("codecs_bench", os.path.join(os.path.dirname(__file__), "codecs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trained_state(dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="fp-restore-codecs-", dir=args.dir)
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | codec | restore (s) | GB/s | CPU (core-s) |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        target = copy.deepcopy(state)
        for codec in ("raw", "lossless", "zstd"):
            path = os.path.join(scratch, codec)
            with fp.Repo(path, create=True, codec=codec) as repo:
                version = repo.save(state)
            with fp.Repo(path) as repo:
                repo.restore(target, version.id)
                times, cpu = [], []
                for _ in range(args.repeats):
                    c0, t0 = os.times(), time.perf_counter()
                    repo.restore(target, version.id)
                    times.append(time.perf_counter() - t0)
                    c1 = os.times()
                    cpu.append(c1.user - c0.user + c1.system - c0.system)
            shutil.rmtree(path)
            t = statistics.median(times)
            print(f"| {str(dtype).removeprefix('torch.')} | {codec} | {t:.3f} | "
                  f"{version.logical_bytes / t / 1e9:.2f} | {statistics.median(cpu):.2f} |")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
