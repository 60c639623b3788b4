"""What a repository's saves learnt about each chunk, kept from one save to the next: the float
codec's layouts (a save of the same chunk reuses them instead of sampling again) and how well
its value codes, against which a delta save weighs the chunk's delta (engine.delta)."""

import threading
from typing import Callable


class ChunkMemory:
    """Records by chunk slot (leaf path, box, and what is coded), made by `factory` the first
    time a slot is asked for; shared by the saves of one process and bounded: forgets
    everything past `limit` slots (the next saves learn again)."""

    def __init__(self, factory: Callable[[], object], limit: int = 1 << 16):
        self.factory = factory
        self.limit = limit
        self.slots: dict = {}
        self.lock = threading.Lock()

    def get(self, slot):
        """The record of `slot` (a fresh one the first time: its user fills it)."""
        with self.lock:
            found = self.slots.get(slot)
            if found is None:
                if len(self.slots) >= self.limit:
                    self.slots.clear()
                found = self.slots[slot] = self.factory()
            return found
