"""Conversions between forkpoint versions and other checkpoint formats: a PyTorch DCP
directory (export and import), a torch.save file and safetensors files (import)."""

import os
import re

import numpy as np

from ..repo import Repo
from ..state.leaves import is_torch_tensor


def _torch_values(tree):
    """The tree with numpy arrays as tensors (so that DCP stores them as tensors, not pickles)."""
    import torch

    if isinstance(tree, dict):
        return {k: _torch_values(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_torch_values(v) for v in tree)
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(tree))
    return tree


def export_dcp(repo: Repo, ref: str, directory: str, allow_pickle: bool = False) -> list[str]:
    """Write `ref` as a plain DCP checkpoint directory that stock `dcp.load` reads."""
    import torch.distributed.checkpoint as dcp

    tree = _torch_values(repo.load(ref, allow_pickle=allow_pickle))
    os.makedirs(directory, exist_ok=True)
    dcp.save(tree, checkpoint_id=directory, no_dist=True)
    return sorted(os.path.join(directory, f) for f in os.listdir(directory))


def detect_format(source: str) -> str:
    """"dcp" for a directory with .metadata, "safetensors" for .safetensors files, else "torch"."""
    if not os.path.exists(source):
        raise FileNotFoundError(f"nothing to import at {source}: no such file or directory")
    if os.path.isdir(source):
        if os.path.exists(os.path.join(source, ".metadata")):
            return "dcp"
        if any(f.endswith(".safetensors") for f in os.listdir(source)):
            return "safetensors"
        raise ValueError(f"{source} is neither a DCP checkpoint (no .metadata) nor holds .safetensors files")
    return "safetensors" if source.endswith(".safetensors") else "torch"


def read_dcp(directory: str, allow_pickle: bool = False) -> tuple[dict, list[str]]:
    """(state, entries left out) of a DCP directory: full tensors, and the non-tensor entries
    DCP pickles read with torch's weights-only loader (numbers, strings, lists, dicts);
    entries that need a full unpickler are left out unless `allow_pickle`. Nested as the
    saved state was: list indices make lists again, dict keys dicts (as dcp_to_torch_save)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    skipped = []

    class PlainValuesPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.original_state_dict[fqn] = torch.load(value, weights_only=not allow_pickle)
            except Exception:
                if allow_pickle:
                    raise
                skipped.append(fqn)

    metadata = dcp.FileSystemReader(directory).read_metadata()
    flat = {}
    for fqn, md in metadata.state_dict_metadata.items():
        flat[fqn] = None if isinstance(md, BytesStorageMetadata) else torch.empty(tuple(md.size),
                                                                                   dtype=md.properties.dtype)
    dcp.load(flat, checkpoint_id=directory, no_dist=True, planner=PlainValuesPlanner(flatten_state_dict=False))
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tree: dict = {}
    for fqn, value in flat.items():
        if fqn not in skipped:
            _place(tree, list(paths.get(fqn, (fqn,))), value)
    return tree, sorted(skipped)


def _place(tree: dict, keys: list, value) -> None:
    """Put `value` at `keys` under `tree`, making a list under each int key, a dict elsewhere."""
    cur = tree
    for key, below in zip(keys[:-1], keys[1:]):
        if _get(cur, key) is None:
            _set(cur, key, [] if isinstance(below, int) else {})
        cur = _get(cur, key)
    _set(cur, keys[-1], value)


def _get(container, key):
    if isinstance(container, list):
        return container[key] if key < len(container) else None
    return container.get(key)


def _set(container, key, value) -> None:
    if isinstance(container, list):
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def read_source(source: str, fmt: str = "auto", allow_pickle: bool = False) -> tuple[dict, list[str]]:
    """(state tree, entries left out) of a DCP directory, torch.save file or safetensors file(s)."""
    fmt = detect_format(source) if fmt == "auto" else fmt
    if fmt == "dcp":
        return read_dcp(source, allow_pickle)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        files = [source] if os.path.isfile(source) else sorted(
            os.path.join(source, f) for f in os.listdir(source) if f.endswith(".safetensors"))
        state = {}
        for f in files:
            state.update(load_file(f))
        return state, []
    if fmt == "torch":
        import torch

        try:
            state = torch.load(source, map_location="cpu", weights_only=not allow_pickle)
        except Exception as e:
            if allow_pickle:
                raise
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            what = found.group(1) if found else type(e).__name__
            raise ValueError(f"{source} holds objects beyond tensors and plain containers ({what}); "
                             "import it with --allow-pickle only if you trust it") from None
        return (state if isinstance(state, dict) else {"state": state}), []
    raise ValueError(f"unknown format {fmt!r}: use dcp, torch or safetensors")


def import_source(repo: Repo, source: str, fmt: str = "auto", branch: str = "main", step: int | None = None,
                  message: str = "", allow_pickle: bool = False):
    """Save the checkpoint at `source` as a new version; return (Version, entries left out)."""
    state, skipped = read_source(source, fmt, allow_pickle)
    meta = {"imported_from": os.path.abspath(source), "format": fmt if fmt != "auto" else detect_format(source)}
    if skipped:
        meta["left_out"] = skipped
    version = repo.save(state, branch=branch, step=step, message=message or f"imported {source}", meta=meta,
                        allow_pickle=allow_pickle and any(not is_torch_tensor(v) for v in state.values()))
    return version, skipped
