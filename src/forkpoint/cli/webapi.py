"""The JSON answers of `forkpoint ui`: pure reads of a Repo, each a plain-data dict.

Every ref a client sends goes through the repository's own resolver (branch, tag, version
id, `ref~N`), so a request can only name versions; an unknown one raises NotFound.
"""

import math
import threading
from dataclasses import asdict

from ..errors import ForkpointError, RefNotFoundError
from ..format.manifest import Version
from ..repo import Repo
from .graph import lay_out

MAX_PAGE = 1000


class NotFound(Exception):
    """The request names something the repository does not have (HTTP 404)."""


class BadRequest(Exception):
    """The request is malformed (HTTP 400)."""


def _finite(x):
    """Metrics as JSON numbers where finite (JSON has no NaN); others as their text."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def kinds(v: Version) -> list[str]:
    """What is special about a version, for marks on the page."""
    meta = v.meta if isinstance(v.meta, dict) else {}
    out = []
    if v.pruned:
        out.append("pruned")
    if v.message.startswith("emergency:") or meta.get("reason"):
        out.append("emergency")
    parent = v.parents[0] if v.parents else None
    if meta.get("restarts") and meta.get("resumed_from") == parent:  # the first save after a restart
        out.append("restart")
    if meta.get("forked_from") and meta.get("forked_from") == parent:  # the first save of a fork's run
        out.append("fork")
    if meta.get("final") is True:
        out.append("final")
    return out


class LineageView:
    """Every version a branch or tag reaches, in graph order with a lane each, rebuilt only
    when the refs change (a page of a 10,000-version repository reads no record again)."""

    def __init__(self, repo: Repo):
        self.repo = repo
        self._lock = threading.Lock()
        self._key = None
        self._rows: list[dict] = []
        self._index: dict[str, int] = {}

    def rows(self) -> list[dict]:
        heads, tags = self.repo.branches(), self.repo.tags()
        key = (tuple(sorted(heads.items())), tuple(sorted(tags.items())))
        with self._lock:
            if key != self._key:
                self._rows = _layout(self.repo, heads, tags)
                self._index = {row["id"]: i for i, row in enumerate(self._rows)}
                self._key = key
            return self._rows

    def page(self, offset: int, limit: int) -> dict:
        rows = self.rows()
        return {"total": len(rows), "offset": offset, "versions": rows[offset:offset + limit],
                "lanes": max((r["lane"] for r in rows), default=-1) + 1}


def reachable(repo: Repo, names) -> dict[str, Version]:
    """Every version the branches and tags `names` reach through first parents, by id."""
    seen: dict[str, Version] = {}
    for name in names:
        for v in repo.log(name):
            if v.id in seen:
                break
            seen[v.id] = v
    return seen


def _layout(repo: Repo, heads: dict, tags: dict) -> list[dict]:
    seen = reachable(repo, [*heads, *tags])
    rows = []
    for row in lay_out(list(seen.values())):
        v = row.version
        rows.append({"id": v.id, "parent": v.parents[0] if v.parents and v.parents[0] in seen else None,
                     "lane": row.column, "branch": v.branch, "step": v.step, "time": v.time, "message": v.message,
                     "metrics": {k: _finite(x) for k, x in v.metrics.items()},
                     "heads": sorted(b for b, vid in heads.items() if vid == v.id),
                     "tags": sorted(t for t, vid in tags.items() if vid == v.id), "kinds": kinds(v)})
    return rows


def resolve(repo: Repo, ref: str) -> str:
    """The version id `ref` names; NotFound when it names none."""
    if not isinstance(ref, str) or not ref or len(ref) > 300:
        raise NotFound(f"no branch, tag or version {str(ref)[:60]!r}")
    try:
        return repo.resolve(ref)
    except (RefNotFoundError, ValueError, ForkpointError) as e:
        raise NotFound(str(e).splitlines()[0]) from None


def version_detail(repo: Repo, ref: str) -> dict:
    vid = resolve(repo, ref)
    m = repo.manifest(vid)
    v = m.version
    codecs = repo.stored_codecs(vid) if not v.pruned else {}
    leaves = [{"path": leaf.path, "dtype": leaf.dtype, "shape": leaf.shape, "nbytes": leaf.nbytes,
               "codecs": sorted({codecs.get(c.object, c.codec) for c in leaf.chunks})} for leaf in m.leaves]
    held = set(repo.where(vid))
    summary = asdict(v)
    summary["metrics"] = {k: _finite(x) for k, x in v.metrics.items()}
    return {**summary, "kinds": kinds(v), "leaves": leaves,
            "tiers": [{"url": t["url"], "holds": t["url"] in held} for t in v.tiers] or
                     [{"url": s.url, "holds": s.url in held} for s in repo.stores]}


def diff(repo: Repo, a: str, b: str) -> dict:
    va, vb = resolve(repo, a), resolve(repo, b)
    return {"a": va, "b": vb, "leaves": [{k: _finite(x) for k, x in asdict(d).items()} for d in repo.diff(va, vb)]}


def divergence(repo: Repo, a: str, b: str, atol: float) -> dict:
    for name in (a, b):
        if name not in repo.branches():
            raise NotFound(f"no branch {name[:60]!r}")
    found = repo.first_divergence(a, b, atol=atol)
    return {"a": a, "b": b, "atol": atol, "divergence": None if found is None else
            {**asdict(found), "max_abs": _finite(found.max_abs)}}


def metric_series(repo: Repo, metric: str) -> dict:
    """Per branch, the (step, value) points of `metric` along its first-parent chain, oldest
    first, and the step where it left the branch it was forked from (None for a root line)."""
    out = {}
    for name in repo.branches():
        chain = repo.log(name)
        points = [[v.step, _finite(v.metrics[metric])] for v in reversed(chain)
                  if v.step is not None and metric in v.metrics]
        fork = next((v for v in chain if v.branch != name), None)
        out[name] = {"points": points, "fork": None if fork is None else {"step": fork.step, "from": fork.branch,
                                                                        "id": fork.id}}
    return {"metric": metric, "branches": out}


def metric_names(repo: Repo) -> list[str]:
    names = set()
    for name in repo.branches():
        for v in repo.log(name):
            names.update(k for k, x in v.metrics.items() if isinstance(x, (int, float)))
    return sorted(names)


def paging(query: dict) -> tuple[int, int]:
    try:
        offset = int(query.get("offset", 0))
        limit = int(query.get("limit", 200))
    except ValueError:
        raise BadRequest("offset and limit must be integers") from None
    if offset < 0 or not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"offset must be >= 0 and limit in 1..{MAX_PAGE}")
    return offset, limit
