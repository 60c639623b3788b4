"""Retention as a running Checkpointer applies it: after commits, off the training loop, at a
bounded share of a core, with a warning when `Keep(best=...)` ranks by a metric no version
records."""

import time
import warnings

from ..policy import Keep

RETENTION_SHARE = 0.1
"""A gc pass walks the whole history, so in a long run of frequent saves retention runs after
some commits only: after a pass whose scan took c seconds of CPU (GcReport.scan_cpu_seconds),
the next starts no sooner than c * (1 / share - 1) seconds later. What a pass spends pruning
(a stub per version, as many as commits since the last pass) is not counted, so retention
never lags further and further behind."""


def resolve_retention(keep):
    """Turn `keep` (None, an int: the newest versions kept, or an object with
    `select(versions, tagged)`) into a retention policy or None."""
    if keep is None or callable(getattr(keep, "select", None)):
        return keep
    if isinstance(keep, int) and not isinstance(keep, bool):
        return Keep(last=keep)
    raise TypeError(f"keep must be fp.Keep(...) or an int (the newest versions kept), got {keep!r}")


class BackgroundRetention:
    """Applies `keep` to `branch` of `repo` in gc passes on the repository's commit thread:
    `committed()` after each commit, `settle()` to apply it to everything committed so far."""

    def __init__(self, repo, keep, branch: str, grace: float):
        self.repo, self.keep, self.branch, self.grace = repo, keep, branch, grace
        self._task = None
        self._unapplied = False  # commits since the last pass began
        self._best_checked = False  # whether the Keep(best=...) metric was looked for
        self._seconds = 0.0
        self._end = 0.0

    def committed(self, start: bool = True) -> None:
        """A version was committed: with `start`, start a pass unless the last ended too
        recently for RETENTION_SHARE (a pass that failed raises here)."""
        self._unapplied = True
        if start:
            self._start()

    def settle(self) -> None:
        """Wait for the pass in flight, then run one more over what committed after it began."""
        self._finish()
        if self._unapplied:
            self._start(final=True)
            self._finish()

    def _start(self, final: bool = False) -> None:
        if self._task is not None and self._task.done():
            self._task.result()
            self._task = None
        if self.keep is None or self._task is not None:
            return
        rest = self._seconds * (1 / RETENTION_SHARE - 1)
        if final or time.monotonic() - self._end >= rest:
            self._unapplied = False
            self._task = self.repo.background(self._timed_pass)

    def _finish(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.result()

    def _timed_pass(self):
        try:
            report = self.repo.gc(keep=self.keep, branches=[self.branch], grace=self.grace)
            self._seconds = report.scan_cpu_seconds
            if report.pruned_versions and self.keep.best and not self._best_checked:
                self._best_checked = True  # once recorded, always: the records stay in the log
                self._warn_best_unrecorded(len(report.pruned_versions))
            return report
        finally:
            self._end = time.monotonic()

    def _warn_best_unrecorded(self, pruned: int) -> None:
        """Warn once when retention prunes while no version of the branch records the metric
        that Keep(best=...) ranks by (a misspelt name keeps no best version at all)."""
        name = self.keep.best[0]
        log = self.repo.log(self.branch)
        if any(isinstance(v.metrics.get(name), (int, float)) for v in log):
            return
        recorded = sorted({k for v in log for k in v.metrics})
        warnings.warn(f"retention of branch {self.branch!r} pruned {pruned} version(s), and none is kept as best: "
                      f"keep=fp.Keep(best=({name!r}, ...)) ranks versions by {name!r}, which no version records "
                      f"(they record: {', '.join(recorded) or 'no metrics'}). Pass it to step(metrics=...) or save(), "
                      "or name a recorded metric", UserWarning, stacklevel=2)
