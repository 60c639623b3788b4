"""Opening and creating a repository on its stores: the marker file that says a directory is
one, and the refusal to create one over files that are not a repository's.

`open_or_create` checks every tier's marker and, with `create`, writes the missing ones; two
processes creating the same repository at once both end up opening the one marker written.
"""

import json
import time

from ..errors import FormatError, RepoNotFoundError, StoreUnavailableError
from ..format.manifest import FORMAT_VERSION, check_format
from ..storage import Store
from ..storage.local import TEMP_NAME

REPO_MARKER = "forkpoint.json"
REPO_KIND = "forkpoint.repository"

REPOSITORY_DIRECTORIES = ("objects", "versions", "refs", "tmp")
"""What a repository keeps below its root; gc deletes unreferenced and stale files there."""


def open_or_create(stores: list[Store], url: str, create: bool) -> None:
    """Check every tier's marker; create missing ones when the repository exists on any tier
    or `create` is set. RepoNotFoundError with neither, StoreUnavailableError naming a store
    that cannot be read or written."""
    found = []
    for store in stores:
        try:
            check_marker(store)
        except FileNotFoundError:
            continue
        except (NotADirectoryError, PermissionError) as e:
            raise StoreUnavailableError(f"cannot open repository {store.url}: {e.strerror} "
                                        f"({e.filename}); give a directory you can read") from None
        found.append(store)
    if not found and not create:
        raise RepoNotFoundError(
            f"no forkpoint repository at {url}: create one with "
            f"fp.Repo({url!r}, create=True) or `forkpoint init {url}`")
    if not found:
        for store in stores:
            refuse_foreign_layout(store)
    record = {"format": REPO_KIND, "format_version": list(FORMAT_VERSION), "created": time.time()}
    for store in stores:
        if store not in found:
            try:
                if not store.create_exclusive(REPO_MARKER, json.dumps(record).encode()):
                    check_marker(store)  # another process created it first: open theirs
            except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
                raise StoreUnavailableError(
                    f"cannot create a repository at {store.url}: {e.strerror} ({e.filename}); "
                    "give a directory you can create and write") from None


def check_marker(store: Store) -> None:
    """Raise FileNotFoundError without a repository marker on `store`, FormatError when it
    is not one this version of forkpoint reads."""
    try:
        record = json.loads(store.read(REPO_MARKER))
    except ValueError:
        raise FormatError(f"{store.url}/{REPO_MARKER} is not valid JSON") from None
    check_format(record, REPO_KIND, f"repository {store.url}")


def refuse_foreign_layout(store: Store) -> None:
    """StoreUnavailableError when a new repository's root already has files where the
    repository keeps its own (a tmp/ of the user's would be swept by gc as stale temp files)."""
    def foreign(key: str) -> bool:  # a creator racing this one writes its marker through tmp/
        return not (key.startswith("tmp/") and TEMP_NAME.fullmatch(key[len("tmp/"):]))

    taken = [d + "/" for d in REPOSITORY_DIRECTORIES if any(map(foreign, store.list(d)))]
    if taken and not store.exists(REPO_MARKER):  # else another process created it meanwhile
        raise StoreUnavailableError(
            f"cannot create a repository at {store.url}: it has no {REPO_MARKER} but already holds files in "
            f"{', '.join(taken)}, which a repository keeps for its own (and gc cleans). Create it in a new or "
            f"empty directory; if this was a repository whose {REPO_MARKER} was lost, put that file back")

