"""Render version history as a text graph with one lane per line of descent."""

import datetime

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


def render_graph(versions: list[Version], heads: dict, tags: dict) -> list[str]:
    """Return rich-markup lines, newest first; '*' marks a version, '|' a lane, '/' a join."""
    lanes: list[str | None] = []
    lines = []
    for v in versions:
        hits = [i for i, lane in enumerate(lanes) if lane == v.id]
        if hits:
            col = hits[0]
        elif None in lanes:
            col = lanes.index(None)
            lanes[col] = v.id
        else:
            col = len(lanes)
            lanes.append(v.id)
        row = "".join("*" if i == col else ("|" if lane else " ") for i, lane in enumerate(lanes))
        lines.append(f"{row.replace(' ', ' ')} [yellow]{v.id[:12]}[/yellow]"
                     f"{_decorations(v, heads, tags)}  {_describe(v)}")
        for extra in hits[1:]:
            lanes[extra] = None
        if hits[1:]:
            lines.append("".join("/" if i in hits[1:] else ("|" if lane else " ")
                                 for i, lane in enumerate(lanes)))
        lanes[col] = v.parents[0] if v.parents else None
        while lanes and lanes[-1] is None:
            lanes.pop()
    return lines
