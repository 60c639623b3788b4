"""The engine: one scheduler, and the save and restore pipelines that run as its tasks."""

from .restore import read_leaves
from .scheduler import Budget, Priority, Scheduler
from .save import SaveOptions, schedule_save

__all__ = ["Budget", "Priority", "Scheduler", "SaveOptions", "schedule_save", "read_leaves"]
