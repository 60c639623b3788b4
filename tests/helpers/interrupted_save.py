"""A synchronous save that receives real SIGINTs at its first (and second) object write, or
("late") at its first object write and once its commit has begun."""

import os
import signal
import sys
import threading

import numpy as np

import forkpoint as fp
from forkpoint.repo import interrupts
from forkpoint.storage.local import LocalStore


def main(url: str, count: int, late: bool) -> None:
    # as in a terminal: a suite started in the background by a shell inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    repo = fp.Repo(url, create=True)
    repo.save({"x": np.zeros(10)}, step=0)
    writes = []
    real, say = LocalStore.write, interrupts._say
    heard, aborting = threading.Event(), threading.Event()

    def said(text):
        say(text)
        heard.set()
        if text.startswith("aborting"):
            aborting.set()

    def write(store, key, parts):
        if late and key.startswith("versions/") and len(writes) > 1:
            heard.wait(60)
            os.kill(os.getpid(), signal.SIGINT)
            aborting.wait(60)  # the commit goes on only once the abort has been asked for
        elif key.startswith("objects/"):
            writes.append(key)
            if len(writes) <= count:
                if len(writes) > 1:  # a signal sent before the last was handled would merge with it
                    heard.wait(60)
                os.kill(os.getpid(), signal.SIGINT)
            if count > 1 and len(writes) >= count:
                # the save must not reach its commit before the main thread has handled the
                # second interrupt, however slowly it is scheduled
                aborting.wait(60)
        return real(store, key, parts)

    interrupts._say = said

    LocalStore.write = write
    state = {f"w{i}": np.random.default_rng(i).standard_normal(1 << 20) for i in range(16)}
    try:
        repo.save(state, step=1)
    except KeyboardInterrupt:
        print("stopped by the interrupt", flush=True)
        sys.exit(130)
    print("not interrupted", flush=True)


if __name__ == "__main__":
    late = sys.argv[2] == "late"
    main(sys.argv[1], 1 if late else int(sys.argv[2]), late)
