"""State trees: flatten/unflatten, leaf adapters, stateful capture and providers."""

from .block import Block
from .flatten import FlatLeaf, RankSlot, flatten, unflatten, walk_skeleton
from .providers import RankLocal, ResumableSampler, RNGState
from .stateful import capture, classes_of, is_module, is_stateful, merge, restore_objects

__all__ = ["Block", "FlatLeaf", "RankSlot", "RankLocal", "flatten", "unflatten", "walk_skeleton", "ResumableSampler", "RNGState",
           "capture", "classes_of", "is_module", "is_stateful", "merge", "restore_objects"]
