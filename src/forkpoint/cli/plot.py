"""`forkpoint plot`: a metric's curve per branch, fork points marked, as an image file."""

import math

from ..repo import Repo
from .common import numeric_metrics
from .webapi import metric_series


def plot_metric(repo: Repo, metric: str, out: str, branches: list[str] | None = None,
                log_y: bool = False) -> dict[str, list[tuple]]:
    """Draw `metric` over step for `branches` (default: every branch that records it) into
    `out` (format from its suffix); return the (step, value) points drawn per branch.
    ValueError when no branch has the metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = metric_series(repo, metric)["branches"]
    unknown = sorted(set(branches or []) - set(series))
    if unknown:
        raise ValueError(f"no branch {', '.join(map(repr, unknown))} in {repo.url}")
    drawn = {}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for name in branches or sorted(series):
        points = [(s, v) for s, v in series[name]["points"] if isinstance(v, (int, float)) and math.isfinite(v)]
        if not points:
            continue
        steps, values = zip(*points)
        (line,) = ax.plot(steps, values, label=name, linewidth=1.6)
        fork = series[name]["fork"]
        if fork is not None:
            at = next(((s, v) for s, v in points if s == fork["step"]), points[0])
            ax.plot([at[0]], [at[1]], "o", markerfacecolor="white", markeredgecolor=line.get_color(),
                    label=f"{name} forked from {fork['from']} at step {fork['step']}")
        drawn[name] = points
    if not drawn:
        plt.close(fig)
        recorded = sorted(numeric_metrics(repo, list(repo.branches())))
        raise ValueError(f"no branch of {repo.url} records metric {metric!r} as a finite number; "
                         f"numeric metrics recorded: {', '.join(recorded) or '(none)'}")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return drawn
