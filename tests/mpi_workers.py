"""MPI programs the tests in test_mpi.py run under mpiexec: `python mpi_workers.py NAME OUT ARGS...`.
Each rank writes its result as JSON to OUT/NAME.RANK.json."""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import forkpoint as fp

N = 768
"""Rows and columns of the global fields; `u` has 4 N rows (18 MiB, many 1 MiB blocks)."""


def shape_of(name: str) -> tuple[int, int]:
    return (4 * N, N) if name == "u" else (N, N)


def field(name: str) -> np.ndarray:
    """The global value of field `name` (the same on every rank and every rank count)."""
    i, j = np.indices(shape_of(name))
    if name == "u":
        return np.sin(0.01 * i) * np.cos(0.02 * j) + i * 1e-3
    if name == "w":
        return ((i * 7 + j * 3) % 1000 / 7.0).astype(np.float32)
    if name == "n":
        return (i * N + j).astype(np.int32)
    if name == "z":
        return (i + 1j * j).astype(np.complex128)
    if name == "mask":
        return (i + j) % 3 == 0
    raise KeyError(name)


FIELDS = ("u", "w", "n", "z", "mask")


def grid_box(comm, global_shape=(N, N)) -> tuple[tuple, tuple]:
    """This rank's (offset, shape) of an array of `global_shape` on a 2D process grid."""
    dims = MPI.Compute_dims(comm.size, 2)
    cart = comm.Create_cart(dims)
    ci, cj = cart.Get_coords(comm.rank)
    rows = np.array_split(np.arange(global_shape[0]), dims[0])[ci]
    cols = np.array_split(np.arange(global_shape[1]), dims[1])[cj]
    cart.Free()
    return (int(rows[0]), int(cols[0])), (len(rows), len(cols))


def slab_box(comm, global_shape=(N, N)) -> tuple[tuple, tuple]:
    """This rank's (offset, shape) of an array of `global_shape` as a slab of rows."""
    rows = np.array_split(np.arange(global_shape[0]), comm.size)[comm.rank]
    return (int(rows[0]), 0), (len(rows), global_shape[1])


def blocks(comm, scale: float = 1.0, box=grid_box) -> dict:
    """Every field as this rank's fp.Block of it (`u` times `scale`), decomposed by `box`."""
    out = {}
    for name in FIELDS:
        (i0, j0), (m, n) = box(comm, shape_of(name))
        local = field(name)[i0:i0 + m, j0:j0 + n].copy()
        if name == "u":
            local *= scale
        out[name] = fp.Block(local, (i0, j0), shape_of(name))
    return out


def save(comm, out: str, url: str) -> dict:
    """Two versions on a 2D decomposition: the fields, replicated coefficients, parameters,
    time and step, and rank-local state."""
    offset, shape = grid_box(comm)
    repo = fp.mpi.Repo(url, create=True, timeout=60)
    coef = np.linspace(0, 1, 300_000)  # replicated: equal on every rank
    ids = []
    for k, scale in enumerate((1.0, 2.0)):
        state = {"fields": blocks(comm, scale), "coef": coef, "t": 0.5 * (k + 1), "step": 100 * (k + 1),
                 "params": {"F": 0.035, "k": 0.065, "name": "gray-scott", "grid": [N, N]},
                 "rank": fp.RankLocal({"rank": comm.rank, "offset": list(offset)})}
        ids.append(repo.save(state, step=100 * (k + 1), sync=k == 0, meta={"ranks": comm.size}))
    ids = [v if isinstance(v, fp.Version) else v.wait() for v in ids]
    repo.close()
    return {"ids": [v.id for v in ids], "offset": list(offset), "shape": list(shape)}


def _count_object_reads() -> dict:
    """Count the object bytes this process reads from local storage."""
    from forkpoint.storage.local import LocalStore

    counter = {"bytes": 0}
    read, read_into = LocalStore.read, LocalStore.read_into

    def counted_read(self, key):
        data = read(self, key)
        if key.startswith("objects/"):
            counter["bytes"] += len(data)
        return data

    def counted_read_into(self, key, offset, buf):
        got = read_into(self, key, offset, buf)
        if key.startswith("objects/"):
            counter["bytes"] += got
        return got

    LocalStore.read, LocalStore.read_into = counted_read, counted_read_into
    return counter


def restore(comm, out: str, url: str, ref: str) -> dict:
    """Restore `ref` into row slabs (another decomposition); check every value; count the
    object bytes read for the field `u`."""
    repo = fp.mpi.Repo(url, timeout=60)
    counter = _count_object_reads()
    (u0, _), ushape = slab_box(comm, shape_of("u"))
    u = np.zeros(ushape)
    version = repo.restore({"fields": {"u": fp.Block(u, (u0, 0), shape_of("u"))}}, ref, paths=["fields/u"])
    u_bytes = counter["bytes"]
    live = {"fields": {name: fp.Block(np.zeros(slab_box(comm, shape_of(name))[1], field(name).dtype),
                                      slab_box(comm, shape_of(name))[0], shape_of(name)) for name in FIELDS},
            "coef": np.zeros(300_000), "t": 0.0, "step": 0,
            "params": {"F": 0.0, "k": 0.0, "name": "", "grid": [0, 0]}, "rank": fp.RankLocal({}, on_resize="skip")}
    repo.restore(live, ref)
    scale = 2.0 if live["step"] == 200 else 1.0
    wrong = [name for name in FIELDS if not np.array_equal(
        live["fields"][name].local, _rows(name, comm) * (scale if name == "u" else 1))]
    if not np.array_equal(u, _rows("u", comm) * scale):
        wrong.append("u (partial restore)")
    box = repo.load_block(ref, "fields/w", (100, 200), (50, 300))
    if not np.array_equal(box, field("w")[100:150, 200:500]):
        wrong.append("load_block")
    repo.close()
    return {"version": version.id, "wrong": wrong, "u_bytes_read": u_bytes, "u_bytes_needed": u.nbytes,
            "coef_ok": bool(np.array_equal(live["coef"], np.linspace(0, 1, 300_000))),
            "t": live["t"], "step": live["step"], "params": live["params"]}


def tiered(comm, out: str, fast: str, slow: str, local: str) -> dict:
    """Three versions of an evolving field through a fast tier (node-local when `local` is
    "1") onto a slow one, lossless codec and deltas; then every version restored on this
    number of ranks from the slow tier alone."""
    offset, shape = grid_box(comm)
    if local == "1" and comm.rank == 0:  # rank 0's flush of a version outlasts the next commit
        import forkpoint.repo.placement as placement

        real = placement.copy_object
        placement.copy_object = lambda *a: (time.sleep(0.3), real(*a))[1]
    tier0 = fp.tier(fast, keep=1, local=local == "1")
    repo = fp.mpi.Repo(tiers=[tier0, slow], create=True, timeout=60, codec="lossless",
                       delta=fp.Delta(max_chain=3))
    for store in repo.stores:  # encode every chunk whatever the load (no chunk written raw for later)
        store.paces_encoding = False
    (i0, j0), (m, n) = offset, shape
    base = field("u")[:N][i0:i0 + m, j0:j0 + n]
    ids = []
    for k in range(3):
        local_u = base.copy()
        local_u[(-i0) % 7::7] += k  # every 7th global row changes per version: deltas
        ids.append(repo.save({"u": fp.Block(local_u, offset, (N, N)), "k": k}, step=k).id)
    repo.drain()
    repo.barrier()
    errors = repo.stats()["flush_errors"]
    repo.close()
    return {"ids": ids, "flush_errors": errors}


def tiered_restore(comm, out: str, slow: str, ids: str) -> dict:
    """Restore each version of `tiered` into row slabs from the slow tier."""
    repo = fp.mpi.Repo(slow, timeout=60)
    (i0, _), shape = slab_box(comm)
    wrong = []
    for k, vid in enumerate(ids.split(",")):
        u = np.zeros(shape)
        repo.restore({"u": fp.Block(u, (i0, 0), (N, N)), "k": -1}, vid)
        want = field("u")[:N].copy()
        want[::7] += k
        if not np.array_equal(u, want[i0:i0 + shape[0]]):
            wrong.append(vid)
    repo.close()
    return {"wrong": wrong}


def _rows(name: str, comm) -> np.ndarray:
    (i0, _), (m, _) = slab_box(comm, shape_of(name))
    return field(name)[i0:i0 + m]


def stall(comm, out: str, url: str) -> dict:
    """Rank 1 arrives at the save long after the others' timeout: every rank must fail."""
    repo = fp.mpi.Repo(url, create=True, timeout=3)
    state = {"fields": blocks(comm)}  # (a collective: the process grid)
    if comm.rank == 1:
        time.sleep(8)
    start = time.monotonic()
    try:
        repo.save(state, step=1)
        result = {"error": None}
    except fp.mpi.DistSaveError as e:
        result = {"error": str(e)}
    result["seconds"] = time.monotonic() - start
    repo.barrier()
    result["branches"] = repo.branches()
    repo.close()
    return result


def killed(comm, out: str, url: str) -> dict:
    """One committed version, then rank 2 is killed while writing the second."""
    repo = fp.mpi.Repo(url, create=True, timeout=60)
    first = repo.save({"fields": blocks(comm)}, step=1)
    _write(out, "killed", comm.rank, {"first": first.id})
    comm.Barrier()
    if comm.rank == 2:
        from forkpoint.storage.local import LocalStore

        write = LocalStore.write

        def write_then_die(self, key, parts):
            if key.startswith("objects/"):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, key, parts)

        LocalStore.write = write_then_die
    repo.save({"fields": blocks(comm, 3.0)}, step=2)
    return {"second": "committed"}


def unreadable_head(comm, out: str, url: str) -> dict:
    """A first version, then rank 1 cannot read the head it builds on (its storage fails):
    every rank fails at once, not at the timeout, and the next save works."""
    from forkpoint.repo.commit import SaveSession

    repo = fp.mpi.Repo(url, create=True, timeout=60)
    state = {"fields": blocks(comm)}
    repo.save(state, step=1)
    real = SaveSession.known_chunks
    if comm.rank == 1:
        def failing(self):
            raise OSError("the head's packs are unreadable on this rank")
        SaveSession.known_chunks = failing
    start = time.monotonic()
    try:
        repo.save(state, step=2)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    SaveSession.known_chunks = real
    version = repo.save(state, step=3)
    repo.close()
    return {"raised": raised, "seconds": seconds, "last": version.step}


def missing(comm, out: str, url: str, where: str) -> dict:
    """Open a repository that does not exist, on rank 0 (`where` "rank0") or on rank 1 only
    (the others create theirs): every rank raises, none waits."""
    try:
        if where == "rank0":
            fp.mpi.Repo(url, timeout=30)
        else:
            fp.mpi.Repo(url + ("-elsewhere" if comm.rank == 1 else ""), create=True, timeout=30)
        return {"raised": None}
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}"}


def checkpointer(comm, out: str, url: str) -> dict:
    """A Checkpointer on every rank over fp.mpi.Repo, resumed if the branch has versions, for
    8 steps. Rank 0's policy is due every 2 steps and the others' every 3, so the ranks must
    agree at each step; the block is updated in place right after each step() returns."""
    repo = fp.mpi.Repo(url, create=True, timeout=30)
    rows = np.array_split(np.arange(N), comm.size)[comm.rank]
    u = np.full((len(rows), N), -1.0)
    ck = fp.Checkpointer(repo, {"u": fp.Block(u, (int(rows[0]), 0), (N, N))}, every=2 if comm.rank == 0 else 3)
    start = ck.resume()
    resumed = sorted({float(x) for x in np.unique(u)})
    for step in range(start, start + 8):
        u[...] = step
        ck.step(step)
        u += 100                                   # the next update, in place
    ck.close()
    steps = [v.step for v in repo.log()]
    wrong = [v.step for v in repo.log() if comm.rank == 0
             and not np.array_equal(repo.load(v.id)["u"], np.full((N, N), float(v.step)))]
    repo.close()
    return {"start": start, "resumed": resumed, "steps": steps, "wrong": wrong}


def _write(out: str, name: str, rank: int, result: dict) -> None:
    path = os.path.join(out, f"{name}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    name, out, *args = sys.argv[1:]
    comm = MPI.COMM_WORLD
    result = globals()[name](comm, out, *args)
    _write(out, name, comm.rank, result)


if __name__ == "__main__":
    main()
