"""What the benchmarks share: repositories set up as a benchmark needs them. Run a benchmark
as `python -m benchmarks <name> [options]` (see benchmarks/__main__.py) or as
`python benchmarks/<name>.py [options]`."""

import forkpoint as fp


def repo(path: str, unpaced: bool = False, **options) -> fp.Repo:
    """A new repository at `path` with `options`; `unpaced` has every chunk of its saves
    encoded (its stores no longer pace encoding: the codec's own ratio and cost)."""
    opened = fp.Repo(path, create=True, **options)
    return unpaced_repo(opened) if unpaced else opened


def unpaced_repo(opened: fp.Repo) -> fp.Repo:
    """`opened`, its saves encoding every chunk (see `repo`)."""
    for store in opened.stores:
        store.paces_encoding = False
    return opened

