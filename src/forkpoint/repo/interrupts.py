"""Ctrl-C during a synchronous save: the first finishes it, a second aborts it.

A save interrupted half-way would leave objects and temp files behind and, worse, a user
who saw a traceback would not know whether the version was committed. While a save runs
in the main thread, the first SIGINT only says, in one line, that the save is finishing;
the save commits and KeyboardInterrupt is raised after it. A second SIGINT aborts the save:
nothing is committed, the writes in flight end (no temp file stays) and KeyboardInterrupt
is raised; one that comes once the commit has begun says the save committed after all.
A caller's own SIGINT handler is left alone.
"""

import contextlib
import signal
import sys
import threading
from typing import Callable


def _say(text: str) -> None:
    print(f"forkpoint: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def finishing_on_first_interrupt(what: str, abort: Callable[[], str | None]):
    """Run the block (which waits for `what`) with the rule above; `abort()` stops `what`
    and returns once its writes have ended: None, or how `what` ended when it was too late.
    Yields a list the block appends its outcome to (a description for the line said after a
    deferred interrupt)."""
    outcome: list[str] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield outcome
        return
    interrupted = []

    def on_interrupt(signum, frame):
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(True)
        _say(f"interrupted: finishing {what} first (Ctrl-C again aborts it)")

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield outcome
    except KeyboardInterrupt:
        _say(f"aborting {what}")
        committed = abort()
        if committed:  # the second Ctrl-C came once the commit had begun: say what is true
            _say(f"{what} could not be aborted, it had reached its commit: {committed}")
        else:
            _say(f"{what} aborted: nothing committed, no temporary file left")
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        _say(f"{what} finished{': ' + outcome[0] if outcome else ''}; stopping for the interrupt")
        raise KeyboardInterrupt
