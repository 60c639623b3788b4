"""The processes one Checkpointer agrees with: torch.distributed's default group, the group of
a collective repository run without it (fp.mpi.Repo's communicator), or this process alone.

Every rank must take the same decisions at a step (whether to save, whether to stop), or a
collective save or barrier waits on ranks that never come: `agree` makes them one decision.
"""

import sys


class Ranks:
    """This process alone: `rank` 0 of `world` 1; `agree` returns its own flags."""

    rank, world = 0, 1

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag, True where it holds on any rank (collective: every rank calls it in turn)."""
        return tuple(bool(f) for f in flags)

    def broadcast(self, value):
        """Rank 0's `value`, on every rank (collective)."""
        return value

    def barrier(self) -> None:
        """Wait for every rank (collective)."""


class TorchRanks(Ranks):
    """The default process group of torch.distributed; one small all-reduce per `agree`."""

    def __init__(self, dist):
        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        import torch

        value = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX)
        return tuple(bool(x) for x in value.tolist())

    def broadcast(self, value):
        box = [value]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier()


class GroupRanks(Ranks):
    """The group of a collective repository (dist.group.Group: rank, world, broadcast, all_gather)."""

    def __init__(self, group):
        self._group = group
        self.rank, self.world = group.rank, group.world

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        gathered = self._group.all_gather(tuple(bool(f) for f in flags))
        return tuple(any(column) for column in zip(*gathered))

    def broadcast(self, value):
        return self._group.broadcast(value)

    def barrier(self) -> None:
        self._group.all_gather(None)


def ranks_of(repo) -> Ranks:
    """The ranks a Checkpointer over `repo` agrees with: torch.distributed's where it is
    initialised, else a collective repository's group, else this process alone."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchRanks(dist)
    group = getattr(repo, "group", None)
    if getattr(repo, "collective", False) and group is not None and group.world > 1:
        return GroupRanks(group)
    return Ranks()
