"""DeepSpeed: a CheckpointEngine that stores `engine.save_checkpoint` as forkpoint versions.

DeepSpeed has no registry for third-party checkpoint engines, so `fp.deepspeed.install(
engine, repo)` sets `engine.checkpoint_engine` and wraps `engine.load_checkpoint`. Each
`save_checkpoint(save_dir, tag)` becomes one version on `branch` holding every file
DeepSpeed writes for that tag (model states, ZeRO optimizer shards, client state), tagged
with the DeepSpeed tag; the version appears only at `commit`, after all files of the tag
were handed over. A small pointer file at each file's path keeps DeepSpeed's own path
checks working. Loading needs nothing but the repository: `load_checkpoint(load_dir)` with no
tag loads the branch head (an empty branch: a warning and `(None, None)`, as stock DeepSpeed
without a checkpoint); `tag=` takes a DeepSpeed tag or any forkpoint ref ("main~1", a
version id); `load_dir` is not read, so a moved or wiped save directory does not matter.

DeepSpeed's files hold two kinds of small objects besides tensors and plain data: its loss
scaler and ZeRO's fragment addresses. They are stored as plain data (class name from a fixed
allowlist plus their fields) and rebuilt on load, so no pickle is needed; any other object
is refused unless `allow_pickle=True`.

With `sync=False`, `commit` returns once the state is copied; writing and publishing go on
in the background. With `decoupled=True` the engine follows DeepSpeed's decoupled protocol
(`is_decoupled()`): `save_checkpoint` returns at once and the copy runs during the next
forward and backward; DeepSpeed calls `commit` at the next optimizer step, which waits only
for the copy to finish (the state is about to change); the version appears once written.
A crash before then loses only that checkpoint. In a process group, pass an
`fp.dist.Repo`: each rank's files are rank-local state of one coordinated version.
"""

import os
import tempfile

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.utils import logger

from ..state.providers import RankLocal
from .pointers import read_pointer, resolve, tag_for, write_pointer

PLAIN_CLASSES = {
    "LossScaler": "deepspeed.runtime.fp16.loss_scaler",
    "DynamicLossScaler": "deepspeed.runtime.fp16.loss_scaler",
    "fragment_address": "deepspeed.utils.tensor_fragment",
}
MARK = "__forkpoint_deepspeed_object__"


def to_plain(obj):
    """Replace allowlisted DeepSpeed objects in a checkpoint tree by tagged plain dicts."""
    if isinstance(obj, dict):
        return type(obj)((k, to_plain(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_plain(v) for v in obj)
    name = type(obj).__name__
    if PLAIN_CLASSES.get(name) == type(obj).__module__:
        return {MARK: name, "fields": {k: to_plain(v) for k, v in vars(obj).items()}}
    return obj


def from_plain(obj):
    """Rebuild the objects `to_plain` replaced (only allowlisted classes)."""
    if isinstance(obj, dict):
        if MARK in obj and obj[MARK] in PLAIN_CLASSES:
            import importlib

            cls = getattr(importlib.import_module(PLAIN_CLASSES[obj[MARK]]), obj[MARK])
            inst = cls.__new__(cls)
            for k, v in obj["fields"].items():
                object.__setattr__(inst, k, from_plain(v))
            return inst
        return type(obj)((k, from_plain(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


class ForkpointCheckpointEngine(CheckpointEngine):
    """Collects the files of one DeepSpeed checkpoint tag and commits them as one version."""

    def __init__(self, repo, branch: str = "main", sync: bool = True, allow_pickle: bool = False,
                 decoupled: bool = False, config_params=None):
        super().__init__(config_params)
        self.name = "forkpoint"
        self.repo, self.branch, self.sync, self.allow_pickle = repo, branch, sync, allow_pickle
        self.decoupled = decoupled
        self.files: dict[str, dict] = {}
        self.info = None
        self.pending = None
        self._cache: tuple[str, dict] | None = None

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self):
        return self.info if self.decoupled else None

    def cleanup(self) -> None:
        self.repo.drain()

    def create(self, info) -> None:
        self.files, self.info = {}, info

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str) -> None:
        self.files[os.path.basename(path)] = to_plain(state_dict)
        self._dir = os.path.dirname(path)

    def commit(self, info) -> bool:
        if self.decoupled:
            if self.pending is not None:
                self.pending.wait_capture()
            self.pending, self.info = None, None
            return True
        self._store(info, sync=self.sync)
        return True

    def start(self) -> None:
        """(Decoupled) begin storing the files of the current tag; commit waits for the copy."""
        if self.info is not None and self.files:
            self.pending = self._store(self.info, sync=False)

    def _store(self, info, sync: bool):
        files, self.files = self.files, {}
        directory = getattr(self, "_dir", os.path.join(info.save_dir, info.tag))
        collective = getattr(self.repo, "collective", False)
        state = {"files": RankLocal(files, on_resize="first") if collective else files}
        step = next((sd.get("global_steps") for sd in files.values() if isinstance(sd, dict) and "global_steps" in sd),
                    None)
        args = dict(branch=self.branch, step=step, message=f"deepspeed {info.tag}",
                    meta={"deepspeed_tag": info.tag, "deepspeed_dir": info.save_dir},
                    allow_pickle=self.allow_pickle)
        if sync:
            self._publish(self.repo.save(state, **args), info.tag, directory, files)
            return None
        pending = self.repo.save(state, sync=False, **args)
        if not self.decoupled:
            pending.wait_capture()
        self.repo.background(lambda: self._publish(pending.wait(), info.tag, directory, files))
        return pending

    def _publish(self, version, tag: str, directory: str, files: dict) -> None:
        if getattr(self.repo, "rank", 0) == 0:
            self.repo.tag(tag_for(tag), version.id, force=True)
        for name in files:
            write_pointer(os.path.join(directory, name), self.repo.url, version.id, None)

    def load(self, path: str, map_location=None):
        self.repo.drain()
        record = read_pointer(path)
        if record is None:
            raise FileNotFoundError(f"{path} is not a forkpoint pointer file")
        vid = resolve(path)
        if self._cache is None or self._cache[0] != vid:
            tree = self.repo.load(vid, map_location=map_location, allow_pickle=self.allow_pickle)
            self._cache = (vid, tree["files"])
        files = self._cache[1]
        name = os.path.basename(path)
        if isinstance(files, dict) and name not in files and getattr(self.repo, "collective", False):
            files = self.repo.load(vid, paths=["files"], map_location=map_location,
                                   allow_pickle=self.allow_pickle, all_ranks=True)["files"]
        if isinstance(files, list):
            files = next((f for f in files if name in f), files[0])
        if name not in files:
            raise FileNotFoundError(f"version {vid} holds no DeepSpeed file {name!r}")
        return from_plain(files[name])

    def preserves_storage_sharing(self) -> bool:
        return True


def _version_to_load(repo, branch: str, tag):
    """The version a load_checkpoint tag names: None for the branch head (None when the
    branch has no version yet), else a DeepSpeed tag, a pointer file, or any forkpoint ref."""
    if tag is None:
        head = repo.head(branch)
        return None if head is None else repo.version(head)
    if tag_for(str(tag)) in repo.tags():
        return repo.version(tag_for(str(tag)))
    return repo.version(resolve(str(tag)))


def _file_names(repo, vid: str) -> list[str]:
    """The names of the DeepSpeed files version `vid` holds (of every rank)."""
    names = set()
    files = next((v for k, v in zip(repo.manifest(vid).tree.get("k", []), repo.manifest(vid).tree.get("v", []))
                  if k == "files"), {})
    for part in files.get("v", []) if files.get("t") == "ranks" else [files]:
        names.update(k for k in part.get("k", []) if isinstance(k, str))
    bad = [n for n in names if not n or "/" in n or n in (".", "..")]
    if bad:
        raise ValueError(f"version {vid} names DeepSpeed files {bad[:3]} that are not plain file names")
    return sorted(names)


def install(engine, repo, branch: str = "main", sync: bool = True, allow_pickle: bool = False,
            decoupled: bool = False) -> ForkpointCheckpointEngine:
    """Make `engine.save_checkpoint`/`load_checkpoint` write and read forkpoint versions."""
    ckpt = ForkpointCheckpointEngine(repo, branch, sync, allow_pickle, decoupled)
    engine.checkpoint_engine = ckpt
    original_load, original_save = engine.load_checkpoint, engine.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        result = original_save(*args, **kwargs)
        if decoupled:
            ckpt.start()
        return result

    engine.save_checkpoint = save_checkpoint

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        repo.drain()
        version = _version_to_load(repo, branch, tag)
        if version is None:  # as stock DeepSpeed does without a `latest` file
            logger.warning(f"forkpoint: branch {branch!r} of {repo.url} has no checkpoint yet; "
                           "nothing loaded (training starts from scratch)")
            return None, None
        ds_tag = version.meta.get("deepspeed_tag") if isinstance(version.meta, dict) else None
        if not isinstance(ds_tag, str) or not ds_tag or "/" in ds_tag or ds_tag in (".", ".."):
            raise ValueError(f"version {version.id} was not saved by DeepSpeed (no valid deepspeed_tag); "
                             "load a version that engine.save_checkpoint made")
        # DeepSpeed finds its files by listing a directory: recreate the pointers to this
        # version's files in a private one, so nothing of the save directory is needed.
        with tempfile.TemporaryDirectory(prefix="forkpoint-deepspeed-") as where:
            for name in _file_names(repo, version.id):
                write_pointer(os.path.join(where, ds_tag, name), repo.url, version.id, None)
            return original_load(where, ds_tag, *args, **kwargs)

    engine.load_checkpoint = load_checkpoint
    return ckpt
