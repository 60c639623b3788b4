"""Gray-Scott reaction-diffusion on MPI, checkpointed with fp.mpi.Repo.

    mpiexec -n 4 python examples/gray_scott_mpi.py --repo runs/gs --steps 2000 --every 200

The square grid is split into slabs of rows, one per rank, with one ghost row above and below
exchanged every step (periodic boundaries). Every `--every` steps the ranks save their slabs
as fp.Block pieces of the global fields `u` and `v` with the step and the parameters. Started
again with the same --repo and --branch, the run resumes from the branch head on however many
ranks it now has, and finishes bit-identical to an uninterrupted run: each cell's update reads
only its neighbours, in the same order whatever the decomposition. `--fork-from REF --F 0.05`
starts a new branch from version REF with another feed rate; `forkpoint diff` compares them.
"""

import argparse

import numpy as np
from mpi4py import MPI

import forkpoint as fp

DU, DV, DT = 0.16, 0.08, 1.0


def slab(n: int, comm) -> tuple[int, int]:
    """(first row, number of rows) of this rank's slab of an n-row grid."""
    counts = [len(r) for r in np.array_split(np.arange(n), comm.size)]
    return sum(counts[:comm.rank]), counts[comm.rank]


def initial(n: int, first: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded initial fields' rows [first, first + rows) (the same on any decomposition)."""
    u, v = np.ones((n, n)), np.zeros((n, n))
    c, r = n // 2, max(1, n // 10)
    u[c - r:c + r, c - r:c + r], v[c - r:c + r, c - r:c + r] = 0.50, 0.25
    noise = np.random.default_rng(7).random((n, n))
    v += 0.01 * noise
    return u[first:first + rows].copy(), v[first:first + rows].copy()


def with_halo(a: np.ndarray, comm) -> np.ndarray:
    """`a` with the neighbouring ranks' edge rows above and below (periodic)."""
    up, down = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    above, below = np.empty_like(a[0]), np.empty_like(a[0])
    comm.Sendrecv(np.ascontiguousarray(a[-1]), dest=down, recvbuf=above, source=up)
    comm.Sendrecv(np.ascontiguousarray(a[0]), dest=up, recvbuf=below, source=down)
    return np.vstack([above, a, below])


def laplacian(h: np.ndarray) -> np.ndarray:
    """Five-point Laplacian of the interior rows of haloed `h` (periodic in columns)."""
    mid = h[1:-1]
    return (h[:-2] + h[2:]) + (np.roll(mid, 1, axis=1) + np.roll(mid, -1, axis=1)) - 4.0 * mid


def step(u: np.ndarray, v: np.ndarray, F: float, k: float, comm) -> None:
    """One explicit Euler step of the Gray-Scott equations, in place."""
    lu, lv = laplacian(with_halo(u, comm)), laplacian(with_halo(v, comm))
    uvv = u * v * v
    u += DT * (DU * lu - uvv + F * (1.0 - u))
    v += DT * (DV * lv + uvv - (F + k) * v)


def state(u, v, first: int, n: int, t: int, F: float, k: float) -> dict:
    return {"u": fp.Block(u, (first, 0), (n, n)), "v": fp.Block(v, (first, 0), (n, n)),
            "step": t, "params": {"F": F, "k": k}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True)
    p.add_argument("--branch", default="main")
    p.add_argument("--n", type=int, default=128, help="grid size (n x n)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200, help="checkpoint interval in steps")
    p.add_argument("--F", type=float, default=0.035, help="feed rate (default: the saved one, or 0.035)")
    p.add_argument("--k", type=float, default=0.065, help="kill rate")
    p.add_argument("--fork-from", default=None, help="start branch --branch from this version")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    repo = fp.mpi.Repo(args.repo, create=True)
    first, rows = slab(args.n, comm)
    u, v = np.empty((rows, args.n)), np.empty((rows, args.n))
    live = state(u, v, first, args.n, 0, args.F, args.k)
    # rank 0 decides whether to fork: a rank that looked after the fork would skip the barrier
    fork = args.fork_from is not None and args.branch not in repo.branches() if comm.rank == 0 else None
    if comm.bcast(fork):
        if comm.rank == 0:
            repo.fork(args.fork_from, args.branch)
        repo.barrier()
    if args.branch in repo.branches():
        repo.restore(live, args.branch)
        if args.fork_from is None:
            args.F, args.k = live["params"]["F"], live["params"]["k"]
    else:
        u[:], v[:] = initial(args.n, first, rows)
    t = live["step"]
    if comm.rank == 0:
        print(f"{comm.size} ranks, step {t} -> {args.steps}, F={args.F} k={args.k}", flush=True)
    while t < args.steps:
        step(u, v, args.F, args.k, comm)
        t += 1
        if t % args.every == 0 or t == args.steps:
            repo.save(state(u, v, first, args.n, t, args.F, args.k), branch=args.branch, step=t,
                      metrics={"mean_v": float(comm.allreduce(v.sum())) / args.n ** 2})
    repo.close()


if __name__ == "__main__":
    main()
