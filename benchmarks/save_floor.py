"""What raw and lossless saves to local disk spend, part by part, against the saves themselves.

State: the codecs.py MLP (24 x Linear(1024, 1024) + AdamW, 20 steps), in fp32 and in bf16.
Each part is measured alone on the state's large tensors (1 MiB or more), medians of runs:
- the float codec on one thread and on every core this process may use (each chunk reusing
  the layouts its last encode chose, as a repository's saves do; they choose afresh every
  8th save, which this leaves out);
- blake3 block hashing (what names an object) and a plain copy;
- writing the raw and the encoded objects through LocalStore (O_DIRECT, fsync, rename) from
  six threads, as a save's I/O slots do, then the directory barrier of a commit.
Then raw and lossless saves into a repository on the same disk, one training step before
each, and saves of as many leaves of 64 KiB each, stored as an object each (what a save spends
per object whatever its size: bookkeeping, file creation, fsync, rename). The last lines set
the lossless save's CPU, spread over every core, against the raw save's time.

    python benchmarks/save_floor.py --repeats 7 --dir /work
    python benchmarks/codecs.py --repeated-saves --cores 1,2   # the saves alone, per core count
"""

import importlib.util
import os
import shutil
import statistics
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import forkpoint as fp
from forkpoint.codecs import floatcodec
from forkpoint.format.objects import block_digests
from forkpoint.engine.save import SaveOptions
from forkpoint.storage.local import LocalStore

_spec = importlib.util.spec_from_file_location("codecs_bench", os.path.join(os.path.dirname(__file__), "codecs.py"))
codecs_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codecs_bench)  # benchmarks/codecs.py: its name is the standard library's
timed, train_step, trained_state = codecs_bench.timed, codecs_bench.train_step, codecs_bench.trained_state
from tiers_restore import state_tensors  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WRITERS = 6


def large_tensors(state) -> list[torch.Tensor]:
    """The model's and optimizer's tensors of 1 MiB or more."""
    return [t for t in state_tensors(state["model"], state["optim"]) if t.numel() * t.element_size() >= 1 << 20]


def on_threads(threads: int, fn, items: list) -> None:
    """`fn(item)` for every item, the items dealt round-robin to `threads` threads."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: [fn(x) for x in items[k::threads]], range(threads)))


def parts(chunks: list, store: LocalStore, cores: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{part: (median seconds, median core-seconds)} of each part of a save, done alone."""
    layouts = [floatcodec.Layouts() for _ in chunks]
    scratch = [np.empty(c["bytes"].nbytes, np.uint8) for c in chunks]
    copies = [np.empty(c["bytes"].nbytes, np.uint8) for c in chunks]
    encoded: dict[int, list] = {}

    def encode(i: int) -> None:
        c = chunks[i]
        layouts[i].uses = min(layouts[i].uses, 1)
        encoded[i] = floatcodec.encode_pieces(c["bytes"], c["itemsize"], out=scratch[i],
                                              layouts=layouts[i], row=c["row"])

    def write_all(payloads: list) -> None:
        keys = []

        def one(pieces):
            key = f"objects/{uuid.uuid4().hex[:2]}/{uuid.uuid4().hex}"
            store.write(key, pieces)
            keys.append(key)
        on_threads(WRITERS, one, payloads)
        store.barrier(keys)

    indices = list(range(len(chunks)))
    on_threads(1, encode, indices)
    work = {
        "encode, 1 thread": lambda: on_threads(1, encode, indices),
        f"encode, {cores} threads": lambda: on_threads(cores, encode, indices),
        "hash, 1 thread": lambda: on_threads(1, lambda c: block_digests(c["bytes"]), chunks),
        f"hash, {cores} threads": lambda: on_threads(cores, lambda c: block_digests(c["bytes"]), chunks),
        "copy, 1 thread": lambda: [np.copyto(d, c["bytes"]) for d, c in zip(copies, chunks)],
        f"write raw objects, {WRITERS} threads": lambda: write_all([[c["bytes"]] for c in chunks]),
        f"write encoded objects, {WRITERS} threads": lambda: write_all([encoded[i] for i in indices]),
    }
    runs: dict[str, list] = {name: [] for name in work}
    for _ in range(repeats):
        for name, fn in work.items():
            runs[name].append(timed(fn)[1:])
    return {name: tuple(statistics.median(r[k] for r in rs) for k in (0, 1)) for name, rs in runs.items()}


def saves(state, dtype, count: int, scratch: str, repeats: int) -> dict[str, tuple[float, float]]:
    """{kind: (median seconds, median core-seconds)} of raw and lossless saves of the state to
    disk, a training step before each, and of `count` leaves of 64 KiB each stored as its own
    object (what a save spends per object whatever its size), the kinds in turn."""
    small = {f"leaf{i}": torch.randn((64 << 10) // dtype.itemsize, dtype=dtype) for i in range(count)}
    repos, runs = {}, {}
    for codec in ("raw", "lossless"):
        repos[f"{codec} save"] = (fp.Repo(os.path.join(scratch, f"repo-{codec}"), create=True, codec=codec), state)
        repos[f"{codec} save of {count} leaves of 64 KiB"] = (
            fp.Repo(os.path.join(scratch, f"small-{codec}"), create=True, codec=codec,
                    options=SaveOptions(small_leaf_bytes=0)), small)
    for rep in range(repeats + 1):
        for kind, (repo, saved) in repos.items():
            if saved is state:
                train_step(state, dtype)
            else:
                for t in small.values():
                    t.add_(1e-2)
            _, elapsed, core_s = timed(lambda: repo.save(saved))
            repo.drain()
            if rep:
                runs.setdefault(kind, []).append((elapsed, core_s))
    for repo, _ in repos.values():
        repo.close()
    return {kind: tuple(statistics.median(r[k] for r in rs) for k in (0, 1)) for kind, rs in runs.items()}


def main():
    ap = harness.arguments(__doc__, repeats=7, dir_help="where the repositories and objects go (a local disk)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    scratch = harness.scratch(args.dir, prefix="fp-floor-")
    print(f"forkpoint from {os.path.dirname(fp.__file__)}, {cores} cores, {scratch}\n")
    print("| dtype | part | wall (s) | CPU (core-s) | GB/s of the state's bytes |")
    print("|---|---|---|---|---|")
    summary = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            state = trained_state(dtype)
            chunks = [{"bytes": t.view(torch.uint8).numpy().reshape(-1), "itemsize": t.element_size(),
                       "row": t.shape[-1] if t.dim() == 2 else 0} for t in large_tensors(state)]
            total = sum(c["bytes"].nbytes for c in chunks)
            store = LocalStore(os.path.join(scratch, "objects"))
            measured = {**parts(chunks, store, cores, args.repeats),
                        **saves(state, dtype, len(chunks), scratch, args.repeats)}
            shutil.rmtree(store.root, ignore_errors=True)
            name = str(dtype).removeprefix("torch.")
            for part, (wall, core_s) in measured.items():
                rate = "" if "leaves of 64 KiB" in part else f"{total / wall / 1e9:.2f}"
                print(f"| {name} | {part} | {wall:.3f} | {core_s:.3f} | {rate} |")
            raw, lossless = measured["raw save"], measured["lossless save"]
            summary.append(f"{name}: {len(chunks)} tensors, {total / 1e6:.0f} MB; the lossless save's CPU over "
                           f"{cores} cores takes {lossless[1] / cores:.3f} s at best, the raw save took {raw[0]:.3f} s "
                           f"(lossless took {lossless[0]:.3f} s, {lossless[0] / raw[0]:.2f}x)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
