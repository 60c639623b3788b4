"""libforkpoint (C) save and load throughput against the floor (fwrite + fsync, fread) and the Python API.

One run: `bench_io` (c/tests/bench_io.c) times the C library and the floor on the same float32
arrays, each save into a fresh repository; then fp.Repo saves and loads arrays of the same sizes.
Medians of --repeats; reads are from the page cache (the files were just written).
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_api(where: str, total_mib: int, arrays: int, repeats: int) -> tuple[float, float]:
    """Median seconds of fp.Repo.save (fresh repository each time) and of load."""
    rng = np.random.default_rng(0)
    each = total_mib * (1 << 20) // arrays // 4
    state = {f"a{i}": rng.random(each, dtype=np.float32) - 0.5 for i in range(arrays)}
    saves, loads = [], []
    for _ in range(repeats):
        path = os.path.join(where, "pyrepo")
        shutil.rmtree(path, ignore_errors=True)
        repo = fp.Repo(path, create=True)
        t = time.perf_counter()
        repo.save(state)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        tree = repo.load("main")
        loads.append(time.perf_counter() - t)
        assert all(np.array_equal(tree[k], v) for k, v in state.items())
        repo.close()
    return statistics.median(saves), statistics.median(loads)


def main() -> None:
    parser = harness.arguments(__doc__.splitlines()[0], repeats=3, dir_help="where to write (default: a temporary directory)")
    parser.add_argument("--mib", type=int, default=1024, help="total size of the arrays (MiB)")
    parser.add_argument("--arrays", type=int, default=8)
    args = parser.parse_args()
    subprocess.run(["make", "-C", os.path.join(ROOT, "c"), "-s", "tools"], check=True)
    where = args.dir or tempfile.mkdtemp(prefix="fp-c-io-")
    os.makedirs(where, exist_ok=True)
    out = subprocess.run([os.path.join(ROOT, "c", "build", "bench_io"), where, str(args.mib), str(args.arrays),
                          str(args.repeats)], check=True, capture_output=True, text=True).stdout
    rows = {name: float(sec) for name, sec, _ in (line.split("\t") for line in out.splitlines())}
    rows["fp.Repo.save (Python)"], rows["fp.Repo.load (Python)"] = python_api(where, args.mib, args.arrays, args.repeats)
    shutil.rmtree(where, ignore_errors=True)
    gb = args.mib * (1 << 20) / 1e9
    print(f"{args.arrays} float32 arrays, {args.mib} MiB in all; medians of {args.repeats}")
    print(f"{'':24} {'seconds':>8} {'GB/s':>6}")
    for name in ("fwrite+fsync", "fp_save", "fp.Repo.save (Python)", "fread", "fp_load", "fp.Repo.load (Python)"):
        print(f"{name:24} {rows[name]:8.3f} {gb / rows[name]:6.2f}")


if __name__ == "__main__":
    main()
