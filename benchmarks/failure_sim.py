"""A long job under failures and preemptions: every="auto" against fixed save intervals.

Monte Carlo over jobs of `--work-h` hours of compute. Failures are exponential with MTBF M
(work since the last checkpoint is lost, then a restart costs R); preemptions arrive at
random (rate 1/(4M)) and are handled as forkpoint does: an emergency checkpoint (cost C),
exit, restart (R), no work lost. The automatic policy is forkpoint's own `YoungDaly` class fed
with the measured checkpoint cost (±20% noise per checkpoint); fixed intervals are scanned
and the best one is picked in hindsight, on the same random failure times.

    python benchmarks/failure_sim.py --jobs 300
"""

import math
import os
import random
import statistics
import sys

from forkpoint.policy.interval import YoungDaly

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def simulate(work: float, cost: float, restart: float, mtbf: float, interval, rng: random.Random):
    """Return (wall, wasted work, checkpoint time, failures) of one job; interval(observe) -> tau."""
    wall = done = ckpt_time = wasted = 0.0
    failures = 0
    next_fail = rng.expovariate(1 / mtbf)
    next_preempt = rng.expovariate(1 / (4 * mtbf))
    noise = random.Random(rng.random())
    while done < work:
        tau = interval()
        segment = min(tau, work - done)
        c = cost * noise.uniform(0.8, 1.2)
        end = wall + segment + c
        event = min(next_fail, next_preempt)
        if event < end:
            if next_fail <= next_preempt:
                wasted += event - wall
                failures += 1
                wall = event + restart
                next_fail = wall + rng.expovariate(1 / mtbf)
            else:
                progressed = min(event - wall, segment)
                done += progressed
                wall = wall + progressed + c + restart
                ckpt_time += c
                next_preempt = wall + rng.expovariate(1 / (4 * mtbf))
            next_fail = max(next_fail, wall)
            continue
        wall = end
        done += segment
        ckpt_time += c
        interval.observe(c) if hasattr(interval, "observe") else None
    return wall, wasted, ckpt_time, failures


class AutoInterval:
    def __init__(self, mtbf, max_fraction=None):
        self.auto = YoungDaly(mtbf=mtbf, max_fraction=max_fraction)

    def __call__(self):
        return self.auto.interval()[0] if self.auto.stall is not None else 60.0

    def observe(self, c):
        self.auto.observe(c)


class Fixed:
    def __init__(self, tau):
        self.tau = tau

    def __call__(self):
        return self.tau


def run_pair(cost, mtbf, restart, work, jobs, seed):
    def total(make):
        walls, wastes, ckpts, fails = [], [], [], []
        for j in range(jobs):
            w, waste, ck, f = simulate(work, cost, restart, mtbf, make(), random.Random(seed + j))
            walls.append(w)
            wastes.append(waste)
            ckpts.append(ck)
            fails.append(f)
        return statistics.mean(walls), sum(wastes) / max(1, sum(fails)), statistics.mean(ckpts) / statistics.mean(walls)

    auto_wall, auto_waste, auto_frac = total(lambda: AutoInterval(mtbf))
    capped_wall = total(lambda: AutoInterval(mtbf, 0.05))[0]
    grid = [math.sqrt(2 * cost * mtbf) * f for f in (0.25, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6, 2.0, 2.5, 3.0)]
    grid += [cost * 19]
    fixed = {tau: total(lambda tau=tau: Fixed(tau)) for tau in grid}
    best_tau = min(fixed, key=lambda t: fixed[t][0])
    return auto_wall, auto_waste, auto_frac, best_tau, fixed[best_tau], capped_wall


def main():
    ap = harness.arguments(__doc__, repeats=None, directory=False)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--work-h", type=float, default=200.0)
    ap.add_argument("--restart-min", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    work, restart = args.work_h * 3600, args.restart_min * 60
    pairs = [(300, 24 * 3600), (300, 6 * 3600), (300, 15 * 60), (30, 3600), (60, 4 * 3600)]
    print(f"{args.jobs} jobs of {args.work_h:.0f} h of compute each, restart {args.restart_min:.0f} min, "
          "preemptions at rate 1/(4M)\n")
    print("| C | M | auto: overhead | auto: waste per failure | auto: time checkpointing | "
          "best fixed interval (hindsight) | fixed: overhead | auto / best overhead | "
          "auto with 5% cap: overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cost, mtbf in pairs:
        aw, awaste, afrac, tau, (fw, fwaste, ffrac), cw = run_pair(cost, mtbf, restart, work, args.jobs, args.seed)
        over_a, over_f = aw - work, fw - work
        print(f"| {cost / 60:.1f} min | {mtbf / 3600:.2f} h | {over_a / work:.2%} | {awaste / 60:.1f} min | "
              f"{afrac:.2%} | {tau / 60:.1f} min | {over_f / work:.2%} | {over_a / over_f:.3f} | "
              f"{(cw - work) / work:.2%} |")


if __name__ == "__main__":
    main()
