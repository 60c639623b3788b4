"""Lazy capture guards: block a mutation only while its tensors are still being captured.

A save registers, for the memory address of each live tensor it has not copied yet, the
tasks that copy it. Hooks on optimizers (before `step`) and on modules that own buffers
(before `forward`) wait for exactly what they are about to overwrite; for a device tensor
they only order its copy before the device work they launch.
"""

import threading
import time

from ..errors import StateChangedError
from .stateful import is_module


def _pointer(t) -> int:
    return t.data_ptr() if t.numel() else 0


class CaptureGuard:
    """Tracks captures in flight by data pointer and waits for them on demand. A save of many
    small leaves registers one pack capture for thousands of pointers, so the guard keeps the
    distinct tasks apart: a wait or check costs per task, not per tensor."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_ptr: dict[int, list] = {}
        self._tasks: dict[int, object] = {}
        self._handles = []
        self.waited = 0.0

    def add(self, by_ptr: dict[int, list]) -> None:
        """Register tasks (objects with `.result()` and `.done()`) per data pointer."""
        with self._lock:
            for ptr, tasks in by_ptr.items():
                self._by_ptr.setdefault(ptr, []).extend(tasks)
                for t in tasks:
                    self._tasks[id(t)] = t

    def pending(self) -> bool:
        """True while any registered capture is unfinished."""
        with self._lock:
            live = {k: t for k, t in self._tasks.items() if not t.done()}
            if len(live) != len(self._tasks):  # some finished: drop them from the map too
                self._tasks = live
                self._by_ptr = {p: kept for p, ts in self._by_ptr.items()
                                if (kept := [t for t in ts if id(t) in live])} if live else {}
            return bool(live)

    def wait(self, tensors=None, on_device: bool = False) -> None:
        """Wait for the captures of `tensors` (all captures when None); raise a capture's error
        (but StateChangedError: the save it fails is reported where it is collected).
        With `on_device`, a device-to-host copy is only ordered before the work queued next on
        its device's current stream (what a hook about to launch that work needs): the host
        does not block."""
        if not self._tasks:
            return
        with self._lock:
            if tensors is None:
                tasks = list(self._tasks.values())
            else:
                tasks = list({id(t): t for x in tensors for t in self._by_ptr.get(_pointer(x), ())}.values())
        if on_device:
            for t in tasks:
                if hasattr(t, "order"):
                    t.order()
            tasks = [t for t in tasks if not hasattr(t, "order")]
        blocked = any(not t.done() for t in tasks)
        start = time.perf_counter()
        for t in tasks:
            try:
                t.result()
            except StateChangedError:  # that save is lost, not this step: its owner reports it
                pass
        if blocked:
            self.waited += time.perf_counter() - start
        self.pending()

    def install(self, objects) -> None:
        """Hook optimizers (wait for all captures before step) and buffer-owning modules, also
        those held by a provider such as fp.dist.TrainState (one attribute level down)."""
        import torch

        objects = list(objects)
        for obj in list(objects):
            if not isinstance(obj, torch.optim.Optimizer) and not is_module(obj) and hasattr(obj, "__dict__"):
                objects.extend(v for v in vars(obj).values()
                               if isinstance(v, torch.optim.Optimizer) or is_module(v))
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer):
                self._handles.append(obj.register_step_pre_hook(lambda *_: self.wait(on_device=True)))
            elif is_module(obj):
                for mod in obj.modules():
                    if any(True for _ in mod.buffers(recurse=False)):
                        self._handles.append(mod.register_forward_pre_hook(
                            lambda m, _args: self.wait(list(m.buffers(recurse=False)), on_device=True)))

    def remove(self) -> None:
        """Remove every hook this guard installed."""
        for h in self._handles:
            h.remove()
        self._handles = []
