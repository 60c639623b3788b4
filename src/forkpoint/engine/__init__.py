"""The engine: save and restore pipelines that move leaf bytes to and from a store."""

from .restore import read_leaves
from .save import SaveOptions, object_key, store_leaves

__all__ = ["SaveOptions", "object_key", "store_leaves", "read_leaves"]
