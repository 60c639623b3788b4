"""When to save and what to keep: small policy dataclasses, registered with the Checkpointer."""

from ..checkpointer import EXTENSIONS, POLICY_FACTORIES, RETENTION_FACTORIES
from .interval import Auto, young_daly
from .preemption import PREEMPTED_EXIT_CODE, Preemption, install_preemption
from .retention import Keep
from .schedule import EverySteps, Seconds

POLICY_FACTORIES[int] = EverySteps
POLICY_FACTORIES["auto"] = lambda _: Auto()
RETENTION_FACTORIES[int] = lambda last: Keep(last=last)
EXTENSIONS.append(install_preemption)

__all__ = ["Auto", "EverySteps", "Keep", "PREEMPTED_EXIT_CODE", "Preemption", "Seconds",
           "install_preemption", "young_daly"]
