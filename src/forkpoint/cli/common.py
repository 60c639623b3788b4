"""What the `forkpoint` commands share: the console, the common options, output helpers."""

import contextlib
import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

from ..repo import Repo

# Piped output keeps whole lines (paths, ids) for grep and scripts; a terminal wraps to its width.
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 1 << 14)
repo_option = click.option("--repo", "-r", "repo_url", envvar="FORKPOINT_REPO", default=".",
                           show_default=True, help="repository path or URL (env FORKPOINT_REPO)")
json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


def _open(url: str) -> Repo:
    return Repo(url)


def numeric_metrics(repo: Repo, branches: list[str]) -> set[str]:
    """The names of the metrics some version of `branches` records as a number (not a bool)."""
    return {k for b in branches for v in repo.log(b) for k, x in v.metrics.items()
            if isinstance(x, (int, float)) and not isinstance(x, bool)}


def _emit(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _ratio(logical: int, stored: int, digits: int) -> str:
    """logical / stored as "1.5x"; "all dedup" when nothing new was stored, "-" for nothing at all."""
    if stored:
        return f"{logical / stored:.{digits}f}x"
    return "all dedup" if logical else "-"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@contextlib.contextmanager
def _working(text: str):
    """A spinner naming the operation on a terminal (stderr); nothing when piped."""
    if not sys.stderr.isatty():
        yield
        return
    with Console(stderr=True).status(text):
        yield


def _progress(total: int, label: str):
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=True,
                    disable=not sys.stderr.isatty()), total, label
