"""Branch and tag refs: write-once records, newest wins, fastest tier first.

Records older than the newest REF_RECORDS_KEPT of a ref are deleted as new ones are
published, so reading a ref lists a bounded number of keys however long the history. A
record is deleted only once a record at least REF_RECORDS_KEPT seqs newer exists; a writer
that finds one that much newer right after its own exclusive create knows it recreated a
deleted seq from a stale read, and treats its publish as lost.
"""

import time

from ..errors import ConflictError, RefNotFoundError
from ..format.manifest import Version
from ..format.refs import check_name, decode_record, encode_record, record_key, seq_of
from ..storage import Store
from .holders import BranchHolds, Holder, current_holder, run_name

_REF_NOUN = {"heads": "branch", "tags": "tag"}
REF_RECORDS_KEPT = 16


class Refs:
    """The branch and tag refs of one repository's tiers (fastest first), and the branch
    holds of this process: a Repo's collaborator, reached as `repo.refs`."""

    def __init__(self, stores: list[Store], url: str, writer_id: str):
        self.stores, self.url, self.writer_id = stores, url, writer_id
        self.holds = BranchHolds(stores[-1])

    def refuse_shadowing(self, kind: str, name: str) -> None:
        """ValueError when creating ref `name` of `kind` would give a branch and a tag one name:
        a ref names the branch first, so the tag would silently stop being what `name` reads."""
        other = "tags" if kind == "heads" else "heads"
        taken = self.target(other, name)
        if taken is None or (kind == "heads" and self.target("heads", name) is not None):
            return
        if kind == "heads":
            raise ValueError(f"{name!r} is a tag in {self.url} (at {taken[:12]}): a branch of that name would "
                             "shadow it, and reading the name would give the branch instead of the tag. "
                             "Use another branch name, or delete the tag first")
        raise ValueError(f"{name!r} is a branch in {self.url} (at {taken[:12]}): a tag of that name could "
                         "not be read by name (the branch comes first). Use another tag name")

    def state_in(self, store: Store, kind: str, name: str) -> tuple[int, str | None]:
        """Return (highest seq, target) of a ref in one store; (-1, None) when it never existed."""
        for _ in range(100):
            seqs = ref_seqs(store, kind, name)
            if not seqs:
                return -1, None
            key = record_key(kind, name, seqs[-1])
            try:
                return seqs[-1], decode_record(store.read(key), f"{store.url}/{key}", seqs[-1])["target"]
            except FileNotFoundError:
                continue  # deleted as old by writers that published newer records meanwhile
        raise ConflictError(f"could not read {_REF_NOUN.get(kind, kind)} {name!r} in {store.url}: too many concurrent writers")

    def state(self, kind: str, name: str) -> tuple[int, str | None]:
        """Return the ref as the fastest tier that has records of it sees it."""
        for store in self.stores:
            state = self.state_in(store, kind, name)
            if state[0] >= 0:
                return state
        return -1, None

    def target(self, kind: str, name: str) -> str | None:
        """The version id a ref names, or None (never existed, or deleted)."""
        return self.state(kind, name)[1]

    def publish(self, kind: str, name: str, seq: int, target: str | None, store: Store | None = None) -> bool | None:
        """Publish record `seq` of a ref: True when done; False when that seq exists; None
        when it had been deleted as old and this writer's read of the ref was stale (see the
        module doc; its record is not the newest, though in theory, after REF_RECORDS_KEPT
        publishes between its create and its check, others may have read it, so what it
        names must stay)."""
        store = store or self.stores[0]
        data = encode_record(seq, target, time.time(), self.writer_id)
        if not store.create_exclusive(record_key(kind, name, seq), data):
            return False
        seqs = ref_seqs(store, kind, name)
        if seqs and seqs[-1] >= seq + REF_RECORDS_KEPT:
            return None
        if len(seqs) >= 2 * REF_RECORDS_KEPT:
            drop_old_records(store, kind, name, seqs)
        return True

    def set(self, kind: str, name: str, target: str | None, must_exist: bool | None, repair: bool = False) -> None:
        """Move a ref on every tier; with `repair`, whatever its newest records hold (damaged
        records are passed over, not read)."""
        if repair:
            current = "?" if any(ref_seqs(st, kind, name) for st in self.stores) else None
        else:
            current = self.target(kind, name)
        if must_exist is True and current is None:
            raise RefNotFoundError(f"no {_REF_NOUN.get(kind, kind)} {name!r} in {self.url}")
        if must_exist is False and current is not None:
            then = (f"move it with force=True (`forkpoint tag {name} REF --force`)" if kind == "tags" else
                    f"use another name, or move it with `forkpoint branch reset {name} REF`")
            raise ValueError(f"{_REF_NOUN.get(kind, kind)} {name!r} already exists in {self.url} (at {current}): {then}")
        for store in reversed(self.stores):
            self.move(store, kind, name, target, repair)

    def move(self, store: Store, kind: str, name: str, target: str | None, repair: bool = False) -> None:
        """Publish `target` as the next record of a ref in one store, retrying past concurrent writers."""
        for _ in range(100):
            if repair:
                seq = max(ref_seqs(store, kind, name), default=-1)
            else:
                seq, _ = self.state_in(store, kind, name)
            if self.publish(kind, name, seq + 1, target, store):
                return
        raise ConflictError(f"could not update {_REF_NOUN.get(kind, kind)} {name!r} in {store.url}: too many concurrent writers")

    def names(self, kind: str) -> list[str]:
        """The names that have records of kind `kind` on any tier (deleted refs included)."""
        return sorted({key.split("/")[2] for store in self.stores
                       for key in store.list(f"refs/{kind}") if key.count("/") == 3})

    def targets(self, kind: str) -> dict[str, str]:
        """{name: version id} of the live refs of kind `kind`."""
        out = {}
        for name in self.names(kind):
            target = self.target(kind, name)
            if target is not None:
                out[name] = target
        return out


class RefCommands:
    """The ref operations of a Repo's public API, over `self.refs` and `self.version` (see repo.core)."""

    refs: Refs

    def branches(self) -> dict[str, str]:
        """Return {branch name: head version id}."""
        return self.refs.targets("heads")

    def tags(self) -> dict[str, str]:
        """Return {tag name: version id}."""
        return self.refs.targets("tags")

    def head(self, branch: str = "main") -> str | None:
        """Return the head version id of `branch`, or None when it has no versions."""
        return self.refs.target("heads", check_name(branch, "branch"))

    def fork(self, ref: str, name: str) -> Version:
        """Create branch `name` at the version `ref` names; later saves on it descend from there."""
        version = self.version(ref)
        self.refs.refuse_shadowing("heads", check_name(name, "branch"))
        self.refs.set("heads", name, version.id, must_exist=False)
        return version

    def tag(self, name: str, ref: str = "main", force: bool = False) -> Version:
        """Point tag `name` at `ref` (moving an existing tag only with force=True)."""
        version = self.version(ref)
        self.refs.refuse_shadowing("tags", check_name(name, "tag"))
        self.refs.set("tags", name, version.id, must_exist=None if force else False)
        return version

    def delete_tag(self, name: str) -> None:
        """Remove a tag (its version stays)."""
        self.refs.set("tags", check_name(name, "tag"), None, must_exist=True)

    def delete_branch(self, name: str) -> None:
        """Remove a branch ref (its versions stay until gc finds them unreachable), even one
        whose newest record is damaged."""
        self.refs.set("heads", check_name(name, "branch"), None, must_exist=True, repair=True)

    def hold_branch(self, name: str, run: str | None = None, take_over: bool = False) -> None:
        """Make this process the one live writer of branch `name` until release_branch or
        close (a Checkpointer does this). BranchHeldError names a live holder; a dead one is
        replaced; `take_over` replaces a live one too (for a holder known to be dead)."""
        self.refs.refuse_shadowing("heads", check_name(name, "branch"))
        self.refs.holds.hold(name, run or run_name(), take_over)

    def release_branch(self, name: str) -> None:
        """Stop holding branch `name` (other runs may then write it)."""
        self.refs.holds.release(check_name(name, "branch"))

    def branch_holder(self, name: str) -> Holder | None:
        """The live run holding branch `name`, or None."""
        holder = current_holder(self.refs.holds.store, check_name(name, "branch"))
        return holder if holder is not None and holder.alive() else None

    def reset_branch(self, name: str, ref: str) -> Version:
        """Point branch `name` at the version `ref` names, creating the branch if absent: the
        repair for a branch whose head record is damaged or names a lost version (versions
        after `ref` stay until gc finds them unreachable)."""
        version = self.version(ref)
        self.refs.set("heads", check_name(name, "branch"), version.id, must_exist=None, repair=True)
        return version


def ref_seqs(store: Store, kind: str, name: str) -> list[int]:
    """The seqs of the records of one ref in `store`, ascending."""
    return sorted(s for s in map(seq_of, store.list(f"refs/{kind}/{name}")) if s is not None)


def drop_old_records(store: Store, kind: str, name: str, seqs: list[int]) -> None:
    """Delete the records of a ref but the newest REF_RECORDS_KEPT (`seqs`: ascending, listed)."""
    for seq in seqs[:-REF_RECORDS_KEPT]:
        store.delete(record_key(kind, name, seq))
