"""The processes of a collective repository, whatever runs them: their rank and number, the
two collectives a repository needs, and the key-value store its saves coordinate through.

`TorchGroup` is a torch.distributed process group (fp.dist.Repo); `dist/mpi.py` has the MPI
communicator's (fp.mpi.Repo). The repository code above uses only this interface.
"""

import socket
from typing import Protocol


class Group(Protocol):
    """`rank` of `world` processes; `broadcast` and `all_gather` are collective (every rank
    calls them in the same order); `key_value(namespace)` is the store of dist/coordinator.py
    (set, get, check, add, delete_key; `wait` and `clone` where it has them)."""

    rank: int
    world: int

    def broadcast(self, value):
        """Rank 0's `value`, on every rank."""

    def all_gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""

    def key_value(self, namespace: str):
        """A key-value store every rank reaches, its keys under `namespace`."""

    def close(self) -> None:
        """Release what key_value started."""


class TorchGroup:
    """A torch.distributed process group (None: the default group) as a Group; `kv_store` is
    the c10d store saves coordinate through (default: the default group's)."""

    def __init__(self, group=None, kv_store=None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("fp.dist.Repo needs an initialised process group: call "
                               "torch.distributed.init_process_group (or fp.dist.init_from_env()) first")
        self._dist, self._group, self._kv = dist, group, kv_store
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def broadcast(self, value):
        box = [value]
        self._dist.broadcast_object_list(box, src=self._root, group=self._group)
        return box[0]

    def all_gather(self, value) -> list:
        out = [None] * self.world
        self._dist.all_gather_object(out, value, group=self._group)
        return out

    def key_value(self, namespace: str):
        base = self._kv if self._kv is not None else self._dist.distributed_c10d._get_default_store()
        return self._dist.PrefixStore(f"forkpoint/{namespace}/", base)

    def close(self) -> None:
        """Nothing to release: the process group owns its store."""

    def peers(self, ranks: list[int], timeout: float) -> "TorchPeers":
        """(Collective over the whole group) a group of `ranks` (ranks of this group) for
        point-to-point transfers from background threads, apart from the training's collectives."""
        return TorchPeers(self._dist, [self._global(r) for r in ranks], timeout)

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self._group, rank) if self._group is not None else rank


class TorchPeers:
    """A gloo group of some ranks (global ranks `ranks`; a member's place in it is its index):
    object all-gather and batched point-to-point transfers of byte buffers."""

    def __init__(self, dist, ranks: list[int], timeout: float):
        import datetime

        self._dist, self.ranks = dist, ranks
        self._group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout), backend="gloo")

    def all_gather(self, value) -> list:
        """Every member's `value`, in member order (call on every member)."""
        out = [None] * len(self.ranks)
        self._dist.all_gather_object(out, value, group=self._group)
        return out

    def exchange(self, sends: dict[int, list], receives: dict[int, list[int]]) -> dict[int, list[bytearray]]:
        """Send each member `m` of `sends` its buffers (in order), receive from each member of
        `receives` buffers of the given sizes; returns them. Both sides post everything before
        waiting, so a ring of exchanges cannot deadlock."""
        import warnings

        import torch

        works, got = [], {}
        with warnings.catch_warnings():  # read-only buffers are only read by a send
            warnings.simplefilter("ignore", UserWarning)
            for member, buffers in sends.items():
                for buf in buffers:
                    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
                    works.append(self._dist.isend(t, self.ranks[member], group=self._group))
        for member, sizes in receives.items():
            got[member] = [bytearray(n) for n in sizes]
            for buf in got[member]:
                t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
                works.append(self._dist.irecv(t, self.ranks[member], group=self._group))
        for w in works:
            w.wait()
        return got


def hosts_of(group: Group) -> list[str]:
    """Every rank's host name, in rank order (collective)."""
    return group.all_gather(socket.gethostname())
