"""Adjoint and history workloads: checkpoint schedules and what drives them."""

from .check import InvalidSchedule, check
from .executor import RunStats, run
from .multilevel import Level, makespan, multilevel
from .online import OnlineSchedule, online
from .schedule import Action, Schedule, optimal_advances, revolve, two_level


def checkpoint_sequential(functions, input, snapshots: int):
    """Revolve-scheduled drop-in for torch.utils.checkpoint.checkpoint_sequential (imports torch)."""
    from .torch_sequential import checkpoint_sequential as run

    return run(functions, input, snapshots)


def checkpoint_graph(module, example_input, memory_budget: int | None = None, snapshots: int | None = None,
                     offload: str | None = None):
    """`module` with activations recomputed by Revolve over its traced graph, or by the
    multilevel schedule with host memory as a level (`offload="cpu"`); imports torch. See
    adjoint.graph."""
    from .graph import checkpoint_graph as plan

    return plan(module, example_input, memory_budget=memory_budget, snapshots=snapshots, offload=offload)


__all__ = ["checkpoint_graph", "OnlineSchedule", "online", "Level", "makespan", "multilevel", "checkpoint_sequential", "RunStats", "run", "two_level", "Action", "InvalidSchedule", "Schedule", "check", "optimal_advances", "revolve"]
