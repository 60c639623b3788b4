"""Preemption and walltime: save at the next step boundary, then exit with a distinctive code.

Signals (default SIGTERM and SIGUSR1) set a stop request that the Checkpointer honours at
the next `step()`: one synchronous save of that consistent state, agreed by every rank,
then exit with PREEMPTED_EXIT_CODE (after `scontrol requeue` when asked). A watchdog makes
sure the process is gone by the deadline even if no step boundary comes. Near the job's end
time (SLURM, or FORKPOINT_END_TIME) it saves once, with a margin from measured times.
"""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

PREEMPTED_EXIT_CODE = 75


@dataclass
class Preemption:
    """What to do on preemption signals and near the walltime."""

    signals: tuple = (signal.SIGTERM, signal.SIGUSR1)
    deadline: float = 60.0
    exit_code: int = PREEMPTED_EXIT_CODE
    requeue: bool = False
    walltime: bool = True
    end_time: float | None = None
    margin: float | None = None


def slurm_end_time() -> float | None:
    """Return the job's end time (epoch seconds) from the environment or squeue, if known."""
    for var in ("FORKPOINT_END_TIME", "SLURM_JOB_END_TIME"):
        value = os.environ.get(var, "")
        if value.replace(".", "", 1).isdigit():
            return float(value)
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def requeue_command() -> list[str] | None:
    """Return the scontrol command that requeues this SLURM job (or array task)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")
    return ["scontrol", "requeue", job] if job else None


def estimate_mtbf(repo, branch: str) -> float | None:
    """Mean time between failures from the branch's history: wall time spanned / restarts."""
    try:
        log = [v for v in repo.log(branch)]
    except Exception:  # an empty or new branch has no history to learn from
        return None
    restarts = max((int(v.meta.get("restarts", 0)) for v in log if isinstance(v.meta, dict)), default=0)
    if restarts == 0 or len(log) < 2:
        return None
    return (log[0].time - log[-1].time) / restarts


class WalltimeGuard:
    """Wraps a save policy: also saves once when the end time minus a margin is reached."""

    def __init__(self, inner, ck, end_time: float, margin: float | None):
        self.inner, self.ck, self.end_time, self.fixed_margin = inner, ck, end_time, margin
        self.saved = False
        self.step_seconds = 0.0
        self._last_step = None

    def margin(self) -> float:
        if self.fixed_margin is not None:
            return self.fixed_margin
        save = max(self.ck.save_seconds, default=1.0)
        return 3 * save + 2 * self.step_seconds

    def should_save(self, step, last_save_time) -> bool:
        now = time.monotonic()
        if self._last_step is not None:
            self.step_seconds = max(self.step_seconds * 0.5, now - self._last_step)
        self._last_step = now
        if not self.saved and time.time() >= self.end_time - self.margin():
            self.saved = True
            self.ck.request_stop("walltime", lambda v: None)
        return self.inner.should_save(step, last_save_time)

    def observe(self, stall):
        observe = getattr(self.inner, "observe", None)
        if observe is not None:
            observe(stall)

    def explain(self) -> str:
        inner = self.inner.explain() if hasattr(self.inner, "explain") else repr(self.inner)
        left = self.end_time - time.time()
        return f"{inner}; and once {self.margin():.1f} s before the job's end ({left:.0f} s from now)"

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install_preemption(ck) -> None:
    """Checkpointer extension: signal handlers, deadline watchdog, walltime save, MTBF estimate."""
    from .interval import YoungDaly

    if isinstance(ck.policy, YoungDaly) and ck.policy.mtbf is None:
        ck.policy.mtbf_estimate = estimate_mtbf(ck.repo, ck.branch)
    opts = ck.preemption
    if not opts:
        return
    opts = Preemption() if opts is True else opts
    if opts.walltime:
        end = opts.end_time or slurm_end_time()
        if end is not None:
            ck.policy = WalltimeGuard(ck.policy, ck, end, opts.margin)

    def leave(version=None):
        command = requeue_command() if opts.requeue else None
        if command:
            print(f"forkpoint: requeueing with {shlex.join(command)}", file=sys.stderr)
            subprocess.run(command, check=False)
        raise SystemExit(opts.exit_code)

    ck.on_remote_stop = leave
    if threading.current_thread() is not threading.main_thread():
        return
    done = threading.Event()

    def finish(version):
        done.set()
        leave(version)

    def watchdog():
        if done.wait(max(0.0, opts.deadline - 1.0)):
            return
        print("forkpoint: no step boundary before the preemption deadline; exiting with the newest "
              "committed version", file=sys.stderr)
        try:
            ck.repo.drain()
        finally:
            command = requeue_command() if opts.requeue else None
            if command:
                subprocess.run(command, check=False)
            os._exit(opts.exit_code)

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if ck.stop_request is None:
            ck.request_stop(f"signal {name}", finish)
            threading.Thread(target=watchdog, daemon=True, name="forkpoint-deadline").start()

    previous = {}
    for sig in opts.signals:
        previous[sig] = signal.signal(sig, on_signal)

    def restore_handlers():
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    ck.closers.append(restore_handlers)
