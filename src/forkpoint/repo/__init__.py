"""The repository: the public core (Repo) and the records it returns."""

from .core import Repo
from .records import CompactReport, Divergence, GcReport, LeafDiff, PendingSave, VerifyReport

__all__ = ["CompactReport", "Divergence", "GcReport", "LeafDiff", "PendingSave", "Repo", "VerifyReport"]
