"""A synchronous save that receives real SIGINTs at its first (and second) object write."""

import os
import signal
import sys
import threading

import numpy as np

import forkpoint as fp
from forkpoint.repo import interrupts
from forkpoint.storage.local import LocalStore


def main(url: str, count: int) -> None:
    repo = fp.Repo(url, create=True)
    repo.save({"x": np.zeros(10)}, step=0)
    writes = []
    real, say = LocalStore.write, interrupts._say
    heard = threading.Event()

    def said(text):
        say(text)
        heard.set()

    def write(store, key, parts):
        if key.startswith("objects/"):
            writes.append(key)
            if len(writes) <= count:
                if len(writes) > 1:  # a signal sent before the last was handled would merge with it
                    heard.wait(60)
                os.kill(os.getpid(), signal.SIGINT)
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
    main(sys.argv[1], int(sys.argv[2]))
