"""Render version history as a text graph with one lane per line of descent.

Reading rule (what the tests parse back): a version row has one '*'; the version below it in
the same column is its first parent. A join row ('/' in some columns) comes right before
the version those lanes end in: each '/' lane's parent is the version of the next row. A lane
that turns blank ended: its version's parent is not shown (a root, or cut by a limit).
"""

import datetime
import heapq
from dataclasses import dataclass

from ..format.manifest import Version


def _decorations(v: Version, heads: dict, tags: dict) -> str:
    names = [f"[cyan]{b}[/cyan]" for b, vid in heads.items() if vid == v.id]
    names += [f"[magenta]tag:{t}[/magenta]" for t, vid in tags.items() if vid == v.id]
    return f" ({', '.join(names)})" if names else ""


def _describe(v: Version) -> str:
    when = datetime.datetime.fromtimestamp(v.time).strftime("%Y-%m-%d %H:%M:%S")
    metrics = " ".join(f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}"
                       for k, val in v.metrics.items())
    restarts = v.meta.get("restarts") if isinstance(v.meta, dict) else None
    parts = [f"step {v.step}", when, metrics, v.message, "[red]pruned[/red]" if v.pruned else "",
             f"restarts={restarts}" if restarts else ""]
    return "  ".join(p for p in parts if p)


def newest_first(versions: list[Version]) -> list[Version]:
    """`versions` ordered so every version comes before its first parent; newest first otherwise
    (clocks of different hosts may disagree, so time alone cannot order a lineage)."""
    by_id = {v.id: v for v in versions}
    children = dict.fromkeys(by_id, 0)
    for v in versions:
        if v.parents and v.parents[0] in by_id:
            children[v.parents[0]] += 1
    ready = [(-v.time, v.id) for v in versions if children[v.id] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = by_id[heapq.heappop(ready)[1]]
        order.append(v)
        parent = v.parents[0] if v.parents else None
        if parent in by_id:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(ready, (-by_id[parent].time, parent))
    return order


def _cells(lanes: list) -> list[str]:
    return ["|" if lane else " " for lane in lanes]


@dataclass
class Row:
    """One version's place in the graph: its column, and the text cells of the join row
    drawn above it (empty when no lane ends in it) and of its own row."""

    version: Version
    column: int
    join_cells: list[str]
    cells: list[str]


def lay_out(versions: list[Version]) -> list[Row]:
    """Place `versions` newest first, one column per line of descent (see the module's rule)."""
    lanes: list[str | None] = []
    rows = []
    previous: list[str] = []
    for v in newest_first(versions):
        hits = [i for i, lane in enumerate(lanes) if lane == v.id]
        joined: list[str] = []
        if len(hits) > 1:
            joined = _cells(lanes)
            for extra in hits[1:]:
                joined[extra] = "/"
                lanes[extra] = None
            previous = joined
            while lanes[-1] is None:
                lanes.pop()
        if hits:
            col = hits[0]
        else:
            # A new line of descent never takes a column that ended on the row above: read
            # top-down, it would look like that version's parent.
            free = [i for i, lane in enumerate(lanes) if lane is None and (i >= len(previous) or previous[i] == " ")]
            col = free[0] if free else len(lanes)
            if col == len(lanes):
                lanes.append(None)
            lanes[col] = v.id
        cells = _cells(lanes)
        cells[col] = "*"
        previous = cells
        rows.append(Row(v, col, joined, cells))
        lanes[col] = v.parents[0] if v.parents else None
        while lanes and lanes[-1] is None:
            lanes.pop()
    return rows


def render_graph(versions: list[Version], heads: dict, tags: dict) -> list[str]:
    """Return rich-markup lines, newest first: '*' a version, '|' a lane, '/' a lane joining
    the version of the next row (see the module's reading rule)."""
    lines = []
    for row in lay_out(versions):
        v = row.version
        if row.join_cells:
            lines.append("".join(row.join_cells).rstrip())
        lines.append(f"{''.join(row.cells)} [yellow]{v.id[:12]}[/yellow]{_decorations(v, heads, tags)}  {_describe(v)}")
    return lines
