"""State trees: flatten/unflatten, leaf adapters, stateful capture and providers."""

from .flatten import FlatLeaf, flatten, unflatten, walk_skeleton
from .providers import ResumableSampler, RNGState
from .stateful import capture, is_module, is_stateful, merge, restore_objects

__all__ = ["FlatLeaf", "flatten", "unflatten", "walk_skeleton", "ResumableSampler", "RNGState",
           "capture", "is_module", "is_stateful", "merge", "restore_objects"]
