"""Byte stores: one small interface, one file per backend; URLs choose the backend."""

from .base import Store
from .local import LocalStore
from .memory import MemoryStore


def open_store(url: str) -> Store:
    """Return the store for a local path, `file://` URL or `mem://name` URL."""
    if url.startswith("mem://"):
        return MemoryStore.named(url[len("mem://"):])
    if url.startswith("file://"):
        return LocalStore(url[len("file://"):])
    if "://" in url:
        raise ValueError(f"unsupported repository URL {url!r}: use a local path, file:// or mem://")
    return LocalStore(url)


__all__ = ["Store", "LocalStore", "MemoryStore", "open_store"]
