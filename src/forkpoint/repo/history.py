"""Versions and lineage: manifests by id, ref resolution, logs."""

import collections
import itertools
import re
import threading

from ..errors import FormatError, MissingObjectError, RefNotFoundError
from ..format.manifest import Manifest, Version, version_from_bytes
from ..format.refs import parse_ref_expr
from ..storage import Store

_VERSION_KEY = re.compile(r"versions/[0-9a-f]{1,64}\.json")
"""The key of a version manifest; other files under versions/ are not forkpoint's."""

MANIFESTS_CACHED = 64
LEAVES_CACHED = 30_000
RECORDS_CACHED = 50_000


class ManifestCache:
    """Parsed manifests this process met: the most recently used in full, at most `limit` of
    them and `leaf_limit` leaves in all (always the newest one), and the Version records (about
    2 KB each) of the `record_limit` most recently used, so that walking a long history reads
    nothing while a run of many saves keeps neither every leaf table (a state of 20k leaves
    takes ~25 MB a manifest) nor every record in memory."""

    def __init__(self, limit: int = MANIFESTS_CACHED, leaf_limit: int = LEAVES_CACHED,
                 record_limit: int = RECORDS_CACHED):
        self.limit, self.leaf_limit, self.record_limit = limit, leaf_limit, record_limit
        self.full: collections.OrderedDict[str, Manifest] = collections.OrderedDict()
        self.leaves = 0
        self.records: collections.OrderedDict[str, Version] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, vid: str) -> Manifest | None:
        with self.lock:
            m = self.full.get(vid)
            if m is not None:
                self.full.move_to_end(vid)
            return m

    def record(self, vid: str) -> Version | None:
        with self.lock:
            record = self.records.get(vid)
            if record is not None:
                self.records.move_to_end(vid)
            return record

    def put_record(self, vid: str, record: Version) -> None:
        """Keep the record of a version whose manifest was read without its leaf table."""
        with self.lock:
            self._keep_record(vid, self.records.get(vid, record))

    def _keep_record(self, vid: str, record: Version) -> None:
        self.records[vid] = record
        self.records.move_to_end(vid)
        while len(self.records) > self.record_limit:
            self.records.popitem(last=False)

    def put(self, vid: str, m: Manifest) -> None:
        with self.lock:
            old = self.full.pop(vid, None)
            self.leaves += len(m.leaves) - (len(old.leaves) if old is not None else 0)
            self.full[vid] = m
            self._keep_record(vid, m.version)
            while len(self.full) > 1 and (len(self.full) > self.limit or self.leaves > self.leaf_limit):
                self.leaves -= len(self.full.popitem(last=False)[1].leaves)

    def pop(self, vid: str, default=None):
        with self.lock:
            self.records.pop(vid, None)
            m = self.full.pop(vid, None)
            if m is None:
                return default
            self.leaves -= len(m.leaves)
            return m


class History:
    """Versions and lineage of one repository's tiers: manifests by id (through a
    ManifestCache), ref expressions resolved, first-parent walks. A Repo's collaborator,
    reached as `repo.history`."""

    def __init__(self, stores: list[Store], url: str, refs, cache: ManifestCache | None = None):
        self.stores, self.url, self.refs = stores, url, refs
        self.cache = cache or ManifestCache()
        self._stubs_seen: dict[str, dict] = {}  # {store url: {vid: (signature, stub manifest)}}

    def manifest_by_id(self, vid: str) -> Manifest:
        """The full manifest of version `vid` (cached)."""
        cached = self.cache.get(vid)
        if cached is not None:
            return cached
        data, where = self.manifest_bytes(vid)
        m = Manifest.from_bytes(data, where)
        check_id(m.version, vid, where)
        self.cache.put(vid, m)
        return m

    def manifest_bytes(self, vid: str) -> tuple[bytes, str]:
        """(bytes, where) of version `vid`'s manifest from the fastest tier holding it."""
        if not isinstance(vid, str) or not vid or not all(c in "0123456789abcdef" for c in vid):
            raise FormatError(f"invalid version id {vid!r} in {self.url}: expected hex digits")
        key = f"versions/{vid}.json"
        for store in self.stores:
            try:
                return store.read(key), f"{store.url}/{key}"
            except FileNotFoundError:
                continue
        raise RefNotFoundError(f"version {vid} does not exist in {self.url}") from None

    def version_by_id(self, vid: str) -> Version:
        """The Version record of `vid`: from the record cache when its manifest was met, else
        read without its leaf table (and cached)."""
        record = self.cache.record(vid)
        if record is not None:
            return record
        data, where = self.manifest_bytes(vid)
        record = version_from_bytes(data, where)
        check_id(record, vid, where)
        self.cache.put_record(vid, record)
        return record

    def version_ids(self, store: Store | None = None) -> list[str]:
        """The ids of every version record on `store` (default: any tier), without reading them."""
        stores = [store] if store is not None else self.stores
        return sorted({k[len("versions/"):-len(".json")] for st in stores for k in st.list("versions")
                       if _VERSION_KEY.fullmatch(k)})

    def resolve(self, ref: str) -> str:
        """Return the version id named by a branch, tag, id (or unique prefix), with `~N` suffixes."""
        if not isinstance(ref, str) or not ref:
            raise RefNotFoundError(f"invalid ref {ref!r}")
        base, ups = parse_ref_expr(ref)
        vid = None
        if base.replace(".", "").replace("_", "").replace("-", "").isalnum() and "/" not in base:
            vid = self.ref_target("heads", base)
            if vid is None:
                vid = self.ref_target("tags", base)
        if vid is None and len(base) >= 4 and all(c in "0123456789abcdef" for c in base):
            matches = [v for v in self.version_ids() if v.startswith(base)]
            if len(matches) > 1:
                raise RefNotFoundError(f"ref {base!r} is ambiguous: {', '.join(sorted(matches)[:5])}")
            vid = matches[0] if matches else None
        if vid is None:
            raise RefNotFoundError(
                f"no branch, tag or version {base!r} in {self.url}; branches: "
                f"{', '.join(self.refs.targets('heads')) or '(none)'}")
        for i in range(ups):
            parents = self.version_by_id(vid).parents
            if not parents:
                raise RefNotFoundError(f"{ref!r} goes {ups} versions back, but the history ends {i} back: "
                                       f"{base}~{i} ({vid}) is its first version")
            vid = parents[0]
        return vid

    def ref_target(self, kind: str, name: str) -> str | None:
        """The version a branch or tag names, or None when there is no such ref; MissingObjectError
        naming the ref when its version is on no tier (a partial copy, a damaged record)."""
        vid = self.refs.target(kind, name)
        if vid is not None and not self.has_manifest(vid):
            noun = "branch" if kind == "heads" else "tag"
            raise MissingObjectError(
                f"{noun} {name!r} of {self.url} points at version {vid}, which is on no tier: the repository "
                f"is a partial copy or the ref's newest record (refs/{kind}/{name}/) is damaged. Point it at "
                f"an intact version with `forkpoint branch reset {name} REF` (tags: `forkpoint tag --force`)")
        return vid

    def has_manifest(self, vid: str) -> bool:
        key = f"versions/{vid}.json"
        return self.cache.record(vid) is not None or any(st.exists(key) for st in self.stores)

    def first_parents(self, vid: str | None, strict: bool = True):
        """Yield the records of `vid` and its first-parent ancestors, newest first, lazily.
        A missing ancestor raises MissingObjectError and a cycle FormatError, naming the version
        that leads there (with strict=False the walk stops at either)."""
        seen, child = set(), None
        while vid is not None:
            if vid in seen:
                if not strict:
                    return
                raise FormatError(f"the history of {self.url} loops: version {child} names {vid}, an "
                                  "ancestor of itself, as its parent; a manifest was crafted or damaged")
            seen.add(vid)
            try:
                v = self.version_by_id(vid)
            except RefNotFoundError:
                if child is None:
                    raise
                if not strict:
                    return
                raise MissingObjectError(
                    f"version {child} of {self.url} names parent {vid}, which is on no tier: the history is "
                    "cut there (a partial copy of the repository, or a lost manifest); gc refuses to run "
                    "until it is restored or the branch is reset past it") from None
            yield v
            child, vid = vid, (v.parents[0] if v.parents else None)


    def reachable(self, heads: set[str], strict: bool = False) -> set[str]:
        """Versions reachable from `heads` through first parents. A manifest that no ref reaches
        yet belongs to a commit in flight (or to an abandoned one, which gc removes): never
        evict it. With `strict` (gc), a head or ancestor that is missing, unreadable or part of
        a loop raises instead of ending the walk: what lies behind it cannot be proven unreachable."""
        seen: set[str] = set()
        for vid in heads:
            if strict:
                for v in self.first_parents(vid):
                    if v.id in seen:
                        break
                    seen.add(v.id)
                continue
            while vid and vid not in seen:
                seen.add(vid)
                try:
                    parents = self.version_by_id(vid).parents
                except (RefNotFoundError, FormatError):
                    break
                vid = parents[0] if parents else None
        return seen

    def manifests_in(self, store: Store) -> list[Manifest]:
        """Every manifest as stored on one tier (stubs included). A stub met before is not read
        again while its store signature is unchanged (a long history is mostly stubs)."""
        out = []
        known = self._stubs_seen.get(store.url, {})
        stubs = {}
        for vid in self.version_ids(store):
            key = f"versions/{vid}.json"
            try:
                signature = store.signature(key)
                seen = known.get(vid)
                m = seen[1] if seen is not None and seen[0] == signature else \
                    Manifest.from_bytes(store.read(key), f"{store.url}/{key}")
            except FileNotFoundError:
                continue
            if m.version.pruned and signature is not None:
                stubs[vid] = (signature, m)
            out.append(m)
        self._stubs_seen[store.url] = stubs
        return out


def check_id(version: Version, vid: str, where: str) -> None:
    if version.id != vid:
        raise FormatError(f"manifest {where} names version {version.id}, not {vid}")


class HistoryCommands:
    """The version lookups of a Repo's public API, over `self.history` (see repo.core)."""

    history: History

    def resolve(self, ref: str) -> str:
        """Return the version id named by a branch, tag, id (or unique prefix), with `~N` suffixes."""
        return self.history.resolve(ref)

    def version(self, ref: str = "main") -> Version:
        """Return the Version record `ref` names."""
        return self.history.version_by_id(self.history.resolve(ref))

    def manifest(self, ref: str = "main") -> Manifest:
        """Return the full manifest (record, skeleton, leaf table) of `ref`."""
        return self.history.manifest_by_id(self.history.resolve(ref))

    def log(self, ref: str = "main", limit: int | None = None) -> list[Version]:
        """Return the first-parent history of `ref`, newest first (pruned records included)."""
        return list(itertools.islice(self.history.first_parents(self.history.resolve(ref)), limit))

    def version_ids(self) -> list[str]:
        """The ids of every version record on any tier (stubs included), without reading them."""
        return self.history.version_ids()

    def versions(self) -> list[Version]:
        """Return every version record in the repository, oldest first."""
        return sorted((self.history.version_by_id(v) for v in self.history.version_ids()), key=lambda v: v.time)
