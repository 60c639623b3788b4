"""Persist throughput to local disk: forkpoint's synchronous save vs `dd oflag=direct`, same run.

Also shows why forkpoint writes with O_DIRECT: the CPU cost of buffered writes + fsync
against direct writes of the same bytes. Runs are interleaved; medians are reported.

    python benchmarks/persist_throughput.py --repeats 5
"""

import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import forkpoint as fp

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from save_load import make_state  # noqa: E402



def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dd(path: str, nbytes: int) -> float:
    count = nbytes // (16 << 20)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct",
                    "conv=fsync", "status=none"], check=True)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return count * (16 << 20) / elapsed


def raw_write(path: str, buf: mmap.mmap, direct: bool) -> tuple[float, float]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0, c0 = time.perf_counter(), cpu_seconds()
    fd = os.open(path, flags)
    view, off = memoryview(buf), 0
    while off < len(buf):
        off += os.pwrite(fd, view[off:off + (16 << 20)], off)
    os.fsync(fd)
    os.close(fd)
    result = (time.perf_counter() - t0, cpu_seconds() - c0)
    os.unlink(path)
    return result


def main():
    ap = harness.arguments(__doc__, repeats=5, dir_help="directory on the file system to measure")
    args = ap.parse_args()
    scratch = harness.scratch(args.dir, prefix="fp-persist-")
    model, opt, nbytes = make_state(125)
    buf = mmap.mmap(-1, nbytes - nbytes % (16 << 20))
    buf.write(os.urandom(1 << 20) * (len(buf) >> 20))
    repo = fp.Repo(os.path.join(scratch, "repo"), create=True)
    results = {"dd oflag=direct": [], "forkpoint save": [], "direct wall": [], "direct cpu": [],
               "buffered wall": [], "buffered cpu": []}
    for rep in range(args.repeats):
        if rep % 2 == 0:
            results["dd oflag=direct"].append(dd(os.path.join(scratch, "dd.bin"), nbytes))
        t0 = time.perf_counter()
        repo.save({"model": model, "optim": opt, "rep": rep}, branch=f"b{rep}")
        results["forkpoint save"].append(nbytes / (time.perf_counter() - t0))
        if rep % 2 == 1:
            results["dd oflag=direct"].append(dd(os.path.join(scratch, "dd.bin"), nbytes))
        for mode in ("direct", "buffered"):
            wall, cpu = raw_write(os.path.join(scratch, f"{mode}.bin"), buf, mode == "direct")
            results[f"{mode} wall"].append(wall)
            results[f"{mode} cpu"].append(cpu)
        shutil.rmtree(os.path.join(scratch, "repo", "objects"), ignore_errors=True)
        print(f"rep {rep}: dd {results['dd oflag=direct'][-1] / 1e9:.2f} GB/s, "
              f"forkpoint {results['forkpoint save'][-1] / 1e9:.2f} GB/s", file=sys.stderr)
    repo.close()
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nstate {nbytes / 1e9:.2f} GB, {args.repeats} runs, medians\n")
    print("| writer | GB/s |")
    print("|---|---|")
    print(f"| dd if=/dev/zero bs=16M oflag=direct conv=fsync | {med['dd oflag=direct'] / 1e9:.2f} |")
    print(f"| forkpoint synchronous save (copy, blake3, O_DIRECT, fsync, commit) | {med['forkpoint save'] / 1e9:.2f} |")
    print(f"\nforkpoint / dd = {med['forkpoint save'] / med['dd oflag=direct']:.2f}\n")
    size = len(buf) / 1e9
    print("| raw write of the same bytes, 16 MiB pwrite + fsync | wall (s) | CPU (s) |")
    print("|---|---|---|")
    print(f"| O_DIRECT ({size:.2f} GB) | {med['direct wall']:.2f} | {med['direct cpu']:.2f} |")
    print(f"| buffered ({size:.2f} GB) | {med['buffered wall']:.2f} | {med['buffered cpu']:.2f} |")


if __name__ == "__main__":
    main()
