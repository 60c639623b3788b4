"""zstd decompression bounded by the size the caller expects, whatever a frame declares.

`ZstdDecompressor.decompress` allocates the content size a frame's header declares, even
past `max_output_size`: a 32 KB frame can ask for gigabytes. Here the declared size is
checked first, and a frame that declares none is read through a bounded stream.
"""

import zstandard


def decompress(payload, size: int) -> bytes:
    """The `size` bytes one zstd frame decompresses to; ValueError when it declares or
    yields any other length."""
    declared = zstandard.frame_content_size(payload)
    if declared >= 0:
        if declared != size:
            raise ValueError(f"a zstd frame declares {declared} bytes where {size} are expected")
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    with zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=False) as reader:
        data = reader.read(size + 1)
    if len(data) != size:
        raise ValueError(f"a zstd frame yields {'more than ' if len(data) > size else ''}"
                         f"{min(len(data), size)} bytes where {size} are expected")
    return data
