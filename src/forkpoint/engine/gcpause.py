"""Pausing Python's cyclic garbage collector around the bounded, allocation-heavy phases of a
save (flattening a state, assembling and sealing its manifest).

A save of a state with many leaves builds several objects per leaf that live until the save
ends; the collector, seeing them survive, runs full collections over every object the process
holds, which can take a large share of such a save. Reference counting still frees memory
while it is paused; only cycles wait for the phase to end.
"""

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def gc_paused():
    """Run the block with the cyclic collector off; it is turned back on when the last block
    running in any thread ends, if it was on when the first began."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
