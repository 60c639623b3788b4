"""Codecs: chunk bytes into fewer bytes and back (the float-planes codec, zstd, deltas,
opt-in lossy), pure functions of their input: no I/O, no threads of their own, no torch.

The registry names every codec a manifest may record (CODECS, codec_by_id, codec_by_name);
format/ and the engine use them, and nothing here imports anything above errors.
"""

from .registry import CODECS, Codec, codec_by_id, codec_by_name

__all__ = ["CODECS", "Codec", "codec_by_id", "codec_by_name"]
