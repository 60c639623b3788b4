"""Remote stores through fsspec (s3://, gs://, ...): whole-object puts, range reads, no rename.

Object stores publish a put atomically, so `write` needs no temp file. `create_exclusive`
uses a conditional put (S3 `If-None-Match: *`) where the backend offers one; otherwise it
checks and puts, which is safe only with a single writer per ref.
"""

import functools
import time
from typing import Sequence

import fsspec

from ..errors import ForkpointError, StorageFullError, StoreUnavailableError
from .base import Store


S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 3, "mode": "standard"}}
"""botocore's limits for an S3 store unless the caller sets `config_kwargs`: each request
gives up after 5 s without a connection or 30 s without data, tried 3 times, so that a dead
endpoint fails a save (see S3_RETRIES) instead of hanging it."""
S3_RETRIES = 2
"""s3fs's own retries of a failed request, on top of botocore's (s3fs's default is 5)."""


def _with_timeouts(url: str, options: dict) -> dict:
    """`options` with S3_TIMEOUTS where an s3:// store's caller set none."""
    if not url.startswith(("s3://", "s3a://")):
        return options
    config = dict(options.get("config_kwargs") or {})
    for name, value in S3_TIMEOUTS.items():
        config.setdefault(name, value)
    return {**options, "config_kwargs": config}


def _file_system(url: str, options: dict):
    """fsspec's (file system, root path) for `url`; an unknown scheme or a backend that is not
    installed is a StoreUnavailableError that says what to install or check."""
    scheme = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        extra = " (pip install 'forkpoint[s3]')" if scheme in ("s3", "s3a") else ""
        raise StoreUnavailableError(f"cannot open repository {url}: its {scheme}:// backend is not "
                                    f"installed: {e}{extra}") from None
    except ValueError as e:
        if scheme in fsspec.available_protocols():
            raise
        raise StoreUnavailableError(
            f"cannot open repository {url}: no storage backend serves {scheme}:// ({e}); give a local "
            "path, mem://name, or a URL such as s3://bucket/path") from None


def _reported(method):
    """Run a store operation; a failure other than a missing or existing key (the store's
    contract) becomes StoreUnavailableError naming the store, the operation and the key."""
    @functools.wraps(method)
    def run(self, key, *args, **kwargs):
        try:
            return method(self, key, *args, **kwargs)
        except (FileNotFoundError, FileExistsError, ForkpointError, ValueError):
            raise
        except Exception as e:
            raise StoreUnavailableError(
                f"{self.url}: {method.__name__} {key!r} failed after retries ({type(e).__name__}: {e}); "
                "nothing unfinished was committed. Check the endpoint and credentials, then run again") from e
    return run


class FsspecStore(Store):
    """A store on any fsspec file system; keys are joined under the URL's path."""

    bandwidth_hint = 200e6
    paces_encoding = False  # slow next to encoding: a chunk written raw there takes longer than its encode

    def __init__(self, url: str, **storage_options):
        self.url = url.rstrip("/")
        self.fs, root = _file_system(self.url, _with_timeouts(self.url, storage_options))
        if self.url.startswith(("s3://", "s3a://")) and isinstance(getattr(self.fs, "retries", None), int):
            self.fs.retries = min(self.fs.retries, S3_RETRIES)
        self.root = root.rstrip("/")
        self.conditional_put = True

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"refusing unsafe storage key {key!r}")
        return f"{self.root}/{key}"

    @_reported
    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    @_reported
    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        data = self.fs.cat_file(self._path(key), start=offset, end=offset + buf.nbytes)
        buf[:len(data)] = data
        return len(data)

    @_reported
    def size(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    @_reported
    def write(self, key: str, parts: Sequence, durable: bool = True) -> None:
        blob = b"".join(memoryview(p).cast("B") for p in parts)
        try:
            self.fs.pipe_file(self._path(key), blob)
        except OSError as e:
            if "space" in str(e).lower() or "quota" in str(e).lower():
                raise StorageFullError(f"{self.url} is full: {e}; nothing was committed") from e
            raise

    @_reported
    def create_exclusive(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if self.conditional_put:
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False
            except (TypeError, NotImplementedError, ValueError):
                self.conditional_put = False
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        return True

    @_reported
    def exists(self, key: str) -> bool:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    @_reported
    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        cut = len(self.root) + 1
        return sorted(p[cut:] for p in found if p.startswith(self.root + "/"))

    @_reported
    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    @_reported
    def mtime(self, key: str) -> float:
        info = self.fs.info(self._path(key))
        for field in ("LastModified", "mtime", "created"):
            value = info.get(field)
            if value is not None:
                return value.timestamp() if hasattr(value, "timestamp") else float(value)
        return time.time()

    def fresh_mtime(self, key: str) -> float:
        """The object's modification time as the store tells it now (no cached listing)."""
        self.fs.invalidate_cache(self._path(key))
        return self.mtime(key)

    @_reported
    def touch(self, key: str) -> None:
        """Refresh the object's modification time: on S3 a server-side copy onto itself with
        new metadata (no bytes travel), elsewhere fsspec's touch without truncation, and where
        neither exists a rewrite of the object."""
        path = self._path(key)
        if not self.fs.exists(path):
            raise FileNotFoundError(key)
        setxattr = getattr(self.fs, "setxattr", None)
        if setxattr is not None:
            setxattr(path, forkpoint_touched=f"{time.time():.3f}")
        else:
            try:
                self.fs.touch(path, truncate=False)
            except (NotImplementedError, ValueError, TypeError):
                self.fs.pipe_file(path, self.fs.cat_file(path))
        self.fs.invalidate_cache(path)
