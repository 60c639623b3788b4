"""Checkpointer: the object a training loop holds to resume, save on schedule and retain.

`every` is a step count or any object with `should_save(step, last_save_time)` (e.g.
`fp.Seconds(600)`); `keep` is any object with `select(versions, tagged)` (e.g. `fp.Keep`).
"""

import time

from .repo import PendingSave, Repo
from .state import capture
from .state.hooks import CaptureGuard


class Checkpointer:
    """Saves `state` to `repo` on `branch` when the policy says so and restores it on resume."""

    def __init__(self, repo: Repo, state, every=None, keep=None, branch: str = "main",
                 sync: bool = False, allow_pickle: bool = False, gc_grace: float = 600.0):
        if isinstance(every, int) and every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        self.repo, self.state, self.every, self.keep = repo, state, every, keep
        self.branch, self.sync, self.allow_pickle, self.gc_grace = branch, sync, allow_pickle, gc_grace
        self._pending: list[PendingSave] = []
        self._retention = None
        self._guard = CaptureGuard()
        if not sync:
            self._guard.install(obj for _, obj in capture(state)[1])
        self._last_save = time.monotonic()
        self.last_version = None

    def resume(self, strict: bool = True) -> int:
        """Restore the newest version of the branch; return the step to run next (0 if none)."""
        if self.repo.head(self.branch) is None:
            return 0
        version = self.repo.restore(self.state, self.branch, strict=strict,
                                    allow_pickle=self.allow_pickle)
        self.last_version = version
        return 0 if version.step is None else version.step + 1

    def should_save(self, step: int) -> bool:
        """True when the policy asks for a save after `step`."""
        if self.every is None:
            return False
        if isinstance(self.every, int):
            return step % self.every == 0
        return self.every.should_save(step, self._last_save)

    def step(self, step: int, metrics: dict | None = None):
        """Call after each training step; saves (asynchronously by default) when due."""
        if self.should_save(step):
            return self.save(step, metrics)
        return None

    def save(self, step: int | None = None, metrics: dict | None = None, message: str = "",
             sync: bool | None = None):
        """Save now; returns the Version (sync) or a PendingSave."""
        self._reap()
        sync = self.sync if sync is None else sync
        result = self.repo.save(self.state, branch=self.branch, step=step, message=message,
                                metrics=metrics, sync=sync, allow_pickle=self.allow_pickle)
        self._last_save = time.monotonic()
        if sync:
            self.last_version = result
            self._retain()
        else:
            self._guard.add(result.capture_map)
            self._pending.append(result)
        return result

    def wait_capture(self) -> None:
        """Block until saves in flight have copied the state (call before changing it by means
        the hooks cannot see, e.g. in-place edits of parameters outside optimizer.step)."""
        self._guard.wait()

    def _reap(self) -> None:
        done = [p for p in self._pending if p.done()]
        self._pending = [p for p in self._pending if not p.done()]
        for p in done:
            self.last_version = p.wait()
        if done:
            self._retain()

    def _retain(self) -> None:
        """Apply retention on the repository's commit thread, off the training loop."""
        if self._retention is not None and self._retention.done():
            self._retention.result()
            self._retention = None
        if self.keep is not None and self._retention is None:
            self._retention = self.repo.background(self.repo.gc, keep=self.keep,
                                                   branches=[self.branch], grace=self.gc_grace)

    def wait(self):
        """Block until every save in flight is committed and retention applied; return the newest Version."""
        for p in self._pending:
            self.last_version = p.wait()
        had = bool(self._pending)
        self._pending = []
        self._finish_retention()
        if had:
            self._retain()
            self._finish_retention()
        return self.last_version

    def _finish_retention(self) -> None:
        if self._retention is not None:
            future, self._retention = self._retention, None
            future.result()

    def close(self) -> None:
        """Wait for everything in flight and remove the capture hooks."""
        self.wait()
        self._guard.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
