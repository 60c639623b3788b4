"""Encoding paced by the store: a chunk is encoded only while the store has writes waiting.

Encoding pays where it leaves the store less to write than it could write meanwhile; where
the encoders fall behind a fast store, it would leave the store idle and make the save slower
than a raw one. The pacer tells each chunk's capture which of the two it is (as zstd --adapt
lowers its level when the output stalls).
"""

import threading
from dataclasses import dataclass, field


@dataclass
class EncodePacer:
    """The chunks of one save that may be encoded before their write: `slots`, the store's
    I/O slots; a chunk whose turn comes while fewer than that many chunks wait for or are in
    their write is written raw. Saves of fewer than `least` such chunks always encode (a few
    chunks' encodes cost little, and the first of them would find nothing waiting);
    `enabled=False` encodes every chunk."""

    slots: int
    enabled: bool = True
    least: int = 0
    chunks: int = 0
    waiting: int = 0
    encoded: int = 0
    raw: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.least = self.least or 2 * self.slots

    def add(self) -> None:
        """Count one more chunk of the save that may be encoded ahead of its write."""
        with self.lock:
            self.chunks += 1

    def encodes(self) -> bool:
        """Whether the chunk whose capture starts now is encoded (else it is written raw)."""
        with self.lock:
            encode = not self.enabled or self.chunks < self.least or self.waiting >= self.slots
            if encode:
                self.encoded += 1
            else:
                self.raw += 1
            return encode

    def ready(self) -> None:
        """A chunk is captured (and encoded or not): it now waits for its write."""
        with self.lock:
            self.waiting += 1

    def written(self) -> None:
        """A ready chunk's write ended (done or failed)."""
        with self.lock:
            self.waiting -= 1
