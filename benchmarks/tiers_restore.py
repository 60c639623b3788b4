"""Restore speed per tier, peak memory of an asynchronous save, and every-step memory-tier saves.

1. Restore of the ~1.5 GB state from local disk with a cold page cache (dropped before
   each load when permitted) against `dcp.load`, and from the memory tier against a plain
   `copy_` of every tensor.
2. Peak extra resident memory during an asynchronous save with a staging budget B.
3. Flush of a version from a /dev/shm tier to local disk, against dd oflag=direct.
4. A training loop that checkpoints every step into a memory tier (keep=2), flushing every
   10th version to disk, against the same loop without checkpoints.
5. The capture of an asynchronous save to local disk (from `save(sync=False)` until the live
   tensors may change): copies with streaming stores against numpy's copy, alternating.

    python benchmarks/tiers_restore.py --repeats 3
"""

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings

import torch

import forkpoint as fp
from forkpoint.engine import SaveOptions
from forkpoint.storage.memory import MemoryStore

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from persist_throughput import dd  # noqa: E402
from save_load import make_state  # noqa: E402
from train_overhead import build, train_step, WIDTH  # noqa: E402


warnings.filterwarnings("ignore")


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self):
        self.peak, self.stop = rss(), False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def restore_section(model, opt, nbytes, scratch, repeats):
    import torch.distributed.checkpoint as dcp

    disk = os.path.join(scratch, "disk")
    repo = fp.Repo(disk, create=True)
    repo.save({"model": model, "optim": opt})
    repo.close()
    dcp_dir = os.path.join(scratch, "dcp")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=dcp_dir)
    mem_repo = fp.Repo(f"mem://{uuid.uuid4().hex}", create=True)
    mem_repo.save({"model": model, "optim": opt})
    tensors = list(model.state_dict().values()) + [t for s in opt.state_dict()["state"].values()
                                                   for t in s.values() if t.numel() > 1]
    sources = [t.clone() for t in tensors]
    times = {"forkpoint disk (cold)": [], "dcp.load disk (cold)": [], "forkpoint memory tier": [],
             "plain copy_ of every tensor": []}
    cold = True
    for _ in range(repeats):
        cold &= drop_caches()
        t0 = time.perf_counter()
        r = fp.Repo(disk)
        r.restore({"model": model, "optim": opt}, "main")
        r.close()
        times["forkpoint disk (cold)"].append(time.perf_counter() - t0)
        cold &= drop_caches()
        t0 = time.perf_counter()
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=dcp_dir)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        times["dcp.load disk (cold)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mem_repo.restore({"model": model, "optim": opt}, "main")
        times["forkpoint memory tier"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(tensors, sources):
                dst.copy_(src)
        times["plain copy_ of every tensor"].append(time.perf_counter() - t0)
    mem_repo.close()
    gb = nbytes / 1e9
    print(f"\n### Restore ({gb:.2f} GB, medians of {repeats}; page cache dropped: {cold})\n")
    print("| restore | seconds | GB/s |")
    print("|---|---|---|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {gb / v:.2f} |")
    print(f"\nforkpoint cold / dcp.load cold speed = {med['dcp.load disk (cold)'] / med['forkpoint disk (cold)']:.2f}x; "
          f"memory tier / plain copy speed = {med['plain copy_ of every tensor'] / med['forkpoint memory tier']:.2f}")


def rss_section(model, opt, nbytes, scratch, budget_mb):
    budget = budget_mb << 20
    repo = fp.Repo(os.path.join(scratch, "rss"), create=True,
                   options=SaveOptions(staging_bytes=budget, window_bytes=64 << 20))
    base = rss()
    with PeakRSS() as peak:
        repo.save({"model": model, "optim": opt}, sync=False).wait()
    repo.close()
    extra = peak.peak - base
    print("\n### Peak extra resident memory of an asynchronous save\n")
    print(f"state {nbytes / 1e9:.2f} GB, staging budget B = {budget_mb} MiB: peak extra RSS "
          f"{extra / 2**20:.0f} MiB = B + {(extra - budget) / nbytes * 100:.1f}% of the state "
          f"(target: at most B + 5%)")


def capture_section(model, opt, nbytes, scratch, repeats):
    """Median seconds from `save(sync=False)` to `wait_capture()` of the state, and to the save's
    end, with the captures copying through storage.streamcopy and through np.copyto, alternating
    by round (each save writes new bytes: a step of `add_` before it)."""
    import numpy as np

    from forkpoint.engine import save as save_module
    from forkpoint.storage import streamcopy

    ways = {"streaming stores": streamcopy.stream_copy, "np.copyto": np.copyto}
    repos = {w: fp.Repo(os.path.join(scratch, f"capture-{i}"), create=True) for i, w in enumerate(ways)}
    captures, saves = {w: [] for w in ways}, {w: [] for w in ways}
    try:
        for r in range(repeats + 1):
            for way in (list(ways) if r % 2 else list(ways)[::-1]):
                save_module.stream_copy = ways[way]
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)
                t0 = time.perf_counter()
                pending = repos[way].save({"model": model, "optim": opt}, sync=False)
                pending.wait_capture()
                captured = time.perf_counter() - t0
                pending.wait()
                if r:
                    captures[way].append(captured)
                    saves[way].append(time.perf_counter() - t0)
    finally:
        save_module.stream_copy = streamcopy.stream_copy
        for repo in repos.values():
            repo.close()
    kernel = streamcopy._stream.kernel() if streamcopy._stream is not None else "not built"
    print(f"\n### Capture of an asynchronous save to local disk ({nbytes / 1e9:.2f} GB, medians of {repeats}; "
          f"streaming kernel: {kernel})\n")
    print("| capture copies | capture (s) | whole save (s) |")
    print("|---|---|---|")
    for way in ways:
        print(f"| {way} | {statistics.median(captures[way]):.3f} | {statistics.median(saves[way]):.3f} |")


EVERY_STEP = "every step to memory, every 10th flushed to disk"


def every_step_loop(scratch, steps, params_m, device, batch, checkpointing: bool) -> dict:
    """One run of the loop, `steps` training steps, checkpointing every step into a memory tier
    (keep=2, every 10th version flushed to local disk) when `checkpointing`. Returns wall (with
    closing and draining), loop (the steps alone), median step, per-step durations, process CPU,
    the Checkpointer's build time and the bytes of objects flushed to disk."""
    model, opt = build(params_m, device)
    train_step(model, opt, batch)
    ck, repo, setup, disk = None, None, 0.0, os.path.join(scratch, f"every-{uuid.uuid4().hex}")
    memory = uuid.uuid4().hex  # the memory tier's name, discarded after the loop
    if checkpointing:
        repo = fp.Repo(tiers=[fp.tier(f"mem://{memory}", keep=2, flush_every=10), disk], create=True)
        built = time.perf_counter()
        ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1)
        setup = time.perf_counter() - built
    t0, c0 = time.perf_counter(), os.times()
    durations = []
    for step in range(steps):
        s0 = time.perf_counter()
        train_step(model, opt, batch)
        if ck:
            ck.step(step)
        durations.append(time.perf_counter() - s0)
    loop = time.perf_counter() - t0
    flushed = 0
    if ck:
        ck.close()
        repo.drain()
        repo.close()
        MemoryStore.discard(memory)
    wall, c1 = time.perf_counter() - t0, os.times()
    if ck:
        flushed = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(disk, "objects"))
                      for f in files)
        shutil.rmtree(disk, ignore_errors=True)
    return {"wall": wall, "loop": loop, "median": statistics.median(durations), "durations": durations,
            "cpu": (c1.user - c0.user) + (c1.system - c0.system), "setup": setup, "flushed": flushed,
            "floor": copy_and_hash_seconds(model, opt) if not checkpointing else None}


def every_step_section(scratch, steps, params_m, device="cpu", batch_rows=16):
    if device == "cpu":
        torch.set_num_threads(2)
    batch = torch.randn(batch_rows, WIDTH, generator=torch.Generator().manual_seed(1)).to(device)
    runs = {"no checkpoint": every_step_loop(scratch, steps, params_m, device, batch, False),
            EVERY_STEP: every_step_loop(scratch, steps, params_m, device, batch, True)}
    walls = {k: r["wall"] for k, r in runs.items()}
    loops = {k: r["loop"] for k, r in runs.items()}
    medians = {k: r["median"] for k, r in runs.items()}
    cpu = {k: r["cpu"] for k, r in runs.items()}
    per_step = {k: r["durations"] for k, r in runs.items()}
    floor, setup = runs["no checkpoint"]["floor"], runs[EVERY_STEP]["setup"]
    base = walls["no checkpoint"]
    print(f"\n### Checkpoint every step into the memory tier ({params_m}M params, {steps} steps, "
          f"{device}, batch {batch_rows})\n")
    print("| loop | wall (s) | s/step | slowdown | loop alone (s) | slowdown | median step (s) | median slowdown |")
    print("|---|---|---|---|---|---|---|---|")
    for k, v in walls.items():
        print(f"| {k} | {v:.2f} | {v / steps:.2f} | {(v / base - 1) * 100:.0f}% | {loops[k]:.2f} | "
              f"{(loops[k] / loops['no checkpoint'] - 1) * 100:.0f}% | {medians[k]:.2f} | "
              f"{(medians[k] / medians['no checkpoint'] - 1) * 100:.0f}% |")
    for k, v in per_step.items():
        print(f"\n{k}, each step (s): " + " ".join(f"{d:.2f}" for d in v))
    print("\nwall: the loop, then closing the Checkpointer and draining (the last saves and flush); "
          "loop alone: the training steps with their `ck.step` calls")
    extra = (cpu["every step to memory, every 10th flushed to disk"] - cpu["no checkpoint"]) / steps
    print(f"\nProcess CPU time: {cpu['no checkpoint'] / steps:.2f} core-s per step without checkpoints, "
          f"{extra:.2f} core-s more per step with them ({os.cpu_count()} cores)")
    print(f"\nObjects on disk afterwards (every 10th version flushed, and the last at close): "
          f"{runs[EVERY_STEP]['flushed'] / 1e9:.2f} GB")
    print(f"\nBuilding the Checkpointer (it faults in the memory tier's buffers for keep + 1 "
          f"versions, outside the timed loop): {setup:.2f} s")
    print(f"\nFloor: one copy of the state into host staging memory plus blake3 of it (2 threads), "
          f"with nothing else running: {floor[0]:.3f} s = {floor[0] / medians['no checkpoint'] * 100:.0f}% of a step "
          f"(the copy alone {floor[1]:.3f} s; blake3 alone on one thread {floor[2]:.3f} s)")


def flush_section(model, opt, nbytes, scratch, repeats):
    """Flush of one version from a /dev/shm tier to the local disk tier: forkpoint's copy
    (objects mapped, written with O_DIRECT) against the same flush reading each object into
    memory first (the naive copy, as the baseline), and dd oflag=direct of as many bytes."""
    import resource

    from forkpoint.tiers import movement

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def flush(read_whole: bool) -> tuple[float, float]:
        shm = tempfile.mkdtemp(prefix="fp-flush-", dir="/dev/shm")
        disk = os.path.join(scratch, f"flush-{uuid.uuid4().hex}")
        mapped = movement._source_bytes
        if read_whole:
            movement._source_bytes = lambda src, key: src.read(key)
        try:
            repo = fp.Repo(tiers=[fp.tier(shm, keep=1, flush_every=2), disk], create=True)
            repo.save({"model": model, "optim": opt}, step=0)
            repo.drain()
            t0, c0 = time.perf_counter(), cpu()
            repo.save({"model": model, "optim": opt, "step": 1}, step=1)
            repo.drain()
            return time.perf_counter() - t0, cpu() - c0
        finally:
            movement._source_bytes = mapped
            repo.close()
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)

    runs = {"mapped, O_DIRECT": [], "read into memory first": [], "dd": []}
    for _ in range(repeats):
        runs["mapped, O_DIRECT"].append(flush(False))
        runs["read into memory first"].append(flush(True))
        runs["dd"].append((nbytes / dd(os.path.join(scratch, "dd.bin"), nbytes), 0.0))
    print(f"\n### Flush of a version from a /dev/shm tier to local disk ({nbytes / 1e9:.2f} GB, medians of {repeats})\n")
    print("| flush | seconds (save to shm + flush) | CPU seconds |")
    print("|---|---|---|")
    for k, v in runs.items():
        label = "dd if=/dev/zero oflag=direct, same bytes (write only)" if k == "dd" else f"forkpoint, {k}"
        print(f"| {label} | {statistics.median(x[0] for x in v):.2f} | "
              f"{statistics.median(x[1] for x in v):.2f} |")


def state_tensors(model, opt) -> list:
    """The model's and the optimizer's tensors of more than one element (what a checkpoint copies)."""
    return [t for t in list(model.state_dict().values()) +
            [v for s in opt.state_dict()["state"].values() for v in s.values()] if t.numel() > 1]


def copy_and_hash_seconds(model, opt) -> tuple[float, float, float]:
    """Seconds to copy every tensor of the state into a preallocated buffer and hash it with
    blake3 on two threads (the work any content-addressed checkpoint of it must do), and, for
    the same bytes, the copy alone and blake3 alone on one thread."""
    import blake3

    from forkpoint.format.objects import BLOCK_BYTES, block_digests

    tensors = state_tensors(model, opt)
    bufs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    both, copy, hashed = [], [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
            block_digests(memoryview(b.view(torch.uint8).numpy()))
        t1 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        t2 = time.perf_counter()
        for b in bufs:
            view = memoryview(b.view(torch.uint8).numpy())
            for lo in range(0, view.nbytes, BLOCK_BYTES):
                blake3.blake3(view[lo:lo + BLOCK_BYTES]).digest()
        t3 = time.perf_counter()
        both.append(t1 - t0)
        copy.append(t2 - t1)
        hashed.append(t3 - t2)
    return statistics.median(both), statistics.median(copy), statistics.median(hashed)


def main():
    ap = harness.arguments(__doc__, repeats=3)
    ap.add_argument("--budget-mb", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--params-m", type=int, default=125)
    ap.add_argument("--device", default="cpu", help="every-step section: cpu, or cuda to train on the GPU")
    ap.add_argument("--batch", type=int, default=16, help="every-step section: rows per batch")
    ap.add_argument("--sections", default="restore,rss,flush,every-step",
                    help="comma-separated subset of: restore, rss, flush, every-step, capture")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    scratch = harness.scratch(args.dir, prefix="fp-tiers-")
    try:
        if sections & {"restore", "rss", "flush", "capture"}:
            model, opt, nbytes = make_state(args.params_m)
            if "restore" in sections:
                restore_section(model, opt, nbytes, scratch, args.repeats)
            if "rss" in sections:
                rss_section(model, opt, nbytes, scratch, args.budget_mb)
            if "flush" in sections:
                flush_section(model, opt, nbytes, scratch, args.repeats)
            if "capture" in sections:
                capture_section(model, opt, nbytes, scratch, args.repeats)
            del model, opt
        if "every-step" in sections:
            every_step_section(scratch, args.steps, args.params_m, args.device, args.batch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
