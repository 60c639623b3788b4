"""Adjoint of a 1D heat equation solver over many time steps, with forkpoint's schedules.

u_{i+1} = u_i + nu * (u_i[j-1] - 2 u_i[j] + u_i[j+1]) (periodic), J(u_0) = 0.5 * sum(u_n^2).
The discrete adjoint gives dJ/du_0; it is checked against finite differences. The reverse
sweep runs on a two-level schedule: a few states in memory, every 100th on disk through a
tiered repository that prefetches them in reverse order.

    python examples/adjoint_heat.py --steps 1000 --dir /tmp/heat
"""

import argparse
import shutil
import tempfile
import uuid

import numpy as np

import forkpoint as fp

NU = 0.2


def step(u: np.ndarray) -> np.ndarray:
    return u + NU * (np.roll(u, 1) - 2 * u + np.roll(u, -1))


def step_adjoint(lam: np.ndarray) -> np.ndarray:
    return lam + NU * (np.roll(lam, -1) - 2 * lam + np.roll(lam, 1))


def objective(u0: np.ndarray, n: int) -> float:
    u = u0
    for _ in range(n):
        u = step(u)
    return 0.5 * float(u @ u)


def gradient(u0: np.ndarray, n: int, schedule, repo=None):
    def forward(i, u):
        return step(u)

    def adjoint(i, u_i, lam_next):
        if lam_next is None:
            lam_next = step(u_i)
        return step_adjoint(lam_next)

    return fp.adjoint.run(forward, adjoint, u0, n, schedule, repo=repo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--points", type=int, default=256)
    ap.add_argument("--memory-slots", type=int, default=4)
    ap.add_argument("--stride", type=int, default=100)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    u0 = rng.standard_normal(args.points)
    disk = args.dir or tempfile.mkdtemp(prefix="heat-")
    repo = fp.Repo(tiers=[fp.tier(f"mem://{uuid.uuid4().hex}", keep=3), disk], create=True)
    schedule = fp.adjoint.two_level(args.steps, args.memory_slots, args.stride)
    grad, stats = gradient(u0, args.steps, schedule, repo)
    repo.close()
    direction = rng.standard_normal(args.points)
    eps = 1e-6
    fd = (objective(u0 + eps * direction, args.steps) - objective(u0 - eps * direction, args.steps)) / (2 * eps)
    ad = float(grad @ direction)
    print(f"steps {args.steps}: adjoint directional derivative {ad:.10e}, finite differences {fd:.10e}, "
          f"relative error {abs(ad - fd) / abs(fd):.2e}")
    print(f"schedule: {schedule.stats()}; run: {stats}")
    if args.dir is None:
        shutil.rmtree(disk, ignore_errors=True)
    return abs(ad - fd) / abs(fd)


if __name__ == "__main__":
    main()
