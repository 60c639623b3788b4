"""Lossless compression of real optimizer state: forkpoint's codec against zstd, zipnn and blosc2.

A GPT-2-style model from a `transformers` config with random weights (vocab 8192, 6 layers,
width 256, context 128) is trained with AdamW on synthetic Zipf-distributed tokens, in fp32
and in pure bf16. At the last step the weights and both Adam moments are compressed by each
method (the same bytes for every method: each part's tensors concatenated), and as XOR deltas
against 1, 10 and 50 steps earlier. "forkpoint (layouts reused)" encodes with the plane layouts
the codec chose on the buffer a save before would have coded (the part at step 149; for the
deltas, the delta from 149 to the snapshot nearest 149 - lag: 140, 140, 100), as a
repository's saves after the first do. "forkpoint" rows encode into a work array reused from
call to call, as a save does (its staging pool's buffer); "forkpoint (fresh work array)" lets
the codec allocate one per call, which pays its page faults every time. "forkpoint as a save
splits it" codes the same bytes as a save of the model's tensors does: tensors of 1 MiB or more
one encode each, matrices with their row length (which lets the codec model their exponents
by rows and columns; deltas without), smaller tensors concatenated into packs, as many encodes
at a time as there are threads, each spreading its chunk's 4 MiB segments over the codec's
threads (a save's writer tasks each encode a chunk that way); "(layouts reused)" as above.
Reports ratio and single- and two-thread encode MB/s, medians of --repeats runs, and the local
disk's direct-write bandwidth measured in the same run.

    .venv/bin/python benchmarks/compression.py --repeats 3 --dir /work/bench-comp
"""

import copy
import functools
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness

import numpy as np

from forkpoint.engine.parallel import pmap_of

PARTS = ("weights", "exp_avg", "exp_avg_sq")
LAGS = (1, 10, 50)


def train(dtype: str, steps: int, batch: int, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Train the model; return {step: {part: uint8 bytes}} at the last step and LAGS before it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=8192, n_layer=6, n_embd=256, n_head=4, n_positions=128)
    model = GPT2LMHeadModel(config)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ranks = np.arange(1, config.vocab_size + 1)
    probs = 1.0 / ranks ** 1.1
    probs /= probs.sum()
    rng = np.random.default_rng(seed)
    wanted = {steps - lag for lag in LAGS} | {steps}
    snaps = {}
    for step in range(1, steps + 1):
        tokens = torch.from_numpy(rng.choice(config.vocab_size, size=(batch, config.n_positions), p=probs))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step in wanted:
            params = [p for p in model.parameters()]
            parts = {"weights": params,
                     "exp_avg": [optim.state[p]["exp_avg"] for p in params],
                     "exp_avg_sq": [optim.state[p]["exp_avg_sq"] for p in params]}
            snaps[step] = {name: np.concatenate([t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
                                                 for t in ts]) for name, ts in parts.items()}
    return snaps


def load_or_train(cache: Path, dtype: str, steps: int, batch: int) -> dict[int, dict[str, np.ndarray]]:
    path = cache / f"gpt2-{dtype}-{steps}-{batch}.npz"
    if not path.exists():
        snaps = train(dtype, steps, batch)
        np.savez(path, **{f"{s}/{p}": a for s, parts in snaps.items() for p, a in parts.items()})
    data = np.load(path)
    snaps: dict[int, dict] = {}
    for key in data.files:
        s, p = key.split("/")
        snaps.setdefault(int(s), {})[p] = data[key]
    return snaps


def methods(itemsize: int, dtype: str) -> dict:
    """name -> (encode(bytes, threads) -> compressed bytes length, decode check or None)."""
    import blosc2
    import zipnn
    import zstandard

    from forkpoint.codecs.registry import codec_for

    fp_codec = codec_for("lossless", itemsize, True)

    def zstd(level):
        return lambda buf, threads: len(zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0).compress(buf))

    def blosc(buf, threads):
        blosc2.set_nthreads(threads)
        return len(blosc2.compress2(buf, typesize=itemsize, clevel=1, codec=blosc2.Codec.ZSTD,
                                    filters=[blosc2.Filter.SHUFFLE]))

    def zipnn_encode(buf, threads):
        z = zipnn.ZipNN(bytearray_dtype=dtype, threads=threads)
        return len(z.compress(bytearray(buf)))

    work: dict[int, np.ndarray] = {}

    def scratch(buf) -> np.ndarray:
        if buf.nbytes not in work:
            work.clear()
            work[buf.nbytes] = np.zeros(buf.nbytes, np.uint8)
        return work[buf.nbytes]

    def forkpoint(buf, threads):
        return sum(memoryview(p).nbytes for p in fp_codec.pieces(memoryview(buf), itemsize, pmap_of(threads), scratch(buf)))

    def forkpoint_fresh(buf, threads):
        return sum(memoryview(p).nbytes for p in fp_codec.pieces(memoryview(buf), itemsize, pmap_of(threads)))

    def forkpoint_reused(buf, threads, layouts):
        return sum(memoryview(p).nbytes for p in fp_codec.pieces(memoryview(buf), itemsize, pmap_of(threads), scratch(buf),
                                                                 layouts=copy.deepcopy(layouts)))

    def forkpoint_units(buf, threads, units, layouts=None):
        return encode_units(fp_codec.pieces, itemsize, units, threads, layouts)

    return {"forkpoint": forkpoint, FRESH: forkpoint_fresh, REUSED: forkpoint_reused, TENSORS: forkpoint_units,
            TENSORS_REUSED: forkpoint_units, "zstd-1": zstd(1), "zstd-3": zstd(3), "zipnn": zipnn_encode,
            "blosc2 shuffle+zstd": blosc}


REUSED = "forkpoint (layouts reused)"
FRESH = "forkpoint (fresh work array)"
TENSORS = "forkpoint as a save splits it"
TENSORS_REUSED = "forkpoint as a save splits it (layouts reused)"
SMALL_LEAF_BYTES, PACK_BYTES = 1 << 20, 16 << 20  # SaveOptions' defaults


def tensor_shapes() -> list[tuple]:
    """The shapes of the model's parameters, in the order `train` concatenates them."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_layer=6, n_embd=256, n_head=4, n_positions=128))
    return [tuple(p.shape) for p in model.parameters()]


def chosen_layouts(previous: np.ndarray, itemsize: int):
    """The Layouts the lossless codec chooses on `previous` (what the next encode reuses)."""
    from forkpoint.codecs.floatcodec import Layouts, encode_pieces

    layouts = Layouts()
    encode_pieces(previous, itemsize, layouts=layouts)
    return layouts


def tensor_split(shapes: list, itemsize: int, parts: int, rows: bool) -> list[tuple[int, int, int]]:
    """(start byte, end byte, row elements) of each tensor of `parts` parts concatenated; row
    elements 0 unless `rows` (a delta chunk is coded without them, as a save does)."""
    split, offset = [], 0
    for _ in range(parts):
        for shape in shapes:
            nbytes = int(np.prod(shape)) * itemsize
            split.append((offset, offset + nbytes, int(np.prod(shape[1:])) if rows and len(shape) > 1 else 0))
            offset += nbytes
    return split


def save_units(buf: np.ndarray, split: list) -> list[tuple[np.ndarray, int]]:
    """(bytes, row elements) of what a save encodes of `buf` cut by `split`: each tensor of
    SMALL_LEAF_BYTES or more as its own chunk, the smaller ones concatenated into packs of up
    to PACK_BYTES (copies, as a save's capture makes them) coded without rows."""
    units, pack, packed = [], [], 0
    for start, end, row in split:
        if end - start >= SMALL_LEAF_BYTES:
            units.append((buf[start:end], row))
            continue
        pack.append(buf[start:end])
        packed += end - start
        if packed >= PACK_BYTES:
            units.append((np.concatenate(pack), 0))
            pack, packed = [], 0
    if pack:
        units.append((np.concatenate(pack), 0))
    return units


def unit_layouts(previous: list, itemsize: int, pieces, layouts_class) -> list:
    """The Layouts (of `layouts_class`) chosen on each unit of `previous` by `pieces` (see
    encode_units): what the next save reuses."""
    chosen = []
    for data, row in previous:
        chosen.append(layouts_class())
        pieces(memoryview(data), itemsize, 1, None, chosen[-1], row)
    return chosen


def encode_units(pieces, itemsize: int, units: list, threads: int, layouts=None, work=None) -> int:
    """Coded bytes of `units` (see save_units), each encoded by
    `pieces(data, itemsize, threads, scratch, layouts, row)` (its segments over the codec's
    `threads`), `threads` of them at a time, as a save's writer tasks do; copies of `layouts`
    (one per unit) are reused when given."""
    layouts = copy.deepcopy(layouts) if layouts is not None else [None] * len(units)
    work = work if work is not None else _unit_work(units)

    def one(i):
        data, row = units[i]
        return sum(memoryview(p).nbytes for p in pieces(memoryview(data), itemsize, pmap_of(threads), work[i], layouts[i], row))
    if threads == 1:
        return sum(map(one, range(len(units))))
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, range(len(units))))


_work: dict = {}


def _unit_work(units: list) -> list:
    """A reused work array per unit (a save's staging buffers keep their pages)."""
    key = tuple(data.nbytes for data, _ in units)
    if key not in _work:
        _work.clear()
        _work[key] = [np.zeros(data.nbytes, np.uint8) for data, _ in units]
    return _work[key]


def measure(encode, buf: np.ndarray, threads: int, repeats: int) -> tuple[float, float]:
    """(ratio, MB/s) medians over `repeats`."""
    sizes, speeds = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        size = encode(buf, threads)
        speeds.append(buf.nbytes / (time.perf_counter() - start) / 1e6)
        sizes.append(size)
    return buf.nbytes / statistics.median(sizes), statistics.median(speeds)


def disk_bandwidth(directory: Path, nbytes: int = 1 << 30) -> float:
    """GB/s of dd if=/dev/zero bs=16M oflag=direct conv=fsync into `directory`."""
    target = directory / "dd.bin"
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={nbytes >> 24}",
                    "oflag=direct", "conv=fsync"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    target.unlink()
    return nbytes / seconds / 1e9


def decode_speed(buf: np.ndarray, itemsize: int, threads: int, repeats: int) -> float:
    """Median MB/s of decoding forkpoint's encoding of `buf` (what a restore pays)."""
    from forkpoint.codecs import floatcodec

    coded = floatcodec.encode(buf, itemsize)
    speeds = []
    for _ in range(repeats):
        start = time.perf_counter()
        floatcodec.decode(coded, buf.nbytes, pmap_of(threads))
        speeds.append(buf.nbytes / (time.perf_counter() - start) / 1e6)
    return statistics.median(speeds)


def check_round_trip(buf: np.ndarray, itemsize: int) -> None:
    from forkpoint.codecs.registry import codec_for

    codec = codec_for("lossless", itemsize, True)
    back = codec.decode(codec.encode(memoryview(buf), itemsize), buf.nbytes)
    assert bytes(back) == buf.tobytes(), "forkpoint's lossless codec must round-trip bit-exactly"


def buffers(snaps: dict, itemsize: int, steps: int) -> list:
    """(part, data, bytes, the same bytes a save before) for each case the benchmark codes: each
    part and the whole state at the last step, and XOR deltas of the whole state against LAGS
    steps earlier (the save before: the delta from steps - 1 to the snapshot nearest
    steps - 1 - lag)."""
    from forkpoint.codecs.delta import make_delta

    last, before = snaps[steps], snaps[steps - 1]
    cases = [(part, "full", last[part], before[part]) for part in PARTS]
    cases.append(("all", "full", np.concatenate([last[p] for p in PARTS]),
                  np.concatenate([before[p] for p in PARTS])))
    for lag in LAGS:
        base = snaps[steps - lag]
        earlier = snaps[min((s for s in snaps if s < steps - 1), key=lambda s: abs(s - (steps - 1 - lag)))]
        delta = np.concatenate([make_delta("xor", last[p], base[p], itemsize) for p in PARTS])
        previous = np.concatenate([make_delta("xor", before[p], earlier[p], itemsize) for p in PARTS])
        cases.append(("all", f"xor delta {lag} step{'s' if lag > 1 else ''}", delta, previous))
    return cases


def main() -> None:
    ap = harness.arguments(__doc__.split("\n")[0], repeats=3, dir_default="/tmp/forkpoint-bench-compression")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--methods", help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--no-repo", action="store_true", help="skip the repository rows")
    ap.add_argument("--pack-layouts-ab", type=int, metavar="SAVES",
                    help="instead: SAVES saves of one leaf per tensor into two lossless repositories, "
                         "packs keeping their layouts or choosing afresh, alternating")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    cache = Path(args.dir)
    cache.mkdir(parents=True, exist_ok=True)
    if args.pack_layouts_ab:
        return pack_layouts_ab(cache, args)
    results = {"disk_GBps": statistics.median(disk_bandwidth(cache) for _ in range(3)), "rows": []}
    print(f"local disk, dd oflag=direct: {results['disk_GBps']:.2f} GB/s")
    shapes = tensor_shapes()
    from forkpoint.codecs.registry import codec_for
    from forkpoint.codecs.floatcodec import Layouts
    for dtype in args.dtypes.split(","):
        snaps = load_or_train(cache, dtype, args.steps, args.batch)
        itemsize = 4 if dtype == "float32" else 2
        cases = buffers(snaps, itemsize, args.steps)
        table = methods(itemsize, dtype)
        fp_codec = codec_for("lossless", itemsize, True)
        if args.methods:
            table = {name: table[name] for name in args.methods.split(",")}
        print(f"\n{dtype}: {sum(snaps[args.steps][p].nbytes for p in PARTS) / 1e6:.1f} MB of state")
        print("| part | data | method | ratio | MB/s 1 thread | MB/s 2 threads |")
        print("|---|---|---|---|---|---|")
        for part, kind, buf, previous in cases:
            check_round_trip(buf, itemsize)
            results.setdefault("decode", []).append(
                {"dtype": dtype, "part": part, "data": kind, "MBps_1": decode_speed(buf, itemsize, 1, args.repeats),
                 "MBps_2": decode_speed(buf, itemsize, 2, args.repeats)})
            split = tensor_split(shapes, itemsize, len(PARTS) if part == "all" else 1, kind == "full")
            units = save_units(buf, split)
            for name, encode in table.items():
                if name == REUSED:
                    encode = functools.partial(encode, layouts=chosen_layouts(previous, itemsize))
                if name in (TENSORS, TENSORS_REUSED):
                    chosen = (unit_layouts(save_units(previous, split), itemsize, fp_codec.pieces, Layouts)
                              if name == TENSORS_REUSED else None)
                    encode = functools.partial(encode, units=units, layouts=chosen)
                ratio, one = measure(encode, buf, 1, args.repeats)
                _, two = measure(encode, buf, 2, args.repeats)
                row = {"dtype": dtype, "part": part, "data": kind, "method": name, "ratio": ratio,
                       "MBps_1": one, "MBps_2": two}
                results["rows"].append(row)
                print(f"| {part} | {kind} | {name} | {ratio:.3f} | {one:.0f} | {two:.0f} |", flush=True)
    for dtype in ([] if args.no_repo else args.dtypes.split(",")):
        repo_rows(results, cache, dtype, load_or_train(cache, dtype, args.steps, args.batch), args.steps)
    summarize(results)
    print("\n| dtype | part | data | forkpoint decode MB/s 1 thread | 2 threads |")
    print("|---|---|---|---|---|")
    for r in results.get("decode", []):
        print(f"| {r['dtype']} | {r['part']} | {r['data']} | {r['MBps_1']:.0f} | {r['MBps_2']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def repo_rows(results: dict, cache: Path, dtype: str, snaps: dict, steps: int) -> None:
    """Save the snapshots in step order to a repository with codec="lossless" and deltas on,
    as a training script would: one leaf per tensor of each part, in the model's shapes (so
    small tensors go to packs); report each version's stored bytes against its logical bytes."""
    import shutil

    import torch

    import forkpoint as fp

    path = cache / f"repo-{dtype}"
    shutil.rmtree(path, ignore_errors=True)
    repo = fp.Repo(str(path), create=True, codec="lossless", delta=fp.Delta(max_chain=10))
    itemsize = 4 if dtype == "float32" else 2
    shapes = tensor_shapes()
    split = tensor_split(shapes, itemsize, 1, True)

    def state(step):
        return tensor_state(snaps, step, dtype, shapes, split)

    print(f"\n{dtype}: repository with codec='lossless', delta=fp.Delta(), one leaf per tensor")
    print("| step | stored as | logical MB | stored MB | ratio | save (s) |")
    print("|---|---|---|---|---|---|")
    for step in sorted(snaps):
        tensors = state(step)
        start = time.perf_counter()
        v = repo.save(tensors, step=step)
        seconds = time.perf_counter() - start
        kinds = {"delta" if c.delta else "full" for leaf in repo.manifest(v.id).leaves for c in leaf.chunks}
        ratio = v.logical_bytes / v.stored_bytes
        results.setdefault("repo", []).append({"dtype": dtype, "step": step, "logical": v.logical_bytes,
                                               "stored": v.stored_bytes, "kinds": sorted(kinds), "seconds": seconds})
        print(f"| {step} | {'+'.join(sorted(kinds))} | {v.logical_bytes / 1e6:.1f} | {v.stored_bytes / 1e6:.1f} "
              f"| {ratio:.2f} | {seconds:.2f} |")
    for step in sorted(snaps):
        got = repo.load(f"main~{len(snaps) - 1 - sorted(snaps).index(step)}")
        assert all(torch.equal(got[k], t) for k, t in state(step).items())
    repo.close()


def tensor_state(snaps: dict, step: int, dtype: str, shapes: list, split: list) -> dict:
    """{part/index: tensor} of snapshot `step`, one leaf per tensor in the model's shapes."""
    import torch

    return {f"{p}/{i}": torch.from_numpy(snaps[step][p][start:end].copy()).view(getattr(torch, dtype)).reshape(shape)
            for p in PARTS for i, ((start, end, _), shape) in enumerate(zip(split, shapes))}


def pack_layouts_ab(cache: Path, args) -> None:
    """Save time of the GPT-2 state (one leaf per tensor, most of it in float packs; the
    lowest bit of each element flipped at random so that every save writes new objects) into
    two repositories, alternating: packs reusing the codec's layouts from save to save (the
    default), or choosing afresh every save (their slot made unique per save)."""
    import shutil

    import torch

    from forkpoint.engine import objectwriter as save_module

    real_put = save_module.ObjectWriter.put
    fresh = {"on": False, "n": 0}

    def put(self, *a, slot=None, **kw):
        if fresh["on"] and slot is not None and slot[0] == "pack":
            fresh["n"] += 1
            slot = (*slot, fresh["n"])
        return real_put(self, *a, slot=slot, **kw)
    save_module.ObjectWriter.put = put
    print("| dtype | packs' layouts | median save (s) | saves | stored MB |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        snaps = load_or_train(cache, dtype, args.steps, args.batch)
        itemsize = 4 if dtype == "float32" else 2
        shapes = tensor_shapes()
        split = tensor_split(shapes, itemsize, 1, True)
        steps = sorted(snaps)
        repos = {way: harness.repo(str(cache / f"ab-{way}"), unpaced=True, codec="lossless")
                 for way in ("kept", "afresh")}
        times: dict = {way: [] for way in repos}
        words = {2: torch.int16, 4: torch.int32}[itemsize]
        for i in range(args.pack_layouts_ab):
            state = tensor_state(snaps, steps[i % len(steps)], dtype, shapes, split)
            for t in state.values():  # new bytes every save (nothing deduplicates), same statistics
                t.view(words).bitwise_xor_(torch.randint(0, 2, t.shape, dtype=words))
            for way in (("kept", "afresh") if i % 2 else ("afresh", "kept")):
                fresh["on"] = way == "afresh"
                start = time.perf_counter()
                repos[way].save(state, step=i)
                times[way].append(time.perf_counter() - start)
        for way, repo in repos.items():
            stored = repo.log(limit=1)[0].stored_bytes / 1e6
            print(f"| {dtype} | {way} | {statistics.median(times[way][1:]):.3f} | {len(times[way]) - 1} | {stored:.1f} |")
            repo.close()
            shutil.rmtree(cache / f"ab-{way}", ignore_errors=True)
    save_module.ObjectWriter.put = real_put


def summarize(results: dict) -> None:
    """Print, per dtype and part, forkpoint's ratio against the best other method, and its
    two-thread encode speed against the disk."""
    print("\n| dtype | part | forkpoint ratio | best other | ratio / best other | forkpoint MB/s (2 threads) / disk |")
    print("|---|---|---|---|---|---|")
    keys = sorted({(r["dtype"], r["part"], r["data"]) for r in results["rows"]})
    for dtype, part, data in keys:
        rows = [r for r in results["rows"] if (r["dtype"], r["part"], r["data"]) == (dtype, part, data)]
        mine = next(r for r in rows if r["method"] == "forkpoint")
        others = [r for r in rows if not r["method"].startswith("forkpoint")]
        other = max(others, key=lambda r: r["ratio"]) if others else {"method": "-", "ratio": float("nan")}
        print(f"| {dtype} | {part} {data} | {mine['ratio']:.3f} | {other['method']} {other['ratio']:.3f} | "
              f"{mine['ratio'] / other['ratio']:.3f} | {mine['MBps_2'] / 1e3 / results['disk_GBps']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
