"""Checkpointer: the object a training loop holds to resume, save on schedule and retain.

`every` is a step count, a policy object with `should_save(step, last_save_time)` (e.g.
`fp.EverySeconds(600)`), or "auto" (`fp.YoungDaly()`); `keep` is any object with
`select(versions, tagged)` (e.g. `fp.Keep`). Layers above this one (the resume audit) extend
a Checkpointer through `EXTENSIONS`.
"""

import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from ..errors import (BranchHeldError, CorruptObjectError, MissingObjectError, ResumeWarning, StateChangedError,
                      StateMismatchError)
from ..policy import EverySteps, YoungDaly, install_preemption
from ..repo import PendingSave, Repo
from ..repo.holders import run_name
from ..repo.records import step_number
from ..state import capture
from ..state.hooks import CaptureGuard
from ..engine.chunksave import UNGUARDED_WRITES, changed_paths
from .ranks import ranks_of
from .retention import BackgroundRetention, resolve_retention

POLICY_NAMES = {"auto": YoungDaly}
EXTENSIONS: list[Callable[["Checkpointer"], None]] = []
REPOSITORY_OVERRIDE: Callable[[Repo, str], tuple[Repo, str]] | None = None
"""Set by `forkpoint audit` in the processes it runs: every Checkpointer then uses the
audit's private repository and branch instead of the script's, before touching either."""
DAMAGE_ERRORS = (CorruptObjectError, MissingObjectError)
RESTART_COUNT_VARIABLES = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


@dataclass
class StopRequest:
    """Ask the loop to save at the next step boundary, then call `then(version)`."""

    reason: str
    then: Callable
    time: float


class _Never:
    def should_save(self, step, last_save_time):
        return False

    def explain(self):
        return "saves only when asked (no interval)"


def resolve_policy(every):
    """Turn `every` (None, int, registered name or policy object) into a policy object."""
    if every is None:
        return _Never()
    if isinstance(every, bool):
        raise TypeError("every must be a step count, a policy or a policy name, not a bool")
    if isinstance(every, int):
        return EverySteps(every)
    if isinstance(every, str):
        if every not in POLICY_NAMES:
            known = ", ".join(f"'{k}'" for k in POLICY_NAMES)
            raise ValueError(f"unknown save policy {every!r}; every= takes a step count, {known}, or a "
                             "policy object such as fp.EverySeconds(600)")
        return POLICY_NAMES[every]()
    if not callable(getattr(every, "should_save", None)):
        raise TypeError(f"every={every!r} is not a step count (an int), a policy name ('auto') or a "
                        "policy object with should_save(step, last_save_time); for seconds give "
                        "fp.EverySeconds(...)")
    return every


class Checkpointer:
    """Saves `state` to `repo` on `branch` when the policy says so and restores it on resume.

    In a torch.distributed run, or over an fp.mpi.Repo, every rank holds a Checkpointer; at
    each step the ranks agree whether to save (any rank's policy being due) and whether to
    stop. With an fp.dist.Repo or fp.mpi.Repo every rank saves its part and rank 0 commits;
    with a plain Repo rank 0 writes the (replicated) state. With `warm`, an
    asynchronous Checkpointer faults in its staging memory at construction, so the first
    checkpoint does not pay for fresh pages. A `state` with a `checkpoint_state()` method
    (such as fp.discover's result) stands for the tree that method returns.
    """

    def __init__(self, repo: Repo, state, every=None, keep=None, branch: str = "main",
                 sync: bool = False, allow_pickle: bool = False, gc_grace: float = 600.0,
                 preemption=True, warm: bool = True, on_conflict: str = "error", take_over: bool = False):
        if not isinstance(repo, Repo) and not isinstance(getattr(repo, "repo", None), Repo):  # fp.dist.Repo wraps one
            raise TypeError(f"Checkpointer needs an fp.Repo, got {type(repo).__name__} {repo!r}: "
                            "pass fp.Repo(path, create=True)")
        if REPOSITORY_OVERRIDE is not None:
            repo, branch = REPOSITORY_OVERRIDE(repo, branch)
        if on_conflict not in ("error", "fork"):
            raise ValueError(f"on_conflict must be 'error' or 'fork', got {on_conflict!r}")
        if callable(getattr(state, "checkpoint_state", None)):  # such as fp.discover's result
            state = state.checkpoint_state()
        keep = resolve_retention(keep)
        self.policy = resolve_policy(every)
        self.ranks = ranks_of(repo)
        self.repo, self.state, self.keep = repo, state, keep
        self.branch, self.sync, self.allow_pickle, self.gc_grace = branch, sync, allow_pickle, gc_grace
        self.preemption = preemption
        self._pending: list[tuple[int | None, PendingSave]] = []  # (step, its save)
        self._capture_at_save = False  # set once a save found its state changed while copying it
        self._guard = CaptureGuard()
        if not sync:
            self._guard.install(obj for _, obj in capture(state)[1])
            if warm:
                repo.warm_staging(state, allow_pickle)
        self._last_save = time.monotonic()
        self._stall_open: float | None = None
        self._waited_mark = 0.0
        self.stop_request: StopRequest | None = None
        self.restart_meta: dict = {}
        self.last_version = None
        self.last_step: int | None = None
        self._saved_step: int | None = None  # the step of the newest save() call
        self._step_floor: tuple[int, str] | None = None  # (the lowest step expected next, why)
        self._order_checked = self._order_warned = False
        self.finished = False
        self.save_seconds: list[float] = []
        self.closers: list[Callable[[], None]] = []
        self.on_remote_stop: Callable = lambda version: None
        self.closed = False
        self.branch = self._hold_branch(on_conflict, take_over)
        applies = not (getattr(repo, "collective", False) and self.ranks.rank != 0)  # rank 0 prunes a collective repo
        self.retention = BackgroundRetention(repo, keep if applies else None, self.branch, gc_grace)
        install_preemption(self)
        for extend in EXTENSIONS:
            extend(self)

    def _hold_branch(self, on_conflict: str, take_over: bool) -> str:
        """Hold the branch for this run (rank 0 decides, every rank learns the outcome); with
        on_conflict="fork", a branch held by a live run is forked for this run instead."""
        rank = self.ranks.rank
        branch, refusal = self.branch, None
        if rank == 0:
            try:
                self.repo.hold_branch(branch, take_over=take_over)
            except BranchHeldError as e:
                if on_conflict != "fork":
                    refusal = str(e)
                else:
                    branch = self._fork_for_this_run(str(e))
        branch, refusal = self.ranks.broadcast((branch, refusal))
        if refusal is not None:
            raise BranchHeldError(refusal if rank == 0 else f"rank 0: {refusal}")
        return branch

    def _fork_for_this_run(self, why: str) -> str:
        """Fork the held branch's head to a branch named after this run, hold it, say so."""
        name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.branch}-{run_name()}")[:128]
        head = self.repo.head(self.branch)
        if self.repo.head(name) is None and head is not None:
            self.repo.fork(head, name)
        self.repo.hold_branch(name)
        warnings.warn(f"{why.split(': two runs')[0]}; this run continues on branch {name!r}"
                      + (f", forked from {head[:12]}" if head else ""), ResumeWarning, stacklevel=4)
        return name

    # ----------------------------------------------------------------- resume
    def resume(self, strict: bool = True, fall_back: bool = True) -> int:
        """Restore the newest intact version of the branch; return the next step (0 if none).

        Every byte restored is checked against its hash. A version whose objects are damaged
        or missing is skipped for the next older one with a ResumeWarning naming what was
        skipped and why (fall_back=False raises instead); `strict` is restore's key check.
        A branch that close(final_step=...) finished says so (ResumeWarning, `finished`).
        Nodes of an fp.dist.Repo that lost their replicated tier 0 first get their part back
        from peers (fp.dist.Repo.recover). Flushes a killed process left undone are finished in the background (Repo.finish_flushes:
        by every rank of an fp.dist.Repo, where it is collective; by rank 0 of a plain Repo).

        Later versions record the restart count (SLURM / torchelastic) and the wall time since
        the restored version was written (work lost plus time spent waiting to restart).
        """
        if hasattr(self.repo, "recover"):  # collective: nodes lost and replaced get their part back
            self.repo.recover(self.branch)
        if getattr(self.repo, "collective", False) or self.ranks.rank == 0:
            self.repo.finish_flushes()
        self._order_checked = True
        if self.repo.head(self.branch) is None:
            return 0
        version = self._restore_newest_intact(strict, fall_back)
        self.last_version = version
        if version.step is not None:
            self._step_floor = (version.step + 1, f"resume() restored step {version.step} (and returned "
                                f"{version.step + 1}): start the loop at the step resume() returns, "
                                "`for step in range(ck.resume(), ...)`")
        count = next((int(os.environ[v]) for v in RESTART_COUNT_VARIABLES if os.environ.get(v, "").isdigit()),
                     None)
        if version.branch != self.branch:
            # The branch was forked from this version (by hand or on_conflict="fork"): it
            # continues another line, which is not a restart of this one.
            self.restart_meta = {"forked_from": version.id}
        else:
            restarts = int(version.meta.get("restarts", 0)) + 1 if isinstance(version.meta, dict) else 1
            self.restart_meta = {"restarts": restarts if count is None else count,
                                 "resumed_from": version.id,
                                 "lost_seconds": round(max(0.0, time.time() - version.time), 3)}
        self.finished = isinstance(version.meta, dict) and version.meta.get("final") is True
        if self.finished and self.ranks.rank == 0:
            warnings.warn(f"branch {self.branch!r} finished at step {version.step} (version {version.id[:12]}, "
                          "saved by close(final_step=...)): nothing left to train; resume returns the step after "
                          "it. Fork the branch or save on another one to train further", ResumeWarning, stacklevel=2)
        return 0 if version.step is None else version.step + 1

    def _restore_newest_intact(self, strict: bool, fall_back: bool):
        """Restore the branch head, or with `fall_back` the newest first-parent ancestor whose
        bytes are all intact; every rank of a distributed run takes the same version."""
        skipped = []

        def newest_first():
            # The whole history is read only when the head turns out damaged.
            yield self.repo.version(self.branch)
            yield from self.repo.log(self.branch)[1:]

        for v in newest_first():
            if v.pruned:
                continue
            try:
                version, damage = self.repo.restore(self.state, v.id, strict=strict,
                                                    allow_pickle=self.allow_pickle), None
            except DAMAGE_ERRORS as e:
                if not fall_back:
                    raise
                version, damage = None, e
            except StateMismatchError as e:
                raise StateMismatchError(
                    f"resume of branch {self.branch!r}: {e}\n  the branch holds a run whose state differs from this "
                    f"one: to start a new run with it, save on another branch (fp.Checkpointer(..., branch='...')); "
                    f"to carry parts over, repo.restore(state, {self.branch!r}, paths=[...]) first, or, where only "
                    "entries are missing or extra, resume(strict=False)") from None
            if self.ranks.agree(damage is not None)[0]:
                skipped.append((v, damage))
                continue
            break
        else:
            reasons = "; ".join(f"{v.id[:12]} (step {v.step}): {_damage(e)}" for v, e in skipped)
            raise CorruptObjectError(f"no version of branch {self.branch!r} could be restored intact: {reasons}. "
                                     f"Run `forkpoint verify -r {self.repo.url}`; to start over, rebuild the model and "
                                     "optimizer (their tensors may hold part of a damaged version), then delete the "
                                     f"branch (`forkpoint branch delete {self.branch}`) or use another one")
        if skipped and self.ranks.rank == 0:
            what = "; ".join(f"{v.id[:12]} (step {v.step}): {_damage(e)}" for v, e in skipped)
            warnings.warn(f"resumed branch {self.branch!r} from {version.id[:12]} (step {version.step}), skipping "
                          f"{len(skipped)} newer damaged version(s): {what}. The branch still names the damaged "
                          f"head: `forkpoint branch reset {self.branch} {version.id[:12]}` moves it back, "
                          "`forkpoint verify` lists what is damaged", ResumeWarning, stacklevel=3)
        return version

    # ----------------------------------------------------------------- the loop
    def should_save(self, step: int) -> bool:
        """True when the policy asks for a save after `step`."""
        return self.policy.should_save(step, self._last_save)

    def request_stop(self, reason: str, then: Callable) -> None:
        """Save at the next step boundary (on every rank's agreement), then call then(version)."""
        if self.stop_request is None:
            self.stop_request = StopRequest(reason, then, time.time())

    def step(self, step: int, metrics: dict | None = None):
        """Call after each training step; saves (asynchronously by default) when due."""
        self._check_open()
        step = step_number(step)
        if step is None:
            raise TypeError("Checkpointer.step needs the step number (an int), got None")
        self._check_order(step)
        self.last_step = step
        self._observe_stall()
        due, stop = self.ranks.agree(self.should_save(step), self.stop_request is not None)
        if stop:
            request = self.stop_request or StopRequest("stop requested on another rank",
                                                       self.on_remote_stop, time.time())
            version = self.save(step, metrics, message=f"emergency: {request.reason}", sync=True,
                                meta={"reason": request.reason})
            self.wait()
            request.then(version)
            self.stop_request = None
            return version
        if due:
            return self.save(step, metrics)
        return None

    def _check_order(self, step: int) -> None:
        """Warn once (ResumeWarning, on rank 0) when `step` is below the step the run had reached:
        the loop ignored the step resume() returned, a branch was continued without resume(), or
        steps went backwards; the branch's history would then repeat steps it holds."""
        if not self._order_checked:  # the first step of a run that did not resume
            self._order_checked = True
            head = self.repo.version(self.branch) if self.repo.head(self.branch) is not None else None
            if head is not None and head.step is not None:
                self._step_floor = (head.step + 1, f"branch {self.branch!r} already holds step {head.step} "
                                    f"(version {head.id[:12]}) and was not resumed: call resume() first to "
                                    "continue it, or save on another branch (branch='...')")
        if self._order_warned:
            return
        floor = self._step_floor
        if floor is not None and step < floor[0]:
            self._order_warned = True
            if self.ranks.rank == 0:
                warnings.warn(f"Checkpointer.step({step}) on branch {self.branch!r} goes back to steps the run "
                              f"already passed, which its versions would repeat: {floor[1]}", ResumeWarning,
                              stacklevel=3)
            return
        self._step_floor = (step, f"step({step}) came before it; pass the global step number")

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this Checkpointer of branch {self.branch!r} is closed (its capture hooks are "
                               "gone, so a save could capture torn tensors): make a new one to save again")

    # ----------------------------------------------------------------- saving
    def save(self, step: int | None = None, metrics: dict | None = None, message: str = "",
             sync: bool | None = None, meta: dict | None = None):
        """Save now; returns the Version (sync) or a PendingSave (None on ranks other than 0
        unless the repository is an fp.dist.Repo)."""
        self._check_open()
        self._reap()
        self._observe_stall()
        self._saved_step = step if step is not None else self.last_step
        sync = self.sync if sync is None else sync
        rank = self.ranks.rank
        start = time.perf_counter()
        result = None
        collective = getattr(self.repo, "collective", False)
        if rank == 0 or collective:
            result = self.repo.save(self.state, branch=self.branch, step=step, message=message,
                                    metrics=metrics, sync=sync, allow_pickle=self.allow_pickle,
                                    meta={**self.restart_meta, **(meta or {})})
        if sync and not collective:
            self.ranks.barrier()
        if result is not None and not sync:
            self._guard.add(result.capture_map)
            self._pending.append((step, result))
            if self._capture_at_save:
                result.wait_capture()
            else:  # numpy arrays count no writes, so a later write to one could not be seen: copy them now
                result.wait_unwatched_capture()
        elapsed = time.perf_counter() - start
        self._last_save = time.monotonic()
        if result is None:
            return None
        self._note_stall(elapsed)
        if sync:
            self.save_seconds.append(elapsed)
            self.last_version = result
            self._observe_stall()
            self.retention.committed()
        return result

    def _note_stall(self, seconds: float) -> None:
        self._stall_open = seconds
        self._waited_mark = self._guard.waited

    def _observe_stall(self) -> None:
        """Report the stall of the previous save (call time + hook waits since) to the policy."""
        if self._stall_open is None:
            return
        stall = self._stall_open + (self._guard.waited - self._waited_mark)
        self._stall_open = None
        observe = getattr(self.policy, "observe", None)
        if observe is not None:
            observe(stall)

    def wait_capture(self) -> None:
        """Block until saves in flight have copied the state (call before changing it by means
        the hooks cannot see, e.g. in-place edits of parameters outside optimizer.step)."""
        self._guard.wait()

    def _reap(self) -> None:
        done = [(step, p) for step, p in self._pending if p.done()]
        self._pending = [(step, p) for step, p in self._pending if not p.done()]
        for step, p in done:
            self._settle(step, p)
        if done:
            self.retention.committed()

    def _settle(self, step, p: PendingSave) -> None:
        """Take the outcome of the save of `step`. One whose state changed while it was being
        copied was not committed: warn, and from then on make save() wait for its copies."""
        try:
            self.last_version = p.wait()
        except StateChangedError as e:
            if not self._capture_at_save:
                warnings.warn(f"the save of step {step} on branch {self.branch!r} was not committed: "
                              f"{changed_paths(e.paths)} changed while it was being copied. {UNGUARDED_WRITES} "
                              "From now on this Checkpointer copies the state before save() and step() return "
                              "(a longer stall; no version holds a later state). To keep saves asynchronous, "
                              "call ck.wait_capture() before such writes", UserWarning, stacklevel=5)
            self._capture_at_save = True

    def wait(self):
        """Block until every save in flight is committed and retention applied; return the newest Version."""
        for step, p in self._pending:
            self._settle(step, p)
            self.retention.committed(start=False)
        self._pending = []
        self.retention.settle()
        return self.last_version

    def close(self, final_step: int | None = None, metrics: dict | None = None) -> None:
        """Wait for everything in flight; remove hooks and handlers; release the branch.
        Saving afterwards raises.
        With `final_step` (the last step the loop ran), that step is saved first unless it was
        already, and its version is marked final, so a rerun of the finished script resumes
        past it and says the run is finished instead of training again. Without it, steps
        trained after the newest save get one UserWarning saying how to keep them."""
        self._close(final_step, metrics, warn_unsaved=True)

    def _close(self, final_step, metrics, warn_unsaved: bool) -> None:
        if warn_unsaved and final_step is None and not self.closed and self.ranks.rank == 0:
            self._warn_unsaved()
        if final_step is not None and not self.closed:
            last = self.wait()
            if last is None or last.step != final_step or not last.meta.get("final"):
                self.save(final_step, metrics, message="final", sync=True, meta={"final": True})
        was_closed, self.closed = self.closed, True
        self.wait()
        if not was_closed and self.ranks.rank == 0:
            self.repo.release_branch(self.branch)
        self._guard.remove()
        for close in self.closers:
            close()
        self.closers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close(None, None, warn_unsaved=exc[0] is None)  # a loop that raised is not done training

    def _warn_unsaved(self) -> None:
        last, saved = self.last_step, self._saved_step
        if last is None or (saved is not None and saved >= last):
            return
        since = f"after its newest save (step {saved})" if saved is not None else "without a save"
        first = saved + 1 if saved is not None else None
        steps = f"step {last}" if first == last else f"steps {first}..{last}" if first is not None else \
            f"steps up to {last}"
        warnings.warn(f"closing the Checkpointer of branch {self.branch!r} with {steps} trained {since}: no version "
                      f"holds them. Pass ck.close(final_step={last}) to save the last step (and mark the run "
                      f"finished), or call ck.save({last}) before close()", UserWarning, stacklevel=4)


def _damage(error: Exception | None) -> str:
    """What made a version unrestorable, in one line (None: another rank found it damaged)."""
    return str(error).splitlines()[0] if error else "damaged on another rank"
