"""Pure data, no I/O: manifests, ref records, object headers, state paths (the codecs that
turn chunk bytes into fewer bytes are forkpoint.codecs).

Nothing here imports torch or touches storage, so a reader in any language can follow it.
"""

from .manifest import FORMAT_VERSION, Manifest, Version, check_format
from .objects import OBJECT_HEADER_SIZE, content_hash, pack_header, unpack_header
from .paths import join_path, split_path

__all__ = [
    "FORMAT_VERSION", "Manifest", "Version",
    "check_format", "OBJECT_HEADER_SIZE", "content_hash", "pack_header", "unpack_header",
    "join_path", "split_path",
]
