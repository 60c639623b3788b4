"""The interface every byte store implements.

Keys are '/'-separated relative names. `write` replaces atomically; `create_exclusive`
publishes only if the key is absent; `barrier` makes earlier writes durable.
"""

from abc import ABC, abstractmethod
from typing import Iterable, Sequence


class Store(ABC):
    """A flat namespace of immutable-by-convention byte objects."""

    url: str

    bandwidth_hint: float | None = None
    """Expected write bandwidth in bytes/s when known in advance (remote stores): such a store
    is taken to be slow (codec="auto" tries encoding on it first); None: not known."""
    paces_encoding: bool = True
    """Whether saves to this store encode a chunk only while its writes keep the store busy
    (engine.pacing): False for memory, whose writes never wait, and for remote stores, slow
    enough that encoding always pays (a save's first chunks, which find nothing waiting, would
    go raw), so that there the policy alone decides. Set it False on a store object to have
    every chunk of its saves encoded (a benchmark of the codec alone, a test)."""
    aligned_writes: bool = False
    """True when `write` sends parts that lie page-aligned in memory, at block-aligned offsets
    of the object, to storage without copying them (direct I/O); others go through a copy."""
    adopts_buffers: bool = False
    """True when `object_buffer` hands out buffers that `adopt` keeps without copying."""
    trusted: bool = False
    """True when an object read back is exactly the bytes that were verified as they were
    stored (this process's memory): readers may skip re-hashing it."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        """Return the whole object; raise FileNotFoundError when absent."""

    @abstractmethod
    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """Fill `buf` from byte `offset` of the object; return the number of bytes read."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Return the object's size in bytes; raise FileNotFoundError when absent."""

    @abstractmethod
    def write(self, key: str, parts: Sequence, durable: bool = True) -> None:
        """Atomically create or replace `key` with the concatenation of `parts`."""

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Durably create `key` only if absent; return False if it already existed."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True when the object exists."""

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Return every key under `prefix` (recursively), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent keys are ignored."""

    @abstractmethod
    def mtime(self, key: str) -> float:
        """Return the object's last-modified time (seconds since the epoch)."""

    def fresh_mtime(self, key: str) -> float:
        """`mtime` as the store tells it now, not from a listing cached earlier (what gc checks
        right before it deletes an object that another process may have just reused)."""
        return self.mtime(key)

    def signature(self, key: str) -> tuple | None:
        """A token that changes whenever `key` is replaced (say its mtime and size), or None
        where one costs about as much as reading a small object; FileNotFoundError when absent."""
        return None

    @abstractmethod
    def touch(self, key: str) -> None:
        """Set the object's modified time to now (protects it from a concurrent gc)."""

    def barrier(self, keys: Iterable[str]) -> None:
        """Make the creation of `keys` durable (e.g. fsync their directories)."""

    def map(self, key: str, offset: int, length: int | None) -> memoryview | None:
        """Bytes [offset, offset+length) of `key` (to its end when `length` is None) mapped
        without copying (private: writes to the view never reach storage), or None where the
        store cannot map."""
        return None

    def object_buffer(self, nbytes: int):
        """A writable uint8 buffer that `adopt` can keep as an object without copying it, or
        None where the store copies what it is given (every store but memory)."""
        return None

    def adopt(self, key: str, buffer) -> None:
        """Make `buffer` (from `object_buffer`, filled) the object `key`; the caller gives it up."""
        self.write(key, [buffer])

    def release_buffer(self, buffer) -> None:
        """Give back a buffer from `object_buffer` that was not adopted."""

    def reserve(self, sizes: Iterable[int]) -> int:
        """Fault in buffers of these sizes for later `object_buffer` calls; return the bytes
        reserved (0 where the store does not hand out buffers)."""
        return 0

    def close(self) -> None:
        """Release resources held by the store."""
