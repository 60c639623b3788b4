"""Export a version to a plain directory: safetensors files plus JSON for other leaves.

Each top-level key of the state becomes `<key>.safetensors` holding its tensors and
arrays named by their paths below that key, so `model.load_state_dict(load_file("model.safetensors"))`
works for a state saved as {"model": model, ...} (with keep_prefix, by their whole paths);
`state.json` holds the tree with scalars inline and tensors by file and name.
"""

import json
import os

import numpy as np

from ..format.paths import join_path, split_path
from ..repo import Repo
from ..state.flatten import walk_skeleton
from ..state.leaves import is_torch_tensor


def _to_jsonable(value):
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return {"float": repr(value)}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if type(value).__module__ == "torch":
        return {"torch": str(value)}
    if isinstance(value, np.generic):
        return value.item()
    return value


def export_version(repo: Repo, ref: str, directory: str, allow_pickle: bool = False,
                   keep_prefix: bool = False) -> list[str]:
    """Write `ref` under `directory`; return the files written."""
    import torch
    from safetensors.torch import save_file

    m = repo.manifest(ref)
    tree = repo.load(ref, allow_pickle=allow_pickle)
    os.makedirs(directory, exist_ok=True)
    groups: dict[str, dict] = {}
    index: dict[str, object] = {}
    for path, keys, node in walk_skeleton(m.tree):
        value = tree
        for k in keys:
            value = value[k]
        parts = split_path(path) if path else ["state"]
        group = parts[0].replace(os.sep, "_")
        if node.get("t") == "leaf" and (is_torch_tensor(value) or isinstance(value, np.ndarray)):
            t = value if is_torch_tensor(value) else torch.from_numpy(np.ascontiguousarray(value))
            name = path if keep_prefix or len(parts) == 1 else join_path(*parts[1:])
            groups.setdefault(group, {})[name] = t.detach().cpu().contiguous().clone()
            index[path] = {"tensor": name, "file": f"{group}.safetensors"}
        else:
            index[path] = {"value": _to_jsonable(value)}
    files = []
    for group, tensors in groups.items():
        name = os.path.join(directory, f"{group}.safetensors")
        save_file(tensors, name, metadata={"forkpoint_version": m.version.id})
        files.append(name)
    meta = {"version": m.version.summary(), "tree": m.tree, "leaves": index}
    name = os.path.join(directory, "state.json")
    with open(name, "w") as f:
        json.dump(meta, f, indent=1, default=str)
    files.append(name)
    return files
