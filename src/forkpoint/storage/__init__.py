"""Byte stores: one small interface, one file per backend; URLs choose the backend."""

from .base import Store
from .local import LocalStore
from .memory import MemoryStore


def open_store(url: str, **storage_options) -> Store:
    """Return the store for a local path, `file://`, `mem://name`, or any fsspec URL (s3://, ...)."""
    if url.startswith("mem://"):
        return MemoryStore.named(url[len("mem://"):])
    if url.startswith("file://"):
        return LocalStore(url[len("file://"):])
    if "://" in url:
        from .remote import FsspecStore

        return FsspecStore(url, **storage_options)
    return LocalStore(url)


__all__ = ["Store", "LocalStore", "MemoryStore", "open_store"]
