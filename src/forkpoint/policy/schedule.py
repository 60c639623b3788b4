"""When to save: every N steps or every t seconds of wall time."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class EverySteps:
    """Save when the step is a multiple of `n`."""

    n: int

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"save interval must be >= 1 step, got {self.n}")

    def should_save(self, step: int, last_save_time: float | None) -> bool:
        return step % self.n == 0

    def explain(self) -> str:
        return f"saves every {self.n} steps"


@dataclass(frozen=True)
class EverySeconds:
    """Save when at least `t` seconds of wall time passed since the last save (or start)."""

    t: float

    def __post_init__(self):
        if self.t <= 0:
            raise ValueError(f"save interval must be > 0 seconds, got {self.t}")

    def should_save(self, step: int, last_save_time: float | None) -> bool:
        return last_save_time is not None and time.monotonic() - last_save_time >= self.t

    def explain(self) -> str:
        return f"saves every {self.t:g} s of wall time"
