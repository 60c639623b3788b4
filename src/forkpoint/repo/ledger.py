"""This process's commits, numbered, as gc needs to know them."""

import collections
import contextlib
import threading

RECENT_COMMITS = 256
"""Commits remembered with their objects; a gc whose scan began more commits ago than this
treats every name as possibly committed since (it then deletes nothing this process made)."""


class CommitLedger:
    """The versions this process is committing (manifest written, ref not yet) and its recent
    commits with the objects they use, numbered from 1; thread-safe. gc reads `seq` before it
    scans and spares what `committed_since` or `in_commit` names."""

    def __init__(self, remembered: int = RECENT_COMMITS):
        self._lock = threading.Lock()
        self._seq = 0
        self._committing: set[str] = set()
        self._recent: collections.deque = collections.deque(maxlen=remembered)

    @property
    def seq(self) -> int:
        """The number of the latest commit this process made (0: none yet)."""
        with self._lock:
            return self._seq

    @contextlib.contextmanager
    def committing(self, vid: str):
        """Marks version `vid` as in commit for the duration of the block."""
        with self._lock:
            self._committing.add(vid)
        try:
            yield
        finally:
            with self._lock:
                self._committing.discard(vid)

    def committed(self, vid: str, objects: set[str]) -> None:
        """Records that version `vid`, using `objects`, is now on its branch."""
        with self._lock:
            self._seq += 1
            self._recent.append((self._seq, vid, objects))

    def in_commit(self, vid: str) -> bool:
        """True while this process is committing version `vid`."""
        with self._lock:
            return vid in self._committing

    def committed_since(self, seq: int, name: str) -> bool:
        """True when a commit after number `seq` is version `name` or uses object `name`, or
        when too many commits passed since to tell."""
        with self._lock:
            recent = list(self._recent)
            latest = self._seq
        if latest > seq and (not recent or recent[0][0] > seq + 1):
            return True
        return any(name == vid or name in objects for n, vid, objects in recent if n > seq)
