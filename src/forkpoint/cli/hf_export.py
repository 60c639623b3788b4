"""Export a version's model weights as a Hugging Face model directory.

The tensors under one path of the state (`model` by default) are written as Hugging Face
tools lay them out: `model.safetensors`, or, above the shard size, `model-0000k-of-0000n.safetensors`
with `model.safetensors.index.json`; the keys are the paths below that prefix joined by dots
(a module's state_dict keys). A tied weight is written once, under its first key, as
`save_pretrained` does (the model re-ties it from its config). Shards are read from the
repository one at a time, so memory holds about one shard, also for a version saved sharded
by fp.dist.Repo. `config.json` comes from `config=` or from the version's `hf_config` meta
(which the Transformers plug-in records).
"""

import json
import os
import shutil
from dataclasses import dataclass

from ..format.manifest import Manifest
from ..format.objects import runs_of_bytes
from ..format.paths import has_prefix, split_path
from ..repo import Repo
from ..state.flatten import walk_skeleton

DEFAULT_SHARD_BYTES = 5_000_000_000
"""Hugging Face's default max_shard_size ("5GB")."""
TENSOR_KINDS = ("torch", "numpy")


@dataclass
class Weight:
    """One tensor to export: its key in the model directory, its path in the version, bytes,
    and the keys that lead to it in the loaded tree."""

    key: str
    path: str
    nbytes: int
    keys: tuple = ()


def model_weights(m: Manifest, prefix: str | None) -> tuple[str, list[Weight]]:
    """(The prefix used, the tensors under it in the version's order, aliases left out)."""
    if prefix is None:
        tops = {split_path(leaf.path)[0] for leaf in m.leaves if leaf.path}
        prefix = "model" if "model" in tops else ""
    keys_of = {path: keys for path, keys, node in walk_skeleton(m.tree) if node.get("t") == "leaf"}
    weights = []
    for leaf in m.leaves:
        if prefix and not has_prefix(leaf.path, prefix):
            continue
        if leaf.alias_of is not None or leaf.kind not in TENSOR_KINDS:
            continue
        below = split_path(leaf.path)[len(split_path(prefix)):]
        weights.append(Weight(".".join(below), leaf.path, leaf.nbytes, keys_of.get(leaf.path, ())))
    if not weights:
        tops = sorted({split_path(leaf.path)[0] for leaf in m.leaves if leaf.path})
        raise ValueError(f"version {m.version.id} has no tensors under {prefix or '/'!r}; give the model's "
                         f"path with --prefix (top-level keys: {', '.join(tops)})")
    return prefix, weights


def shard(weights: list[Weight], max_bytes: int) -> list[list[Weight]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a group of its own)."""
    return runs_of_bytes(weights, max_bytes) or [[]]


def export_hf(repo: Repo, ref: str, directory: str, prefix: str | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, config: str | None = None) -> list[str]:
    """Write the model weights of `ref` under `directory` (see the module doc); return the files."""
    from safetensors.torch import save_file

    m = repo.readable(ref)
    prefix, weights = model_weights(m, prefix)
    configs = _config_sources(config)  # a missing --config fails before anything is written
    groups = shard(weights, max_shard_bytes)
    os.makedirs(directory, exist_ok=True)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{k:05d}-of-{len(groups):05d}.safetensors" for k in range(1, len(groups) + 1)])
    files, weight_map = [], {}
    for name, group in zip(names, groups):
        tensors = _tensors(repo, m.version.id, group)
        path = os.path.join(directory, name)
        save_file(tensors, path, metadata={"format": "pt", "forkpoint_version": m.version.id})
        del tensors
        files.append(path)
        weight_map.update({w.key: name for w in group})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(w.nbytes for w in weights), "forkpoint_version": m.version.id},
                 "weight_map": dict(sorted(weight_map.items()))}
        files.append(_write_json(os.path.join(directory, "model.safetensors.index.json"), index))
    files += _write_config(m, directory, configs)
    return files


def _tensors(repo: Repo, vid: str, group: list[Weight]) -> dict:
    """{key: contiguous CPU tensor} of one shard, read from the repository in one load."""
    import numpy as np
    import torch

    tree = repo.load(vid, paths=[w.path for w in group])
    out = {}
    for w in group:
        value = tree
        for key in w.keys:
            value = value[key]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        out[w.key] = value.detach().contiguous()
    return out


def parse_size(text: str) -> int:
    """Bytes of "5GB", "500MB", "2GiB" or "1000000" (decimal units as Hugging Face's, binary with i)."""
    units = {"": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
    t = text.strip().upper()
    digits = t.rstrip("KMGTIB")
    unit = t[len(digits):]
    try:
        value = float(digits) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(f"a size is a number with an optional unit (5GB, 500MB, 2GiB), got {text!r}") from None
    if value < 1:
        raise ValueError(f"a shard size must be at least one byte, got {text!r}")
    return int(value)


def _config_sources(config: str | None) -> list[tuple[str, str]]:
    """[(source, file name in the export)] of `config`: a config.json, or a directory holding
    config.json (and perhaps generation_config.json); FileNotFoundError when there is none."""
    if config is None:
        return []
    if not os.path.isdir(config):
        sources = [(config, "config.json")] if os.path.isfile(config) else []
    else:
        sources = [(os.path.join(config, n), n) for n in ("config.json", "generation_config.json")
                   if os.path.isfile(os.path.join(config, n))]
    if not any(name == "config.json" for _, name in sources):
        raise FileNotFoundError(f"no config.json at {config}: give --config a config.json or a model directory")
    return sources


def _write_config(m: Manifest, directory: str, sources: list[tuple[str, str]]) -> list[str]:
    """Copy `sources` into `directory`; with none, config.json from the version's hf_config
    meta (what the Transformers plug-in records), else nothing."""
    copied = []
    for src, name in sources:
        copied.append(os.path.join(directory, name))
        shutil.copyfile(src, copied[-1])
    if not sources and isinstance(m.version.meta.get("hf_config"), dict):
        copied.append(_write_json(os.path.join(directory, "config.json"), m.version.meta["hf_config"]))
    return copied


def _write_json(path: str, data: dict) -> str:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return path
