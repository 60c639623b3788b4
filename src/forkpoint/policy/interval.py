"""The automatic save interval: Young/Daly from measured stalls, capped by a time fraction.

Daly's higher-order optimum for checkpoint cost C and mean time between failures M:
tau = sqrt(2CM) [1 + (1/3) sqrt(C/2M) + (1/9) (C/2M)] - C when C < 2M, else tau = M.
"""

import math
import time
from dataclasses import dataclass, field


def young_daly(cost: float, mtbf: float) -> float:
    """Return Daly's optimal compute time between checkpoints (same unit as the inputs)."""
    if cost <= 0 or mtbf <= 0:
        raise ValueError(f"checkpoint cost and MTBF must be > 0, got {cost}, {mtbf}")
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def expected_waste_fraction(tau: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """First-order fraction of wall time lost to checkpoints and failures at interval tau."""
    return cost / (tau + cost) + (tau + cost) / (2 * mtbf) + restart / mtbf


@dataclass
class YoungDaly:
    """Save every Young/Daly interval for the measured stall C and the MTBF M; with
    `max_fraction` (e.g. 0.05), never spend more than that fraction of the time
    checkpointing (whichever of the two saves less often).

    C is a running estimate (exponential average of recent stalls); M is given, else
    `mtbf_estimate` (e.g. from the repository's restarts), else 24 h. Until a stall has been
    measured, it saves at the first step so that one can be.
    """

    mtbf: float | None = None
    max_fraction: float | None = None
    restart_cost: float | None = None
    smoothing: float = 0.5
    default_mtbf: float = 24 * 3600.0
    stall: float | None = None
    mtbf_estimate: float | None = None
    history: list = field(default_factory=list)

    def __post_init__(self):
        if self.max_fraction is not None and not 0 < self.max_fraction < 1:
            raise ValueError(f"max_fraction must be in (0, 1), got {self.max_fraction}")
        if self.mtbf is not None and self.mtbf <= 0:
            raise ValueError(f"mtbf must be > 0 seconds, got {self.mtbf}")

    def observe(self, stall: float) -> None:
        """Record the measured stall (seconds) of a checkpoint."""
        stall = max(stall, 1e-6)
        self.stall = stall if self.stall is None else (1 - self.smoothing) * self.stall + self.smoothing * stall
        self.history.append(stall)

    @property
    def mtbf_used(self) -> float:
        return self.mtbf or self.mtbf_estimate or self.default_mtbf

    def interval(self) -> tuple[float, str]:
        """Return (seconds between saves, which bound decided it)."""
        daly = young_daly(self.stall, self.mtbf_used)
        cap = self.cap()
        return (daly, "young/daly") if daly >= cap else (cap, f"{self.max_fraction:.0%} time cap")

    def cap(self) -> float:
        """Shortest interval the time-fraction cap allows (0 without a cap)."""
        if self.max_fraction is None:
            return 0.0
        return self.stall * (1 - self.max_fraction) / self.max_fraction

    def should_save(self, step: int, last_save_time: float | None) -> bool:
        if self.stall is None:
            return True
        return time.monotonic() - last_save_time >= self.interval()[0]

    def explain(self) -> str:
        if self.stall is None:
            return "auto interval: no checkpoint measured yet, so the next step saves to measure one"
        tau, why = self.interval()
        source = "given" if self.mtbf else "estimated from restarts" if self.mtbf_estimate else "default"
        waste = expected_waste_fraction(tau, self.stall, self.mtbf_used, self.restart_cost or 0.0)
        cap = (f", the {self.max_fraction:.0%} cap {self.cap():.1f} s" if self.max_fraction is not None
               else ", no time-fraction cap")
        return (f"auto interval: saves every {tau:.1f} s ({why}); measured stall C = {self.stall:.3f} s "
                f"over {len(self.history)} checkpoint(s), MTBF M = {self.mtbf_used:.0f} s ({source}); "
                f"Young/Daly alone gives {young_daly(self.stall, self.mtbf_used):.1f} s{cap}; "
                f"expected waste {waste:.1%}")
