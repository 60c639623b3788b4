"""forkpoint: versioned, lineage-aware checkpoint/restart for training and simulations."""

from ._version import __version__

from . import adjoint, dist, errors  # noqa: E402
import os as _os  # noqa: E402

from .automation import AuditReport, Discovery, audit, discover  # noqa: E402
from .checkpointer import Checkpointer  # noqa: E402
from .engine.save import SaveOptions # noqa: E402
from .errors import ResumeWarning  # noqa: E402
from .codecs.delta import Delta  # noqa: E402
from .codecs.lossy import Lossy  # noqa: E402
from .format.manifest import Version  # noqa: E402
from .policy import PREEMPTED_EXIT_CODE, YoungDaly, EverySteps, Keep, Preemption, EverySeconds  # noqa: E402
from .repo import CompactReport, Divergence, GcReport, LeafDiff, PendingSave, Repo, VerifyReport  # noqa: E402
from .state import Block, RankLocal, ResumableSampler, RNGState  # noqa: E402
from .tiers import Tier, tier  # noqa: E402

__all__ = ["Block", "PREEMPTED_EXIT_CODE", "YoungDaly", "Preemption", "Checkpointer", "CompactReport", "Delta", "Divergence", "EverySteps", "GcReport", "Keep", "LeafDiff", "Lossy",
           "PendingSave", "RankLocal", "Repo", "ResumableSampler", "RNGState", "EverySeconds", "Tier", "Version",
           "VerifyReport", "adjoint", "dist", "errors", "tier", "__version__", "AuditReport", "audit", "Discovery", "discover",
           "ResumeWarning", "SaveOptions"]

if _os.environ.get("FORKPOINT_AUDIT"):  # this process is a phase of `forkpoint audit`
    from .automation.script_audit import install_from_environment

    install_from_environment()


def __dir__() -> list[str]:
    """The public API only (the layers below it are importable, but not part of it)."""
    return sorted(__all__ + ["lightning", "transformers", "deepspeed", "dcp", "mpi", "ResumableLoader"])


def __getattr__(name: str):
    """fp.lightning, fp.transformers, fp.deepspeed, fp.dcp: framework plug-ins, fp.mpi and
    fp.ResumableLoader, imported on first use."""
    import importlib

    if name in ("lightning", "transformers", "deepspeed"):
        return importlib.import_module(f".integrations.{name}", __name__)
    if name == "dcp":
        return importlib.import_module(".dcp", __name__)
    if name == "mpi":
        return importlib.import_module(".dist.mpi", __name__)
    if name == "ResumableLoader":  # a torch DataLoader: torch is imported here, not with forkpoint
        return importlib.import_module(".state.loader", __name__).ResumableLoader
    raise AttributeError(f"module 'forkpoint' has no attribute {name!r}")
