"""Adjoint schedules: forkpoint against checkpoint_schedules, torch.utils.checkpoint, plain backprop.

1. Forward advances of Revolve for (l, s) pairs: forkpoint's `revolve` against
   `checkpoint_schedules.Revolve` (which also counts the l taping steps; subtracted here).
2. Backprop through a deep MLP: peak extra resident memory and time of plain backprop,
   `torch.utils.checkpoint.checkpoint_sequential` and `fp.adjoint.checkpoint_sequential`
   keeping a comparable number of stored activations.
3. The reverse sweep of the heat-equation adjoint (examples/adjoint_heat.py) over a memory +
   disk tier: storage wait with and without prefetch.

    python benchmarks/adjoint.py
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402


def schedules_section():
    import checkpoint_schedules as cs

    print("### Revolve forward advances (taping steps not counted)\n")
    print("| l | s | forkpoint revolve | checkpoint_schedules.Revolve | pyrevolve CRevolve | closed form |")
    print("|---|---|---|---|---|---|")
    for l, s in [(10, 2), (20, 3), (50, 5), (100, 10), (250, 4), (1000, 3), (1000, 10), (5000, 8)]:
        theirs = 0
        for act in cs.Revolve(l, s):
            if isinstance(act, cs.Forward):
                theirs += act.n1 - act.n0
            if isinstance(act, cs.EndReverse):
                break
        print(f"| {l} | {s} | {fp.adjoint.revolve(l, s).advances} | {theirs - l} | {_pyrevolve_advances(l, s)} | "
              f"{fp.adjoint.optimal_advances(l, s)} |")


def _pyrevolve_advances(l: int, s: int):
    """Forward advances of pyrevolve's C Revolve scheduler (its advance actions summed)."""
    try:
        from pyrevolve.schedulers import CRevolve
    except ImportError:
        return "not installed"
    sched, total = CRevolve(s, l), 0
    while True:
        act = sched.next()
        if act.type == 0:
            total += act.capo - act.old_capo
        if act.type == 6:
            return total


def _their_makespan(actions, uf, ub, wd, rd) -> tuple[float, int, int, int]:
    """(makespan, advances without taping steps, disk writes, disk reads) of a
    checkpoint_schedules schedule, costed as forkpoint's multilevel costs it (the taping
    step of each adjoint inside the backward cost)."""
    import checkpoint_schedules as cs

    advances = taping = writes = reads = steps = 0
    for act in actions:
        if isinstance(act, cs.Forward):
            n = act.n1 - act.n0
            if act.write_adj_deps:
                taping += 1
                n -= 1
            advances += n
            if act.write_ics and act.storage == cs.StorageType.DISK:
                writes += 1
        elif isinstance(act, (cs.Copy, cs.Move)) and act.from_storage == cs.StorageType.DISK:
            reads += 1
        elif isinstance(act, cs.Reverse):
            steps += act.n1 - act.n0
        elif isinstance(act, cs.EndReverse):
            break
    return advances * uf + steps * (ub + uf) + writes * wd + reads * rd, advances, writes, reads


def multilevel_section():
    import checkpoint_schedules as cs

    from forkpoint.adjoint import Level, multilevel

    print("\n### Two-level makespans (memory free, disk write wd / read rd; uf = ub = 1)\n")
    print("| l | memory slots | disk slots | wd | rd | forkpoint multilevel | checkpoint_schedules | "
          "pyrevolve HRevolve (uf = ub = 1) | forkpoint advances / disk writes / reads | checkpoint_schedules' |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for l, ram, disk, wd, rd in [(20, 2, 2, 2, 2), (50, 3, 3, 5, 3), (100, 4, 5, 2, 2), (200, 3, 10, 10, 5),
                                 (500, 5, 5, 3, 3), (100, 3, None, 2, 2), (400, 4, None, 5, 2)]:
        uf = ub = 1
        if disk is None:
            theirs = cs.DiskRevolve(l, ram, uf=uf, ub=ub, wd=wd, rd=rd)
        else:
            theirs = cs.HRevolve(l, ram, disk, uf=uf, ub=ub, wd=wd, rd=rd)
        t = _their_makespan(theirs, uf, ub, wd, rd)
        ours = multilevel(l, [Level(ram, 0, 0), Level(disk, wd, rd)], forward_cost=uf, backward_cost=ub + uf)
        st = ours.stats()
        pyrev = _pyrevolve_makespan(l, ram, disk, wd, rd)
        ours_pyrev = multilevel(l, [Level(ram, 0, 0), Level(disk, wd, rd)]).makespan
        pyrev_cell = "—" if pyrev is None else f"{pyrev:g} (forkpoint: {ours_pyrev:g})"
        print(f"| {l} | {ram} | {disk if disk is not None else 'unlimited'} | {wd} | {rd} | {ours.makespan:g} | "
              f"{t[0]:g} | {pyrev_cell} | {st['advances']} / {st['writes'].get(1, 0)} / {st['reads'].get(1, 0)} | "
              f"{t[1]} / {t[2]} / {t[3]} |")


def _pyrevolve_makespan(l, ram, disk, wd, rd):
    """pyrevolve's H-Revolve makespan (uf = ub = 1) for l adjoint steps: its `n_timesteps`
    counts backward steps 0..n, so l steps are n = l - 1. None without pyrevolve or for an
    unlimited disk (its HRevolve needs a slot count)."""
    if disk is None:
        return None
    try:
        from types import SimpleNamespace

        from pyrevolve.schedulers.base import Architecture
        from pyrevolve.schedulers.hrevolve import HRevolve
    except ImportError:
        return None
    arch = Architecture([SimpleNamespace(wd=0, rd=0, nckp=ram), SimpleNamespace(wd=wd, rd=rd, nckp=disk)])
    return HRevolve(l - 1, l - 1, arch, uf=1, ub=1).makespan


def online_section():
    from math import comb

    print("\n### Online schedule (length unknown during the forward pass): advances vs offline Revolve\n")
    print("| s | l | online | offline t(l, s) | ratio |")
    print("|---|---|---|---|---|")
    for s, l in [(2, 6), (3, 10), (5, 21), (10, 66), (2, 40), (3, 100), (5, 500), (10, 5000), (20, 10000)]:
        sched = fp.adjoint.online(s)
        for _ in range(l - 1):
            sched.advance()
        ours = sched.finish().advances
        best = fp.adjoint.optimal_advances(l, s)
        note = " (end of the repetition-2 range)" if l == comb(s + 2, 2) else ""
        print(f"| {s} | {l}{note} | {ours} | {best} | {ours / best:.3f} |")


class HeapPeak:
    """Samples the C heap's bytes in use (glibc mallinfo2: arena in use + mmapped blocks) every
    millisecond in a thread; `peak` is the highest sample. Unlike the resident set size it does
    not count freed memory the allocator keeps, so it follows live tensors."""

    def __init__(self):
        import ctypes
        import threading

        class Mallinfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                         "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
        self._read = lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
        self.base = self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self.base = self.peak = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


def _one_backprop(method: str, layers: int, width: int, batch: int) -> None:
    """Run one method in this (fresh) process; print time, peak extra RSS, peak extra heap in
    use and a gradient digest."""
    import resource

    torch.manual_seed(0)
    torch.set_num_threads(2)
    net = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    x = torch.randn(batch, width, requires_grad=True)
    kind, _, arg = method.partition(":")
    runs = {
        "plain": lambda: net(x),
        "torch": lambda: torch.utils.checkpoint.checkpoint_sequential(net, int(arg), x, use_reentrant=False),
        "forkpoint": lambda: fp.adjoint.checkpoint_sequential(net, x, int(arg)),
    }
    with torch.no_grad():
        net(x)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with HeapPeak() as heap:
        t0 = time.perf_counter()
        runs[kind]().pow(2).mean().backward()
        elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(elapsed, (peak - base) / 1024, (heap.peak - heap.base) / 2**20, float(x.grad.double().sum()))


def backprop_section(layers, width, batch, repeats):
    import subprocess

    methods = {"plain backprop": "plain", "torch checkpoint_sequential (segments=8)": "torch:8",
               "torch checkpoint_sequential (segments=16)": "torch:16",
               "forkpoint checkpoint_sequential (snapshots=8)": "forkpoint:8",
               "forkpoint checkpoint_sequential (snapshots=16)": "forkpoint:16"}
    act_mb = batch * width * 4 / 2**20
    print(f"\n### Backprop through {layers} x (Linear({width}) + Tanh), batch {batch} "
          f"({2 * layers} modules, one activation = {act_mb:.1f} MiB), medians of {repeats}, "
          "each run in a fresh process\n")
    print("| method | time (s) | peak extra heap in use (MiB) | peak extra RSS (MiB) | gradient sum |")
    print("|---|---|---|---|---|")
    for name, method in methods.items():
        rows = []
        for _ in range(repeats):
            out = subprocess.run([sys.executable, __file__, "--one", method, "--layers", str(layers),
                                  "--width", str(width), "--batch", str(batch)],
                                 capture_output=True, text=True, check=True).stdout.split()
            rows.append([float(v) for v in out])
        t = statistics.median(r[0] for r in rows)
        m = statistics.median(r[1] for r in rows)
        h = statistics.median(r[2] for r in rows)
        print(f"| {name} | {t:.2f} | {h:.0f} | {m:.0f} | {rows[0][3]:.6e} |")


def prefetch_section(steps, points):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "adjoint_heat.py")
    spec = importlib.util.spec_from_file_location("adjoint_heat", path)
    heat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heat)
    u0 = np.random.default_rng(0).standard_normal(points)
    print(f"\n### Heat-equation adjoint, {steps} steps of {points} points, two-level schedule "
          "(4 memory slots, every 100th state to a disk tier)\n")
    print("| prefetch | storage wait (s) | prefetch hits | restores | wall (s) |")
    print("|---|---|---|---|---|")
    for depth in (0, 2):
        with tempfile.TemporaryDirectory() as disk:
            repo = fp.Repo(tiers=[fp.tier(f"mem://{uuid.uuid4().hex}", keep=3), disk], create=True)
            sched = fp.adjoint.two_level(steps, 4, 100)
            forward = lambda i, u: heat.step(u)  # noqa: E731
            adjoint = lambda i, u, lam: heat.step_adjoint(heat.step(u) if lam is None else lam)  # noqa: E731
            t0 = time.perf_counter()
            _, stats = fp.adjoint.run(forward, adjoint, u0, steps, sched, repo=repo, prefetch_depth=depth)
            wall = time.perf_counter() - t0
            repo.close()
        print(f"| {'off' if depth == 0 else f'{depth} ahead'} | {stats.io_wait_seconds:.3f} | "
              f"{stats.prefetch_hits} | {stats.restored} | {wall:.2f} |")


def _their_two_level_advances(n: int, period: int, slots: int) -> int:
    """Advances (taping steps subtracted) of checkpoint_schedules' TwoLevelCheckpointSchedule,
    its forward run finalized at n steps."""
    import checkpoint_schedules as cs

    sched = cs.TwoLevelCheckpointSchedule(period, slots)
    advances, finalized = 0, False
    for act in sched:
        if isinstance(act, cs.Forward):
            end = min(act.n1, n)
            advances += end - act.n0 - (1 if act.write_adj_deps else 0)
            if end >= n and not finalized:
                sched.finalize(n)
                finalized = True
        elif isinstance(act, cs.EndReverse):
            return advances
    return advances


def two_level_section():
    """forkpoint's two_level against checkpoint_schedules' TwoLevel on every (n, period,
    memory slots) of a grid: how often each needs more advances, and the largest ratio."""
    cases = [(n, p, s) for n in range(2, 63, 3) for p in (1, 2, 3, 5, 8, 13, 25, 50) if p <= n
             for s in range(0, 5)]
    ours_more = theirs_more = 0
    worst = (0.0, None)
    for n, p, s in cases:
        ours = fp.adjoint.two_level(n, s, p).advances
        theirs = _their_two_level_advances(n, p, s)
        ours_more += ours > theirs
        theirs_more += theirs > ours
        if theirs and ours / theirs > worst[0]:
            worst = (ours / theirs, (n, p, s, ours, theirs))
    print(f"\ntwo_level vs checkpoint_schedules TwoLevel, {len(cases)} cases (n 2..62, period 1..50, "
          "memory slots 0..4)\n")
    print("| cases | forkpoint needs more advances | checkpoint_schedules needs more | largest forkpoint / theirs |")
    print("|---|---|---|---|")
    n, p, s, ours, theirs = worst[1]
    print(f"| {len(cases)} | {ours_more} | {theirs_more} | {worst[0]:.3f} (n={n}, period {p}, s={s}: "
          f"{ours} vs {theirs}) |")


def main():
    ap = harness.arguments(__doc__, repeats=3, directory=False)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--heat-steps", type=int, default=2000)
    ap.add_argument("--heat-points", type=int, default=200_000)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--schedules-only", action="store_true", help="only the schedule tables (seconds)")
    args = ap.parse_args()
    if args.one:
        return _one_backprop(args.one, args.layers, args.width, args.batch)
    schedules_section()
    multilevel_section()
    online_section()
    two_level_section()
    if args.schedules_only:
        return
    backprop_section(args.layers, args.width, args.batch, args.repeats)
    prefetch_section(args.heat_steps, args.heat_points)


if __name__ == "__main__":
    main()
