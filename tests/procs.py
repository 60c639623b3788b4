"""Child processes for the tests that, on a timeout, say where they hung.

A child that outlives its time is sent SIGABRT with Python's fault handler on, so every Python
process of its session prints the stack of each of its threads; the error's first line names
the innermost frames of each main thread (CI shows only the summary line of a failure).
Children get one OpenMP thread unless the caller says otherwise: the suite's workers already
fill the cores, and an oversubscribed OpenMP barrier can stall a CPU backward for minutes
(pytorch/pytorch#91547). The error also says how much CPU the child got and how much the
machine's hypervisor stole meanwhile, which tells a child that waited on something from one
that was starved of CPU.
"""

import os
import re
import signal
import subprocess
import time

import psutil

DUMP_WAIT = 10
"""Seconds the children get to print their stacks after SIGABRT."""
RELAY_WAIT = 2
"""Seconds a launcher gets to relay its children's dumps before it is signalled itself."""
CHILD_SECONDS = 600
"""How long a test's child process may run before it counts as hung. Far above what any
child needs on an idle machine: a shared CI machine has run the suite five times slower."""


class ChildHung(AssertionError):
    """A child process ran past its timeout; the message says where its threads were."""


def run(cmd, timeout: float, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, ...)` that raises
    ChildHung, naming where the child's threads were, when the timeout passes."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    before = _machine_ticks()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        load = _load(proc.pid, before, timeout)
        _signal_group(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=DUMP_WAIT)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)
        raise ChildHung(f"{cmd_text(cmd)} ran past {timeout} s ({load}); {where(err)}\n--- stderr ---\n{err[-20000:]}"
                        f"\n--- stdout ---\n{out[-5000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def where(stderr: str) -> str:
    """The innermost frames of each main thread in fault-handler dumps, in one line."""
    found = []
    for block in re.split(r"\n(?=Current thread|Thread 0x)", stderr):
        if not block.startswith("Current thread"):
            continue
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)[:3]
        found.append(" <- ".join(f"{os.path.basename(f)}:{n} {fn}" for f, n, fn in frames))
    return "main threads at: " + " | ".join(found) if found else "no stacks were printed"


def _machine_ticks() -> list[int] | None:
    """The machine's CPU time counters (user, nice, system, idle, iowait, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def _load(pid: int, before: list[int] | None, wall: float) -> str:
    """What the child and the machine did during its `wall` seconds, in words."""
    parts = []
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        parts.append(f"the child used {(int(fields[11]) + int(fields[12])) / ticks:.1f} CPU-s")
    except (OSError, ValueError, IndexError):
        pass
    after = _machine_ticks()
    if before is not None and after is not None:
        spent = [b - a for a, b in zip(before, after)]
        total = sum(spent) or 1
        parts.append(f"the machine was {100 * (total - spent[3] - spent[4]) / total:.0f}% busy, "
                     f"{100 * spent[4] / total:.0f}% waiting on I/O, {100 * spent[7] / total:.0f}% stolen")
    try:
        parts.append("load average " + open("/proc/loadavg").read().split()[0])
    except OSError:
        pass
    return "; ".join(parts) or "no load figures"


def cmd_text(cmd) -> str:
    return cmd if isinstance(cmd, str) else " ".join(map(str, cmd))


def _signal_group(pid: int, sig: int) -> None:
    """Signal the child's session and every descendant of the child (a launcher such as
    mpiexec may start its ranks in sessions of their own)."""
    below = _descendants(pid)
    for target in reversed(below):  # the deepest first, so a launcher still relays their output
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
    if below and sig != signal.SIGKILL:
        time.sleep(RELAY_WAIT)
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, parents before their children (none once it is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
