"""MPI: fp.mpi.Repo save/restore of a decomposed state vs MPI-IO and np.save per rank; N->M restart.

    python -m benchmarks mpi_io [--ranks 4] [--restart-ranks 2] [--mib 1024] [--repeats 3]

Launches itself under mpiexec (oversubscribed). The state is two float64 fields split into
row slabs, one per rank. Each contender makes its bytes durable before the clock stops
(forkpoint commits after fsync; MPI-IO calls File.Sync; np.save is followed by os.fsync), and
reads come from the page cache for all three alike. The restart reads the same state on
`--restart-ranks` ranks, each its new slab: forkpoint from the chunks that meet it, MPI-IO at
the new offsets, np.save's files by memory-mapping the ones that overlap. Times are the
slowest rank's, medians of the repeats.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

FIELDS = ("u", "v")


def slab(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    counts = [len(r) for r in np.array_split(np.arange(rows), ranks)]
    return sum(counts[:rank]), counts[rank]


def timed(comm, fn) -> float:
    """The slowest rank's seconds for `fn` (every rank starts together)."""
    comm.Barrier()
    start = time.perf_counter()
    fn()
    mine = time.perf_counter() - start
    return comm.allreduce(mine, op=__import__("mpi4py").MPI.MAX)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def contenders(comm, out: str, n: int, data: dict, first: int):
    """{name: (save(i), restore into `data`-shaped buffers(i))} for repeat i."""
    from mpi4py import MPI

    import forkpoint as fp

    repo = fp.mpi.Repo(os.path.join(out, "repo"), create=True)
    row_bytes = n * 8

    def fp_state(arrays):
        return {k: fp.Block(a, (first, 0), (n, n)) for k, a in arrays.items()}

    def fp_save(i):
        repo.save(fp_state(data), step=i)

    def fp_restore(i, into):
        repo.restore(fp_state(into), "main")

    def mpiio_path(k, i):
        return os.path.join(out, f"mpiio-{k}-{i}.bin")

    def mpiio_save(i):
        for k, a in data.items():
            fh = MPI.File.Open(comm, mpiio_path(k, i), MPI.MODE_CREATE | MPI.MODE_WRONLY)
            fh.Write_at_all(first * row_bytes, a)
            fh.Sync()
            fh.Close()

    def mpiio_restore(i, into):
        for k, a in into.items():
            fh = MPI.File.Open(comm, mpiio_path(k, i), MPI.MODE_RDONLY)
            fh.Read_at_all(first * row_bytes, a)
            fh.Close()

    def npy_path(k, i, rank):
        return os.path.join(out, f"npy-{k}-{i}-{rank}.npy")

    def npy_save(i):
        for k, a in data.items():
            np.save(npy_path(k, i, comm.rank), a)
            fsync_path(npy_path(k, i, comm.rank))

    def npy_restore(i, into):
        for k, a in into.items():
            a[...] = np.load(npy_path(k, i, comm.rank))

    return repo, {"forkpoint": (fp_save, fp_restore), "mpi-io": (mpiio_save, mpiio_restore),
                  "np.save per rank": (npy_save, npy_restore)}


def restart(comm, out: str, n: int, saved_ranks: int, i: int) -> dict:
    """Seconds (slowest rank) to read this rank's new slab of every field, per contender."""
    from mpi4py import MPI

    import forkpoint as fp

    first, rows = slab(n, comm.size, comm.rank)
    repo = fp.mpi.Repo(os.path.join(out, "repo"))
    row_bytes = n * 8

    def fp_read(into):
        repo.restore({k: fp.Block(a, (first, 0), (n, n)) for k, a in into.items()}, "main")

    def mpiio_read(into):
        for k, a in into.items():
            fh = MPI.File.Open(comm, os.path.join(out, f"mpiio-{k}-{i}.bin"), MPI.MODE_RDONLY)
            fh.Read_at_all(first * row_bytes, a)
            fh.Close()

    def npy_read(into):
        for k, a in into.items():
            for r in range(saved_ranks):
                s0, s_rows = slab(n, saved_ranks, r)
                lo, hi = max(first, s0), min(first + rows, s0 + s_rows)
                if lo < hi:
                    part = np.load(os.path.join(out, f"npy-{k}-{i}-{r}.npy"), mmap_mode="r")
                    a[lo - first:hi - first] = part[lo - s0:hi - s0]

    times, read = {}, {}
    for name, fn in (("forkpoint", fp_read), ("mpi-io", mpiio_read), ("np.save per rank", npy_read)):
        read[name] = {k: np.empty((rows, n)) for k in FIELDS}
        times[name] = timed(comm, lambda: fn(read[name]))
    if not all(np.array_equal(read["forkpoint"][k], other[k]) for other in read.values() for k in FIELDS):
        raise SystemExit("the restarts read different values")
    repo.close()
    return {"times": times}


def child(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = int((args.mib * 2 ** 20 / 8 / len(FIELDS)) ** 0.5)
    if args.phase == "restart":
        result = restart(comm, args.out, n, args.ranks, args.repeats - 1)
        if comm.rank == 0:
            print(json.dumps({"restart": result["times"], "n": n}))
        return
    first, rows = slab(n, comm.size, comm.rank)
    rng = np.random.default_rng(comm.rank)
    data = {k: rng.standard_normal((rows, n)) for k in FIELDS}
    repo, cands = contenders(comm, args.out, n, data, first)
    into = {k: np.empty_like(a) for k, a in data.items()}
    save_t = {name: [] for name in cands}
    load_t = {name: [] for name in cands}
    for i in range(args.repeats):
        for a in data.values():  # new values each repeat: nothing deduplicates against the last
            a += 1.0
        for name, (save, load) in cands.items():
            save_t[name].append(timed(comm, lambda: save(i)))
            load_t[name].append(timed(comm, lambda: load(i, into)))
            if not all(np.array_equal(into[k], data[k]) for k in FIELDS):
                raise SystemExit(f"{name}: restored values differ")
    repo.close()
    if comm.rank == 0:
        med = {name: (statistics.median(save_t[name]), statistics.median(load_t[name])) for name in cands}
        print(json.dumps({"n": n, "bytes": 8 * n * n * len(FIELDS), "median": med, "runs": save_t}))


def main() -> None:
    p = harness.arguments(__doc__.splitlines()[0], repeats=3, directory=False)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--restart-ranks", type=int, default=2)
    p.add_argument("--mib", type=float, default=1024, help="size of the whole state")
    p.add_argument("--out", default="bench-out/mpi_io")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase is not None:
        return child(args)
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    common = [__file__, "--mib", str(args.mib), "--repeats", str(args.repeats), "--out", args.out,
              "--ranks", str(args.ranks)]
    runs = subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, *common, "--phase", "save"],
                          check=True, capture_output=True, text=True)
    saved = json.loads(runs.stdout.strip().splitlines()[-1])
    back = subprocess.run([mpiexec, "-n", str(args.restart_ranks), sys.executable, *common, "--phase", "restart"],
                          check=True, capture_output=True, text=True)
    restarted = json.loads(back.stdout.strip().splitlines()[-1])
    gib = saved["bytes"] / 2 ** 30
    print(f"{args.ranks} ranks, {gib:.2f} GiB ({len(FIELDS)} float64 fields {saved['n']}^2), medians of "
          f"{args.repeats}; restart on {args.restart_ranks} ranks")
    print(f"{'':<18}{'save s':>9}{'GiB/s':>8}{'restore s':>11}{'GiB/s':>8}{'restart s':>11}")
    for name, (save, load) in saved["median"].items():
        again = restarted["restart"][name]
        print(f"{name:<18}{save:>9.2f}{gib / save:>8.2f}{load:>11.2f}{gib / load:>8.2f}{again:>11.2f}")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
