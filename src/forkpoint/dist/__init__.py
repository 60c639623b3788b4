"""Distributed checkpoints: sharded saves from every rank, one coordinated commit, restore
on any number of ranks (torch.distributed; imported only when used)."""

from ..state import RankLocal
from .coordinator import DistSaveError
from .launch import Launch, detect, init_from_env
from .repo import Repo
from .sampler import DistributedResumableSampler
from .train_state import TrainState

__all__ = ["DistSaveError", "DistributedResumableSampler", "Launch", "RankLocal", "Repo", "TrainState",
           "detect", "init_from_env"]
