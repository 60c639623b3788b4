"""One small hierarchy of exceptions.

Every error says what went wrong, where (repository, version, path inside the state) and,
where there is one, what to do next.
"""


class ForkpointError(Exception):
    """Base class of every error forkpoint raises on purpose."""


class RepoNotFoundError(ForkpointError):
    """No forkpoint repository at the given location."""


class RefNotFoundError(ForkpointError):
    """A branch, tag, version id or `ref~N` expression names nothing in the repository."""


class FormatError(ForkpointError):
    """A manifest, ref record or object is malformed or of an unsupported format version."""


class CorruptObjectError(ForkpointError):
    """Bytes read from storage do not match their recorded hash or length."""


class MissingObjectError(ForkpointError):
    """An object a version refers to is absent from every store."""


class StoreUnavailableError(ForkpointError):
    """A store cannot do what was asked: a remote one after its timeouts and retries (endpoint
    down, network lost), a local one whose path is not a directory it can make or write, a URL
    no installed backend serves; nothing that was not durable was committed."""


class StorageFullError(ForkpointError):
    """The storage ran out of space; nothing was committed."""


class UnsupportedTypeError(ForkpointError, TypeError):
    """A state leaf has a type forkpoint does not store (or load) without pickle."""


class StateMismatchError(ForkpointError):
    """A strict restore found missing or unexpected keys, or shape/dtype mismatches."""


class ConflictError(ForkpointError):
    """Another writer moved the branch head between read and publish."""


class PrunedVersionError(ForkpointError):
    """The version's data was removed by retention; only its record remains."""


class UnsafePathError(ForkpointError):
    """A storage key would reach outside the repository's root (through `..` or a symlink)."""


class OutOfMemoryError(ForkpointError, MemoryError):
    """A leaf declared by a manifest is larger than this process can allocate."""


class ResumeWarning(UserWarning):
    """Checkpointer.resume restored something other than the branch head as it stands (a
    damaged head skipped), or the branch's run is already finished."""


class BranchHeldError(ConflictError):
    """Another live run holds the branch (see Checkpointer's on_conflict and take_over)."""


class SaveAbortedError(ForkpointError):
    """A save was aborted (a second Ctrl-C) before its commit: nothing was committed."""


class StateChangedError(ForkpointError):
    """A tensor was written in place while an asynchronous save was still copying it, by a
    write the capture hooks do not guard: that save was not committed. `paths` names them."""

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths
