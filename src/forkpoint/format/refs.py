"""Ref records: write-once files that move branch heads and tags without read-modify-write.

A ref named N of kind K lives under `refs/K/N/` as records `<seq>.json` (seq zero-padded to
16 digits). The record with the highest seq is current; a new record is published with an
exclusive create, so two writers cannot both publish the same seq.
"""

import json
import re

from ..errors import FormatError
from .manifest import FORMAT_VERSION, check_format
from .validate import is_version_id

REF_KIND = "forkpoint.ref"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REF_EXPR_RE = re.compile(r"^(?P<base>.+?)(?P<ups>(~\d*)*)$")
REPAIR_HINT = ("the ref is damaged: point it at an intact version with `forkpoint branch reset BRANCH REF` "
               "(or `forkpoint tag --force`), after `forkpoint log` shows which")


def check_name(name: str, what: str) -> str:
    """Return `name` if it is a valid branch/tag name, else raise ValueError."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"invalid {what} name {name!r}: use letters, digits, '.', '_' and '-' (max 128), "
            "starting with a letter or digit"
        )
    return name


def record_key(kind: str, name: str, seq: int) -> str:
    """Return the storage key of the ref record `seq` of ref `name`."""
    return f"refs/{kind}/{name}/{seq:016d}.json"


def seq_of(key: str) -> int | None:
    """Return the seq encoded in a record key, or None when the key is not a record."""
    stem = key.rsplit("/", 1)[-1]
    if not stem.endswith(".json") or not stem[:-5].isdigit():
        return None
    return int(stem[:-5])


def encode_record(seq: int, target: str | None, time: float, writer: str) -> bytes:
    """Serialize a ref record; a None target deletes the ref."""
    return json.dumps({
        "format": REF_KIND, "format_version": list(FORMAT_VERSION),
        "seq": seq, "target": target, "time": time, "writer": writer,
    }, sort_keys=True).encode()


def decode_record(data: bytes, where: str, seq: int | None = None) -> dict:
    """Parse a ref record, raising FormatError naming `where` when it is unusable: not JSON,
    not a ref record, a target that is not a version id (or null), or (given the `seq` its key
    names) another seq."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FormatError(f"ref record {where} is not valid JSON; {REPAIR_HINT}") from None
    check_format(record, REF_KIND, f"ref record {where}")
    target = record.get("target")
    if target is not None and not is_version_id(target):
        raise FormatError(f"ref record {where} names {str(target)[:80]!r}, not a version id; {REPAIR_HINT}")
    if seq is not None and record.get("seq") != seq:
        raise FormatError(f"ref record {where} holds seq {str(record.get('seq'))[:40]}, its name says {seq}; "
                          f"{REPAIR_HINT}")
    return record


def parse_ref_expr(expr: str) -> tuple[str, int]:
    """Split `main~2` or `v1~~` into (base, generations back)."""
    m = REF_EXPR_RE.match(expr)
    if not m:
        raise ValueError(f"invalid ref expression {expr!r}")
    ups = 0
    for part in m.group("ups").split("~")[1:]:
        ups += int(part) if part else 1
    return m.group("base"), ups
