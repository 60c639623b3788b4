"""What the float codec chose for each chunk of a repository's saves, kept from one save to the
next so that a save of the same chunk reuses it instead of sampling again."""

import threading

from ..format.floatcodec import Layouts


class ChunkLayouts:
    """floatcodec.Layouts by chunk slot (leaf path, box, value or delta), shared by the saves of
    one process; bounded: forgets everything past `limit` slots (the next saves choose again)."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self.slots: dict = {}
        self.lock = threading.Lock()

    def get(self, slot) -> Layouts:
        """The Layouts of `slot` (empty the first time: the encode chooses and fills it)."""
        with self.lock:
            found = self.slots.get(slot)
            if found is None:
                if len(self.slots) >= self.limit:
                    self.slots.clear()
                found = self.slots[slot] = Layouts()
            return found
