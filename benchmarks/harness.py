"""What the benchmarks share: medians of repeated runs, one table format, and repositories set
up as a benchmark needs them. Run a benchmark as `python -m benchmarks <name> [options]` (see
benchmarks/__main__.py) or as `python benchmarks/<name>.py [options]`."""

import json
import os
import statistics

import forkpoint as fp


def repo(path: str, unpaced: bool = False, **options) -> fp.Repo:
    """A new repository at `path` with `options`; `unpaced` has every chunk of its saves
    encoded (its stores no longer pace encoding: the codec's own ratio and cost)."""
    opened = fp.Repo(path, create=True, **options)
    return unpaced_repo(opened) if unpaced else opened


def unpaced_repo(opened: fp.Repo) -> fp.Repo:
    """`opened`, its saves encoding every chunk (see `repo`)."""
    for store in opened.stores:
        store.paces_encoding = False
    return opened


def median(values) -> float:
    """The median of `values` (the figure every benchmark reports)."""
    return statistics.median(values)


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table of `rows` under `headers` (floats with three significant digits)."""
    def cell(x):
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, record: dict) -> None:
    """Write `record` to `path` (its folder made) unless `path` is None."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
