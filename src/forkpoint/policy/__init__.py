"""When to save and what to keep: small policy dataclasses."""

from .retention import Keep
from .schedule import EverySteps, Seconds

__all__ = ["Keep", "EverySteps", "Seconds"]
