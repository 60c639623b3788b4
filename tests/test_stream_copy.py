"""Streaming copies (storage/_stream.c): exact at every size and alignment, refusing bad
buffers, chosen by FORKPOINT_PORTABLE_KERNELS like the codec's kernels."""

import platform

import numpy as np
import pytest

from forkpoint.storage import streamcopy

native = pytest.mark.skipif(streamcopy._stream is None, reason="the native streaming copy is not built")


@pytest.mark.parametrize("use_kernel", [True, False])
def test_copies_are_exact_at_every_size_and_alignment(monkeypatch, use_kernel):
    if use_kernel and streamcopy._stream is None:
        pytest.skip("the native streaming copy is not built")
    monkeypatch.setattr(streamcopy, "STREAM_MIN_BYTES", 0 if use_kernel else 1 << 62)
    calls = []
    if use_kernel:
        real = streamcopy._stream.copy
        monkeypatch.setattr(streamcopy, "_stream", type("K", (), {"copy": staticmethod(
            lambda d, s: (calls.append(s.nbytes), real(d, s)))}))
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, (1 << 20) + 300, dtype=np.uint8)
    for size in (0, 1, 15, 16, 17, 63, 64, 65, 127, 4096 + 5, (1 << 20) + 37):
        for src_at, dst_at in ((0, 0), (1, 0), (0, 3), (5, 11), (16, 48)):
            target = np.full(size + dst_at + 70, 0xAB, np.uint8)
            streamcopy.stream_copy(target[dst_at:dst_at + size], source[src_at:src_at + size])
            assert np.array_equal(target[dst_at:dst_at + size], source[src_at:src_at + size]), (size, src_at, dst_at)
            assert (target[:dst_at] == 0xAB).all() and (target[dst_at + size:] == 0xAB).all(), "nothing around it written"
    assert len(calls) == (55 if use_kernel else 0)


def test_strided_or_small_copies_go_through_numpy(monkeypatch):
    monkeypatch.setattr(streamcopy, "_stream", type("K", (), {"copy": staticmethod(
        lambda d, s: pytest.fail("the streaming kernel took a copy it cannot do"))}))
    a = np.arange(4 << 20, dtype=np.uint8)
    out = np.zeros(2 << 20, np.uint8)
    streamcopy.stream_copy(out, a[::2])
    assert np.array_equal(out, a[::2])
    small = np.zeros(100, np.uint8)
    streamcopy.stream_copy(small, a[:100])
    assert np.array_equal(small, a[:100])


@native
def test_the_kernel_refuses_unequal_lengths_and_read_only_targets():
    src = np.ones(64, np.uint8)
    with pytest.raises(ValueError, match="64 bytes into a buffer of 63"):
        streamcopy._stream.copy(np.zeros(63, np.uint8), src)
    frozen = np.zeros(64, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, BufferError)):
        streamcopy._stream.copy(frozen, src)
    with pytest.raises(TypeError):
        streamcopy._stream.kernel("x")


@native
@pytest.mark.parametrize("setting, expected", [(None, "sse2"), ("0", "sse2"), ("avx512", "sse2"), ("1", "portable")])
def test_portable_kernels_setting_keeps_plain_copies(kernels_setting, setting, expected):
    if platform.machine() not in ("x86_64", "AMD64"):
        expected = "portable"
    code = ("import numpy as np; from forkpoint.storage import streamcopy as s; "
            "a = np.arange(3 << 20, dtype=np.uint8); b = np.zeros_like(a); s.stream_copy(b, a); "
            "assert np.array_equal(a, b); print(s._stream.kernel())")
    assert kernels_setting(setting, code).strip() == expected
