"""Child processes for the tests that, on a timeout, say where they hung.

A child that outlives its time is sent SIGABRT with Python's fault handler on, so every Python
process of its session prints the stack of each of its threads; the error's first line names
the innermost frames of each main thread (CI shows only the summary line of a failure).
Children get one OpenMP thread unless the caller says otherwise: the suite's workers already
fill the cores, and an oversubscribed OpenMP barrier can stall a CPU backward for minutes
(pytorch/pytorch#91547).
"""

import os
import re
import signal
import subprocess

DUMP_WAIT = 10
"""Seconds the children get to print their stacks after SIGABRT."""


class ChildHung(AssertionError):
    """A child process ran past its timeout; the message says where its threads were."""


def run(cmd, timeout: float, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, ...)` that raises
    ChildHung, naming where the child's threads were, when the timeout passes."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=DUMP_WAIT)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)
        raise ChildHung(f"{cmd_text(cmd)} ran past {timeout} s; {where(err)}\n--- stderr ---\n{err[-20000:]}"
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


def cmd_text(cmd) -> str:
    return cmd if isinstance(cmd, str) else " ".join(map(str, cmd))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
