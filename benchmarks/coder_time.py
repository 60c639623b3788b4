"""Where the lossless codec's encode time goes: each plane coder's share, on compression.py's data.

Each part of the GPT-2 state at the last step (and the whole state's XOR deltas against 1, 10
and 50 steps earlier) is coded as a save splits it (compression.save_units), one thread, with
layouts chosen afresh and with layouts reused; the plane coders are timed where the codec calls
them. Prints, per buffer, MB/s and ratio, and per coder its share of the time, its share of
the bytes, its MB/s of plane bytes and its ratio on them (minimum of --repeats runs).

    .venv/bin/python benchmarks/coder_time.py --dir /work/bench-comp --dtypes bfloat16
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compression import LAGS, PARTS, load_or_train, save_units, tensor_shapes, tensor_split  # noqa: E402
import harness  # noqa: E402

CODERS = {1: "zstd", 2: "Huffman", 3: "runs", 4: "seven-bit", 5: "sparse"}


def timed_encodes(fc, units: list, itemsize: int, layouts: list | None) -> tuple[float, int, dict]:
    """(seconds, coded bytes, {coder: [seconds, plane bytes, coded bytes]}) of one pass."""
    per_coder: dict = {}
    plain = fc.encode_plane
    depth = [0]

    def timed(plane, coder, block=0):
        if depth[0]:  # a coder's own inner coding (a sparse plane's bitmap and bytes) is its time
            return plain(plane, coder, block)
        depth[0] += 1
        start = time.perf_counter()
        try:
            out = plain(plane, coder, block)
        finally:
            depth[0] -= 1
        entry = per_coder.setdefault(coder, [0.0, 0, 0])
        entry[0] += time.perf_counter() - start
        entry[1] += plane.nbytes
        entry[2] += plane.nbytes if out is None else len(out)
        return out
    fc.encode_plane = timed
    try:
        start, coded = time.perf_counter(), 0
        for i, (data, row) in enumerate(units):
            pieces = fc.encode_pieces(data, itemsize, layouts=None if layouts is None else layouts[i], row=row)
            coded += sum(memoryview(p).nbytes for p in pieces)
        return time.perf_counter() - start, coded, per_coder
    finally:
        fc.encode_plane = plain


def main() -> None:
    ap = harness.arguments(__doc__.split("\n")[0], dir_default="/tmp/forkpoint-bench-compression", dir_help="compression.py's cache", repeats=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    from forkpoint.codecs import floatcodec as fc
    from forkpoint.codecs.delta import make_delta

    shapes = tensor_shapes()
    print("| dtype | data | layouts | ratio | MB/s 1 thread | per coder: share of time, share of bytes, plane MB/s, ratio | rest of the time |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        itemsize = 2 if dtype == "bfloat16" else 4
        snaps = load_or_train(Path(args.dir), dtype, args.steps, args.batch)
        last = snaps[args.steps]
        cases = [(part, "full", last[part]) for part in PARTS]
        cases += [("all", f"xor delta {lag}", np.concatenate([make_delta("xor", last[p], snaps[args.steps - lag][p], itemsize)
                                                             for p in PARTS])) for lag in LAGS]
        for part, kind, buf in cases:
            units = save_units(buf, tensor_split(shapes, itemsize, len(PARTS) if part == "all" else 1, kind == "full"))
            layouts = [fc.Layouts() for _ in units]
            for (data, row), chosen in zip(units, layouts):
                fc.encode_pieces(data, itemsize, layouts=chosen, row=row)
            for way in ("afresh", "reused"):
                best = min((timed_encodes(fc, units, itemsize, None if way == "afresh" else
                                          [fc.Layouts(l.itemsize, l.segments, 0, l.coded, l.row) for l in layouts])
                            for _ in range(args.repeats)), key=lambda r: r[0])
                seconds, coded, per_coder = best
                shares = "; ".join(f"{CODERS[c]} {100 * t / seconds:.0f}%, {100 * n / buf.nbytes:.0f}%, "
                                   f"{n / t / 1e6:.0f}, x{n / max(k, 1):.2f}"
                                   for c, (t, n, k) in sorted(per_coder.items()) if c in CODERS)
                rest = seconds - sum(t for c, (t, _, _) in per_coder.items() if c in CODERS)
                print(f"| {dtype} | {part} {kind} | {way} | {buf.nbytes / coded:.3f} | {buf.nbytes / seconds / 1e6:.0f} "
                      f"| {shares} | {100 * rest / seconds:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
