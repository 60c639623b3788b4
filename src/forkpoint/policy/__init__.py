"""When to save and what to keep: small policy dataclasses the Checkpointer applies."""

from .interval import YoungDaly, young_daly
from .preemption import PREEMPTED_EXIT_CODE, Preemption, install_preemption
from .retention import Keep
from .schedule import EverySteps, EverySeconds

__all__ = ["YoungDaly", "EverySteps", "Keep", "PREEMPTED_EXIT_CODE", "Preemption", "EverySeconds",
           "install_preemption", "young_daly"]
