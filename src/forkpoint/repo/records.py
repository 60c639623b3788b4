"""Records the repository returns: diffs, divergences, reports, pending saves."""

import collections.abc
import json
import math
import operator
import os
import socket
import sys
from dataclasses import dataclass, field

import numpy as np

from .._version import __version__
from ..engine.scheduler import Task
from ..format.manifest import Version
from ..format.refs import check_name


@dataclass
class LeafDiff:
    """How one path differs between two versions."""

    path: str
    status: str
    detail: str = ""
    max_abs: float | None = None
    rel_l2: float | None = None


@dataclass
class Divergence:
    """The earliest step at which two branches' states differ beyond tolerance."""

    step: int
    version_a: str
    version_b: str
    paths: list[str]
    max_abs: float | None


@dataclass
class VerifyReport:
    """What `verify` checked and the problems it found (empty when all is well)."""

    versions: int = 0
    objects: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcReport:
    """What `gc` removed (or would remove, on a dry run)."""

    pruned_versions: list[str] = field(default_factory=list)
    deleted_objects: int = 0
    freed_bytes: int = 0
    deleted_manifests: int = 0
    deleted_temp: int = 0
    dry_run: bool = False
    scan_cpu_seconds: float = 0.0
    """CPU time of the pass but for writing the stubs of pruned versions and deleting objects
    (the part that grows with the history rather than with what it prunes)."""
    others_writing: list[str] = field(default_factory=list)
    """Tiers where another process's writer lease was younger than the grace period, so
    unreferenced objects and manifests younger than it were kept."""
    kept_young: int = 0
    """Unreferenced objects and temp files kept because they were younger than the grace
    period (or, where no other process writes, than a few seconds): a save may be using them."""
    left_alone: list[str] = field(default_factory=list)
    """Files under objects/ whose names are not objects' (an editor's backup, an NFS `.nfs`
    file of a deleted object still open somewhere): never deleted, never read."""


@dataclass
class CompactReport:
    """What `compact` did: versions looked at, objects it examined (those a tier holds),
    objects it rewrote encoded, bytes that saved, and damaged objects it left alone."""

    versions: int = 0
    objects: int = 0
    encoded: int = 0
    saved_bytes: int = 0
    problems: list[str] = field(default_factory=list)


class PendingSave:
    """A save running in the background: `done()`, `wait(timeout)` -> Version.

    `captured()` tells whether every tensor has been copied out of live memory;
    `wait_capture()` blocks until then (after which the state may be changed freely);
    `wait_unwatched_capture()` only until the leaves whose in-place writes nothing counts
    (numpy arrays, inference tensors) are copied.
    """

    def __init__(self, commit: Task, captures: list[Task], by_pointer: dict[int, list[Task]],
                 unwatched: list[Task] = ()):
        self._commit = commit
        self._captures = captures
        self._unwatched = list(unwatched)
        self.capture_map = by_pointer

    def done(self) -> bool:
        return self._commit.done()

    def wait(self, timeout: float | None = None) -> Version:
        return self._commit.result(timeout)

    def captured(self) -> bool:
        return all(t.done() for t in self._captures)

    def wait_capture(self) -> None:
        for t in self._captures:
            t.result()

    def wait_unwatched_capture(self) -> None:
        for t in self._unwatched:
            t.result()


def environment() -> dict:
    env = {"forkpoint": __version__, "python": sys.version.split()[0], "numpy": np.__version__,
           "hostname": socket.gethostname(), "pid": os.getpid(),
           "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            env["world_size"] = dist.get_world_size()
    return env


def save_fields(branch, step, message, metrics, meta) -> tuple:
    """The checked (step, message, metrics, meta) of a save to `branch`: TypeError or
    ValueError naming the field that is not what a version records."""
    check_name(branch, "branch")
    if not isinstance(message, str):
        raise TypeError(f"message must be a str, got {type(message).__name__} {message!r}")
    return step_number(step), message, _json_safe(metrics or {}, "metrics"), _json_safe(meta or {}, "meta")


def step_number(step) -> int | None:
    """`step` as an int (numpy and torch integer scalars included), or None; anything else
    (a str, a float, a bool) raises TypeError, since resume and retention count on it."""
    if step is None:
        return None
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise TypeError(f"step must be an int or None, got {type(step).__name__} {step!r}")


def _json_safe(d: dict, what: str) -> dict:
    """`d` as plain JSON data: tensor and numpy scalars become numbers, and non-finite floats
    (a diverged loss, Lightning's inf score) the strings "nan", "inf" and "-inf", which JSON can
    hold and which never rank as a best metric. TypeError names the entry that is not."""
    if not isinstance(d, collections.abc.Mapping):
        raise TypeError(f"{what} must be a dict, got {type(d).__name__} {d!r}")
    try:
        return json.loads(json.dumps(_finite(d, what), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON data (numbers, str, bool, None, lists, dicts): {e}") from None


def _finite(x, where: str):
    if isinstance(x, dict):
        return {k: _finite(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if not isinstance(x, (str, int, float, type(None))):
        count = x.numel() if callable(getattr(x, "numel", None)) else getattr(x, "size", 1)
        if not hasattr(x, "item") or count != 1:
            kind = f"{type(x).__module__}.{type(x).__name__}".removeprefix("builtins.")
            raise TypeError(f"{where} is of type {kind}, not JSON data"
                            + (" (an array: pass .tolist() for a few values, or save it in the state)"
                               if hasattr(x, "tolist") else ""))
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x
