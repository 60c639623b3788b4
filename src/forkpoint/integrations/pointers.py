"""Pointer files: a framework that thinks in checkpoint paths gets a small JSON file at each
path naming the forkpoint version that holds the checkpoint."""

import json
import os
import re

POINTER_KIND = "forkpoint.pointer"


def tag_for(path) -> str:
    """A tag name made from a checkpoint path's file name ("epoch=1-step=8.ckpt" -> "epoch-1-step-8")."""
    stem = os.path.basename(str(path).rstrip("/"))
    stem = stem[:-5] if stem.endswith(".ckpt") else stem
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:120] or "checkpoint"
    return name if name[0].isalnum() else f"c{name}"


def write_pointer(path, repo_url: str, version_id: str, tag: str | None) -> None:
    """Write the pointer file at `path` (atomically: temp file, fsync, rename)."""
    path = str(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"format": POINTER_KIND, "repo": repo_url, "version": version_id, "tag": tag}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_pointer(path) -> dict | None:
    """The pointer record at `path`, or None when it is not a forkpoint pointer file."""
    path = str(path)
    if not os.path.isfile(path) or os.path.getsize(path) > 65536:
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) and record.get("format") == POINTER_KIND else None


def resolve(path_or_ref) -> str:
    """The version a checkpoint "path" stands for: the pointer's version, else the string
    itself taken as a ref (branch, tag, version id, main~2)."""
    record = read_pointer(path_or_ref)
    if record is not None:
        version = str(record.get("version", ""))
        if not re.fullmatch(r"[0-9a-f]{4,64}", version):
            raise ValueError(f"pointer file {path_or_ref} names an invalid version {version!r}")
        return version
    return str(path_or_ref)
