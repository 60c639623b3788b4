"""The float codec of this checkout against another checkout's, on the compression benchmark's data.

Both codecs encode the same buffers in one process, alternating run by run (this machine's
speed drifts by 10-20% between runs of a script, which hides small changes), with 2 threads
into a reused work array as a save does, with layouts chosen afresh and with the layouts of
the buffer a save before (as `benchmarks/compression.py` describes). Prints ratios and
median MB/s of both; asserts this checkout's payloads round-trip. The other checkout needs its
extension built:

    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/codec_ab.py --other /tmp/base/src --dir /work/bench-comp

With --per-tensor, each buffer is coded as a save of the model's tensors codes it (see
compression.save_units): tensors of 1 MiB or more one encode each, matrices of full snapshots
with their row length where a codec takes one (deltas without), smaller tensors in packs; each
encode spreading its 4 MiB segments over two threads, two encodes at a time (as a save does);
layouts per encode. --mlp does the same on the state of
benchmarks/codecs.py (24 Linear(1024, 1024) layers + AdamW, 20 steps): every weight a chunk.
--huffman times only the native deflate coders, --match-rows only the native row matching,
--decode only decoding (each checkout's own payload).
"""

import concurrent.futures
import glob
import importlib
import inspect
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compression import (PARTS, buffers, encode_units, load_or_train, save_units, tensor_shapes,  # noqa: E402
                         tensor_split, unit_layouts)
import harness  # noqa: E402


CODEC_MODULES = ("floatcodec.py", "planecoders.py", "planeforms.py", "kernels.py", "zstdframe.py")


def other_codec(src: Path):
    """The float codec module of the checkout whose sources are at `src`, imported under its own
    name (as other_forkpoint.codecs.floatcodec, beside that checkout's errors module)."""
    root = Path(tempfile.mkdtemp()) / "other_forkpoint"
    (root / "format").mkdir(parents=True)
    (root / "__init__.py").touch()
    (root / "format" / "__init__.py").touch()
    if (src / "forkpoint/errors.py").exists():
        shutil.copy(src / "forkpoint/errors.py", root)
    for module in CODEC_MODULES:
        if (src / "forkpoint/format" / module).exists():
            shutil.copy(src / "forkpoint/format" / module, root / "format")
    for built in glob.glob(str(src / "forkpoint/codecs/_planes*.so")):
        shutil.copy(built, root / "format")
    sys.path.insert(0, str(root.parent))
    return importlib.import_module("other_forkpoint.codecs.floatcodec")


def main() -> None:
    ap = harness.arguments(__doc__.split("\n")[0], dir_default="/tmp/forkpoint-bench-compression", dir_help="compression.py's cache", repeats=9)
    ap.add_argument("--other", required=True, help="the other checkout's src/ directory, extension built")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--per-tensor", action="store_true", help="code tensor by tensor, as a save does")
    ap.add_argument("--mlp", action="store_true", help="instead: benchmarks/codecs.py's MLP + AdamW state, as a save splits it")
    ap.add_argument("--huffman", action="store_true",
                    help="time only the native deflate coders, one thread, on the planes this codec gives them")
    ap.add_argument("--decode", action="store_true",
                    help="time only decoding, one thread, each checkout its own payload of each buffer")
    ap.add_argument("--match-rows", action="store_true",
                    help="time only the native row matching, one thread, on each full part's rotated top plane")
    args = ap.parse_args()
    from forkpoint.codecs import floatcodec as mine
    codecs = {"other": other_codec(Path(args.other)), "this": mine}
    if args.huffman:
        return huffman_only(codecs, args)
    if args.match_rows:
        return match_rows_only(codecs, args)
    if args.decode:
        return decode_only(codecs, args)
    print("| dtype | data | ratio other / this | MB/s other / this | this / other "
          "| layouts reused: ratio other / this | MB/s other / this | this / other |")
    print("|---|---|---|---|---|---|---|---|")
    if args.mlp:
        return mlp_rows(codecs, args.repeats)
    shapes = tensor_shapes() if args.per_tensor else None
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        for part, kind, buf, previous in buffers(load_or_train(Path(args.dir), dtype, args.steps, args.batch),
                                                 itemsize, args.steps):
            split = tensor_split(shapes, itemsize, len(PARTS) if part == "all" else 1, kind == "full") if shapes else None
            units = save_units(buf, split) if split else [(buf, 0)]
            before = save_units(previous, split) if split else [(previous, 0)]
            compare(codecs, f"{dtype} | {part} {kind}", itemsize, buf, units, before, args.repeats)


def compare(codecs: dict, label: str, itemsize: int, buf: np.ndarray, units: list, before: list, repeats: int) -> None:
    """Print one row: both codecs' ratio and median MB/s on `units` of `buf` (see
    compression.save_units), layouts chosen afresh and reused from `before`, alternating."""
    from forkpoint.codecs import floatcodec as mine

    threads = 2 if len(units) > 1 else 1
    pieces = {key: _pieces(codec, single=len(units) == 1) for key, codec in codecs.items()}
    chosen = {key: unit_layouts(before, itemsize, pieces[key], codec.Layouts) for key, codec in codecs.items()}
    seconds: dict = {}
    sizes: dict = {}
    for _ in range(repeats):
        for key, codec in codecs.items():
            for reused in (False, True):
                start = time.perf_counter()
                sizes[key, reused] = encode_units(pieces[key], itemsize, units, threads, chosen[key] if reused else None)
                seconds.setdefault((key, reused), []).append(time.perf_counter() - start)
    for data, row in units:
        coded = b"".join(bytes(memoryview(p).cast("B")) for p in mine.encode_pieces(data, itemsize, row=row))
        assert bytes(mine.decode(coded, data.nbytes)) == data.tobytes()
    cells = []
    for reused in (False, True):
        ratio = {k: buf.nbytes / sizes[k, reused] for k in codecs}
        speed = {k: buf.nbytes / 1e6 / statistics.median(seconds[k, reused]) for k in codecs}
        cells += [f"{ratio['other']:.3f} / {ratio['this']:.3f}", f"{speed['other']:.0f} / {speed['this']:.0f}",
                  f"{speed['this'] / speed['other']:.2f}"]
    print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def mlp_rows(codecs: dict, repeats: int) -> None:
    """The same comparison on benchmarks/codecs.py's state (24 Linear(1024, 1024) layers and
    AdamW after 20 steps, the layouts from step 19), each part as a save splits it."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("codecs_bench", Path(__file__).parent / "codecs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    train_step, trained_state = bench.train_step, bench.trained_state

    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype, steps=19)
        params = list(state["model"].parameters())

        def parts():
            optim = state["optim"].state
            return {"weights": params, "exp_avg": [optim[p]["exp_avg"] for p in params],
                    "exp_avg_sq": [optim[p]["exp_avg_sq"] for p in params]}
        snap = lambda ts: [t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().copy() for t in ts]  # noqa: E731
        before = {name: snap(ts) for name, ts in parts().items()}
        train_step(state, dtype)
        now = {name: snap(ts) for name, ts in parts().items()}
        itemsize = params[0].element_size()
        shapes = [tuple(p.shape) for p in params]
        split = tensor_split(shapes, itemsize, 1, True)
        for name in now:
            buf, previous = np.concatenate(now[name]), np.concatenate(before[name])
            compare(codecs, f"{str(dtype).removeprefix('torch.')} MLP | {name}", itemsize, buf,
                    save_units(buf, split), save_units(previous, split), repeats)


def _pieces(codec, single: bool):
    """`codec`'s encode as encode_units calls it; a single unit (the whole buffer) is coded
    on 2 threads, as one large chunk is. The row is passed where the codec takes one."""
    params = inspect.signature(codec.encode_pieces).parameters
    takes_row, takes_pmap = "row" in params, "pmap" in params  # a tree with a pmap, not a thread count

    def pieces(data, itemsize, threads, out, layouts, row):
        extra = {"row": row} if takes_row and row else {}
        # the callers pass a thread count or a map over threads (compression.pmap_of); each
        # tree takes one of the two
        n = 2 if single or callable(threads) else threads
        if takes_pmap:
            spread = threads if callable(threads) and not single else (_pool_map(n) if n > 1 else None)
        else:
            spread = n
        return codec.encode_pieces(data, itemsize, spread, out=out, layouts=layouts, **extra)
    return pieces


_POOLS: dict = {}


def _pool_map(threads: int):
    """A map over `threads` threads (one pool per count, kept for the run), as a save's parallel_map spreads one encode."""
    if threads not in _POOLS:
        _POOLS[threads] = concurrent.futures.ThreadPoolExecutor(threads)
    return _POOLS[threads].map


def coded_planes(codec, buf: np.ndarray, itemsize: int) -> dict:
    """{coder: [planes]}: the planes `codec` gives its Huffman (HUFFMAN) and runs (RUNS) coders
    when it encodes `buf` with the layouts it chose on it (one thread)."""
    planes: dict = {}
    plain = codec._encode_plane

    def grab(plane, coder, block=0):
        if coder in (codec.HUFFMAN, codec.RUNS):
            planes.setdefault(coder, []).append(plane.copy())
        return plain(plane, coder, block)
    layouts = codec.Layouts()
    codec.encode_pieces(buf, itemsize, layouts=layouts)
    codec._encode_plane = grab
    try:
        codec.encode_pieces(buf, itemsize, layouts=layouts)
    finally:
        codec._encode_plane = plain
    return planes


def match_rows_only(codecs: dict, args) -> None:
    """One-thread MB/s of both checkouts' native row matching (in place, rows of MATCH_ROW,
    this checkout's reach and least score) on the rotated top plane of each full part,
    alternating; asserts both pick the same rows and leave the same residual."""
    this = codecs["this"]
    print("| dtype | part | plane (MB) | rows matched | MB/s other / this | this / other |")
    print("|---|---|---|---|---|---|")
    for dtype, itemsize, part, kind, buf in each_buffer(args):
        if kind != "full" or part == "all":
            continue
        planes = np.empty((itemsize, buf.nbytes // itemsize), np.uint8)
        this._to_planes(buf, itemsize, True, planes)
        top = planes[-1]
        rows = -(-top.size // this.MATCH_ROW)
        seconds: dict = {}
        results: dict = {}
        for _ in range(args.repeats):
            for key, codec in codecs.items():
                plane, side = top.copy(), np.empty(2 * rows, np.uint8)
                start = time.perf_counter()
                codec._native.match_rows(plane, plane, side, this.MATCH_ROW, this.MATCH_REACH, this.MATCH_LEAST)
                seconds.setdefault(key, []).append(time.perf_counter() - start)
                results[key] = (plane, side)
        assert all(np.array_equal(a, b) for a, b in zip(results["this"], results["other"])), (dtype, part)
        speed = {k: top.nbytes / 1e6 / statistics.median(v) for k, v in seconds.items()}
        matched = np.count_nonzero(results["this"][1][:rows]) / rows
        print(f"| {dtype} | {part} | {top.nbytes / 1e6:.1f} | {matched:.0%} | {speed['other']:.0f} / {speed['this']:.0f} "
              f"| {speed['this'] / speed['other']:.2f} |", flush=True)


def each_buffer(args):
    """(dtype, itemsize, part, kind, bytes) of each buffer compression.py codes, both dtypes."""
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        for part, kind, buf, _ in buffers(load_or_train(Path(args.dir), dtype, args.steps, args.batch),
                                          itemsize, args.steps):
            yield dtype, itemsize, part, kind, buf


def decode_only(codecs: dict, args) -> None:
    """One-thread decode MB/s of each checkout's payload of each buffer (into a reused array),
    alternating; asserts both decode to the buffer."""
    print("| dtype | data | ratio other / this | decode MB/s other / this | this / other |")
    print("|---|---|---|---|---|")
    for dtype, itemsize, part, kind, buf in each_buffer(args):
        payloads = {key: codec.encode(buf, itemsize) for key, codec in codecs.items()}
        out = np.empty(buf.nbytes, np.uint8)
        seconds: dict = {}
        for _ in range(args.repeats):
            for key, codec in codecs.items():
                start = time.perf_counter()
                codec.decode(payloads[key], buf.nbytes, None, out=out)
                seconds.setdefault(key, []).append(time.perf_counter() - start)
                assert np.array_equal(out, buf)
        speed = {k: buf.nbytes / 1e6 / statistics.median(v) for k, v in seconds.items()}
        print(f"| {dtype} | {part} {kind} | {buf.nbytes / len(payloads['other']):.3f} / {buf.nbytes / len(payloads['this']):.3f} "
              f"| {speed['other']:.0f} / {speed['this']:.0f} | {speed['this'] / speed['other']:.2f} |", flush=True)


def huffman_only(codecs: dict, args) -> None:
    """One-thread MB/s and ratio of both native deflate coders (literals only, and with runs)
    on the planes this checkout's codec gives them in each buffer, with the piece size it picks
    for each plane, alternating; asserts both inflate to the plane."""
    import zlib

    this = codecs["this"]
    print("| dtype | data | coder | planes (MB) | ratio other / this | MB/s other / this | this / other |")
    print("|---|---|---|---|---|---|---|")
    for dtype, itemsize, part, kind, buf in each_buffer(args):
        for coder, planes in sorted(coded_planes(this, buf, itemsize).items()):
            runs = coder == this.RUNS
            seconds: dict = {}
            coded: dict = {}
            for _ in range(args.repeats):
                for key, codec in codecs.items():
                    start = time.perf_counter()
                    out = [codec._native.huffman_deflate(p, this._huffman_block(p), runs) for p in planes]
                    seconds.setdefault(key, []).append(time.perf_counter() - start)
                    coded[key] = sum(map(len, out))
                    assert all(zlib.decompress(o, -15) == p.tobytes() for o, p in zip(out, planes))
            nbytes = sum(p.nbytes for p in planes)
            speed = {k: nbytes / 1e6 / statistics.median(v) for k, v in seconds.items()}
            print(f"| {dtype} | {part} {kind} | {'runs' if runs else 'Huffman'} | {nbytes / 1e6:.1f} "
                  f"| {nbytes / coded['other']:.3f} / {nbytes / coded['this']:.3f} "
                  f"| {speed['other']:.0f} / {speed['this']:.0f} | {speed['this'] / speed['other']:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
