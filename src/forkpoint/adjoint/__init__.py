"""Adjoint and history workloads: checkpoint schedules and what drives them."""

from .check import InvalidSchedule, check
from .schedule import Action, Schedule, optimal_advances, revolve

__all__ = ["Action", "InvalidSchedule", "Schedule", "check", "optimal_advances", "revolve"]
