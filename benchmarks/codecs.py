"""Codecs on a training state: ratio and save time of raw, zstd, byte planes + zstd, and the
opt-in lossy modes (value-relative bound, bf16 precision) on fp32.

State: a 24M-parameter MLP trained 20 steps with AdamW, in fp32 and in bf16 (weights and
both Adam moments), saved synchronously to local disk with each codec. Medians of runs.
The last row per dtype saves with deltas: each run saves the state, trains one more step
and times the second save (stored against the first). "restore" is the time to restore that
version into a copy of the model and optimizer right after the save (large objects were
written with O_DIRECT, so they are read from the disk).

    python benchmarks/codecs.py --repeats 3
    python benchmarks/codecs.py --warm-restores --repeats 9   # restore speed per codec
    python benchmarks/codecs.py --repeated-saves --repeats 7  # one repo per codec, a save per step
    sudo bash benchmarks/throttled.sh 500 python benchmarks/codecs.py --repeated-saves  # slower disk
"""

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time

import torch

import forkpoint as fp


def train_step(state, dtype):
    model, opt = state["model"], state["optim"]
    loss = model(torch.randn(32, 1024, dtype=dtype)).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def trained_state(dtype):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]).to(dtype)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    for _ in range(20):
        train_step(state, dtype)
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--warm-restores", action="store_true",
                    help="instead: restore speed per codec with the objects in the page cache")
    ap.add_argument("--repeated-saves", action="store_true",
                    help="instead: raw, lossless and auto saving into one repository each, "
                         "one training step between saves (what auto learns about the store)")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="fp-codecs-", dir=args.dir)
    if args.warm_restores or args.repeated_saves:
        (warm_restores if args.warm_restores else repeated_saves)(scratch, args.repeats)
        shutil.rmtree(scratch, ignore_errors=True)
        return
    print("| dtype | codec | stored / logical | ratio | save (s) | MB/s | CPU (core-s) | restore (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        target = copy.deepcopy(state)
        policies = {"raw": "raw", "zstd": "zstd", "lossless": "lossless", "auto": "auto"}
        if dtype == torch.float32:
            policies.update({
                "Lossy(rel_error=1e-3) on optim/*, lossless elsewhere":
                    {"optim/*": fp.Lossy(rel_error=1e-3), "*": "lossless"},
                "Lossy(rel_error=1e-3) everywhere": fp.Lossy(rel_error=1e-3),
                "Lossy(dtype=bfloat16) everywhere": fp.Lossy(dtype="bfloat16")})
        policies["lossless + Delta(), one step after the parent"] = "delta"
        for name, codec in policies.items():
            times, cpu, restores, v = [], [], [], None
            for rep in range(args.repeats):
                path = os.path.join(scratch, f"codec-{rep}")
                if codec == "delta":
                    repo = fp.Repo(path, create=True, codec="lossless", delta=fp.Delta())
                    repo.save(state)
                    train_step(state, dtype)
                else:
                    repo = fp.Repo(path, create=True, codec=codec)
                c0, t0 = os.times(), time.perf_counter()
                v = repo.save(state)
                times.append(time.perf_counter() - t0)
                c1 = os.times()
                cpu.append(c1.user - c0.user + c1.system - c0.system)
                t0 = time.perf_counter()
                repo.restore(target, v.id)
                restores.append(time.perf_counter() - t0)
                repo.close()
                shutil.rmtree(path)
            t = statistics.median(times)
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {v.stored_bytes / 2**20:.0f} / "
                  f"{v.logical_bytes / 2**20:.0f} MiB | {v.logical_bytes / v.stored_bytes:.3f} | {t:.2f} | "
                  f"{v.logical_bytes / t / 1e6:.0f} | {statistics.median(cpu):.2f} | "
                  f"{statistics.median(restores):.2f} |")
    shutil.rmtree(scratch, ignore_errors=True)


def warm_restores(scratch: str, repeats: int) -> None:
    """Save the state once per codec, then restore it in place into a copy of the model and
    optimizer `repeats` times after one warm-up (the objects in the page cache: what decoding
    costs); medians."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | codec | restore (s) | GB/s | CPU (core-s) |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        target = copy.deepcopy(state)
        for codec in ("raw", "lossless", "zstd"):
            path = os.path.join(scratch, codec)
            with fp.Repo(path, create=True, codec=codec) as repo:
                version = repo.save(state)
            with fp.Repo(path) as repo:
                repo.restore(target, version.id)
                times, cpu = [], []
                for _ in range(repeats):
                    c0, t0 = os.times(), time.perf_counter()
                    repo.restore(target, version.id)
                    times.append(time.perf_counter() - t0)
                    c1 = os.times()
                    cpu.append(c1.user - c0.user + c1.system - c0.system)
            shutil.rmtree(path)
            t = statistics.median(times)
            print(f"| {str(dtype).removeprefix('torch.')} | {codec} | {t:.3f} | "
                  f"{version.logical_bytes / t / 1e9:.2f} | {statistics.median(cpu):.2f} |")


def repeated_saves(scratch: str, repeats: int) -> None:
    """Per dtype, for each of raw / lossless / auto in turn (the order rotating by round): a
    repository per codec saves the state once (its first save, reported apart), then `repeats`
    times, one training step before each save (so every save writes new bytes). Medians of
    those saves; "encoded saves" counts the saves that encoded their large chunks."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | codec | first save (s) | save (s) | CPU (core-s) | ratio | encoded saves |")
    print("|---|---|---|---|---|---|---|")
    codecs = ("raw", "lossless", "auto")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {c: fp.Repo(os.path.join(scratch, c), create=True, codec=c) for c in codecs}
        first, times, cpu, ratios, encoded = {}, *({c: [] for c in codecs} for _ in range(4))
        for rep in range(repeats + 1):
            for c in codecs[rep % 3:] + codecs[:rep % 3]:
                train_step(state, dtype)
                c0, t0 = os.times(), time.perf_counter()
                v = repos[c].save(state)
                elapsed = time.perf_counter() - t0
                c1 = os.times()
                if rep == 0:
                    first[c] = elapsed
                    continue
                times[c].append(elapsed)
                cpu[c].append(c1.user - c0.user + c1.system - c0.system)
                ratios[c].append(v.logical_bytes / v.stored_bytes)
                encoded[c].append(any(ch.codec != "raw" for leaf in repos[c].manifest(v.id).leaves
                                      for ch in leaf.chunks if ch.size >= 1 << 20))
        for c in codecs:
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {first[c]:.2f} | "
                  f"{statistics.median(times[c]):.3f} | {statistics.median(cpu[c]):.2f} | "
                  f"{statistics.median(ratios[c]):.3f} | {sum(encoded[c])} / {repeats} |")
            repos[c].close()
            shutil.rmtree(os.path.join(scratch, c))


if __name__ == "__main__":
    main()
