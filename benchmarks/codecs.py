"""Codecs on a training state: ratio and save time of raw, zstd, byte planes + zstd, and the
opt-in lossy modes (value-relative bound, bf16 precision) on fp32.

State: a 24M-parameter MLP trained 20 steps with AdamW, in fp32 and in bf16 (weights and
both Adam moments), saved synchronously to local disk with each codec, every chunk encoded
(unpaced: the codec's own ratio and cost; --repeated-saves compares paced saves).
Medians of runs.
The last row per dtype saves with deltas: each run saves the state, trains one more step
and times the second save (stored against the first). "restore" is the time to restore that
version into a copy of the model and optimizer right after the save (large objects were
written with O_DIRECT, so they are read from the disk).

    python benchmarks/codecs.py --repeats 3
    python benchmarks/codecs.py --warm-restores --repeats 9   # restore speed per codec
    python benchmarks/codecs.py --repeated-saves --repeats 7  # one repo per codec, a save per step
    python benchmarks/codecs.py --repeated-saves --cores 1,2  # the same, bound to 1 core, then 2
    python benchmarks/codecs.py --pacing-ab --repeats 12  # what paces a lossless save, A/B
    python benchmarks/codecs.py --pacing-ab --busy 2  # the same beside two busy processes
    python benchmarks/codecs.py --parallel-speedup --repeats 5  # are two cores two cores' worth
    python benchmarks/codecs.py --training-loop --repeats 3   # loop time with a save every 5 steps
    python benchmarks/codecs.py --compact --repeats 5         # encoding a raw repository afterwards
    python benchmarks/codecs.py --encode-later-ab --repeats 16  # save time with encode_later
    python benchmarks/codecs.py --layouts-ab --repeats 16       # saves reusing layouts and delta estimates or not
    python benchmarks/codecs.py --auto-ab --repeats 12          # auto against raw alone, each save listed
    python benchmarks/codecs.py --estimates-ab --repeats 16     # deltas: value estimates kept or not, same states
    python benchmarks/codecs.py --delta-sample-ab --repeats 16  # deltas estimated from samples or made first
    python benchmarks/codecs.py --raw-under-load --repeats 12   # raw saves while other threads keep cores busy
    sudo bash benchmarks/throttled.sh 500 python benchmarks/codecs.py --repeated-saves  # slower disk
"""

import atexit
import copy
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch

import forkpoint as fp
import harness


def train_step(state, dtype, batch: int = 32):
    model, opt = state["model"], state["optim"]
    device = next(model.parameters()).device
    loss = model(torch.randn(batch, 1024, dtype=dtype, device=device)).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def large_chunks(repo, vid: str) -> list:
    """The chunk records of version `vid` of 1 MiB or more (what pacing and deltas decide on)."""
    return [ch for leaf in repo.manifest(vid).leaves for ch in leaf.chunks if ch.size >= 1 << 20]


def stored_now(repo, vid: str) -> int:
    """Bytes the objects of version `vid` take in the store now (after any encoding that
    followed the commit)."""
    from forkpoint.format.objects import object_key

    objects = {c.object for leaf in repo.manifest(vid).leaves for c in leaf.chunks}
    return sum(repo.store.size(object_key(o)) for o in objects)


def timed(fn):
    """(result, seconds, core-seconds of this process) of `fn()`."""
    c0, t0 = os.times(), time.perf_counter()
    out = fn()
    elapsed, c1 = time.perf_counter() - t0, os.times()
    return out, elapsed, c1.user - c0.user + c1.system - c0.system


def median_interval(values, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval holding the median of what `values` sample with at least
    `level` confidence: the order statistics the binomial law puts there (no resampling)."""
    x, n = sorted(values), len(values)
    tail = [sum(math.comb(n, i) for i in range(j)) / 2 ** n for j in range(n // 2 + 1)]
    j = max((j for j in range(1, n // 2 + 1) if 2 * tail[j] <= 1 - level), default=0)
    return (x[j - 1], x[n - j]) if j else (x[0], x[-1])


def trained_state(dtype, device: str = "cpu", steps: int = 20):
    torch.manual_seed(0)
    torch.set_num_threads(min(2, len(os.sched_getaffinity(0))))
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)]).to(device, dtype)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    for _ in range(steps):
        train_step(state, dtype)
    return state


def main():
    ap = harness.arguments(__doc__, repeats=3)
    ap.add_argument("--warm-restores", action="store_true",
                    help="instead: restore speed per codec with the objects in the page cache")
    ap.add_argument("--repeated-saves", action="store_true",
                    help="instead: raw, lossless (encoding after or before the commit) and auto "
                         "saving into one repository each, "
                         "one training step between saves (what auto learns about the store)")
    ap.add_argument("--training-loop", action="store_true",
                    help="instead: a training loop with a synchronous save every 5 steps per codec, "
                         "against the loop without checkpoints (what encoding costs the loop)")
    ap.add_argument("--compact", action="store_true",
                    help="instead: repo.compact(codec='lossless') of a raw repository of three versions")
    ap.add_argument("--encode-later-ab", action="store_true",
                    help="instead: same-process A/B of raw, lossless encoding after the commit, and lossless")
    ap.add_argument("--layouts-ab", action="store_true",
                    help="instead: same-process A/B of lossless saves reusing each chunk's plane "
                         "layouts and delta estimates (the default) or making them afresh every save")
    ap.add_argument("--auto-ab", action="store_true",
                    help="instead: same-process A/B of raw and auto alone, every save's time listed")
    ap.add_argument("--delta-sample-ab", action="store_true",
                    help="deltas estimated from the samples (made only where chosen) or made first, same states")
    ap.add_argument("--estimates-ab", action="store_true",
                    help="instead: the same states saved with deltas into two repositories, one "
                         "keeping each chunk's value estimate (the default), one estimating every save")
    ap.add_argument("--raw-under-load", action="store_true",
                    help="instead: raw saves alone and while 1 or 2 other threads keep a core busy each "
                         "(what a save's disk path loses to CPU work beside it, such as encoding)")
    ap.add_argument("--pacing-ab", action="store_true",
                    help="instead: same-process A/B of raw, paced lossless, paced without the last "
                         "save's memory, and unpaced")
    ap.add_argument("--busy", type=int, default=0,
                    help="run the chosen mode beside this many other processes, each keeping a core "
                         "busy (a host whose cores other work shares)")
    ap.add_argument("--parallel-speedup", action="store_true",
                    help="instead: what a second thread adds to blake3, the float codec and a "
                         "scalar loop (whether the machine's cores each give a core's worth)")
    ap.add_argument("--cores", default=None,
                    help="run the chosen mode once per core count given (e.g. 1,2), each in a new "
                         "process bound to that many of this process's cores")
    ap.add_argument("--device", default="cpu", help="--training-loop: where the model trains")
    ap.add_argument("--batch", type=int, default=256, help="--training-loop: batch size")
    ap.add_argument("--steps", type=int, default=40, help="--training-loop: steps (a save every 5)")
    args = ap.parse_args()
    if args.cores:
        per_core_count(args.cores)
        return
    scratch = harness.scratch(args.dir, prefix="fp-codecs-")
    modes = {"warm_restores": warm_restores, "repeated_saves": repeated_saves,
             "training_loop": training_loop, "compact": compaction, "encode_later_ab": encode_later_ab,
             "layouts_ab": layouts_ab, "auto_ab": auto_ab, "estimates_ab": estimates_ab,
             "delta_sample_ab": delta_sample_ab, "raw_under_load": raw_under_load, "pacing_ab": pacing_ab,
             "parallel_speedup": parallel_speedup}
    chosen = [mode for name, mode in modes.items() if getattr(args, name)]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    atexit.register(lambda: [p.kill() for p in busy])
    if chosen:
        if chosen[0] is training_loop:
            training_loop(scratch, args.repeats, args.steps, batch=args.batch, device=args.device)
        else:
            chosen[0](scratch, args.repeats)
        shutil.rmtree(scratch, ignore_errors=True)
        return
    print("| dtype | codec | stored / logical | ratio | save (s) | MB/s | encoding after commit (s) | "
          "CPU (core-s) | restore (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
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
            times, later, cpu, restores, v, stored = [], [], [], [], None, 0
            for rep in range(args.repeats):
                path = os.path.join(scratch, f"codec-{rep}")
                if codec == "delta":
                    repo = fp.Repo(path, create=True, codec="lossless", delta=fp.Delta())
                    repo.save(state)
                    train_step(state, dtype)
                else:
                    repo = harness.repo(path, unpaced=True, codec=codec)
                v, elapsed, core_s = timed(lambda: repo.save(state))
                _, after, after_core_s = timed(repo.drain)
                times.append(elapsed)
                later.append(after)
                cpu.append(core_s + after_core_s)
                stored = v.stored_bytes if codec == "delta" else stored_now(repo, v.id)
                t0 = time.perf_counter()
                repo.restore(target, v.id)
                restores.append(time.perf_counter() - t0)
                repo.close()
                shutil.rmtree(path)
            t = statistics.median(times)
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {stored / 2**20:.0f} / "
                  f"{v.logical_bytes / 2**20:.0f} MiB | {v.logical_bytes / stored:.3f} | {t:.2f} | "
                  f"{v.logical_bytes / t / 1e6:.0f} | {statistics.median(later):.2f} | "
                  f"{statistics.median(cpu):.2f} | {statistics.median(restores):.2f} |")
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
            with harness.repo(path, unpaced=True, codec=codec) as repo:
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


def per_core_count(cores: str) -> None:
    """Run this script's arguments, less --cores, once per count in `cores` ("1,2"), each run
    in a new process bound to the first that many cores this process may use."""
    argv, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--cores"):
            skip = arg == "--cores"
            continue
        argv.append(arg)
    allowed = sorted(os.sched_getaffinity(0))
    for count in (int(c) for c in cores.split(",")):
        if not 0 < count <= len(allowed):
            raise SystemExit(f"--cores {count}: this process may use {len(allowed)} cores")
        print(f"\n### Bound to {count} of {len(allowed)} cores\n", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv], check=True,
                       preexec_fn=lambda n=count: os.sched_setaffinity(0, allowed[:n]))


def repeated_saves(scratch: str, repeats: int) -> None:
    """Per dtype, for each of raw / lossless (paced: the default) / lossless encoding every
    chunk (unpaced) / lossless encoding after the commit / auto in turn (the order
    rotating by round): a repository per codec saves the state once (its first save, reported
    apart), then `repeats` times, one training step before each save (so every save writes new
    bytes). After each save, what it left to encode after its commit is drained and timed apart
    (so it slows no other repository's save). Medians of those saves; "ratio" is logical over
    stored bytes once encoded; "chunks encoded" is the median share of a save's large chunks
    encoded before the commit; "CPU" includes the encoding after it. The summary's lossless /
    raw is given as the ratio of the medians and as the median of each round's ratio (a round's
    saves run seconds apart, so a slow spell of the machine weighs on both)."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}, {len(os.sched_getaffinity(0))} cores\n")
    print("| dtype | codec | first save (s) | save (s) | encoding after commit (s) | CPU (core-s) | ratio "
          "| chunks encoded |")
    print("|---|---|---|---|---|---|---|---|")
    configs = {"raw": {"codec": "raw"}, "lossless": {"codec": "lossless"},
               "lossless, unpaced": {"codec": "lossless", "unpaced": True},
               "lossless, encode_later=True": {"codec": "lossless", "encode_later": True},
               "auto": {"codec": "auto"}}
    names = list(configs)
    summary = []
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {c: harness.repo(os.path.join(scratch, str(i)), **configs[c]) for i, c in enumerate(names)}
        first, times, later, cpu, ratios, encoded = {}, *({c: [] for c in names} for _ in range(5))
        for rep, order in harness.rounds(names, repeats + 1):
            for c in order:
                train_step(state, dtype)
                v, elapsed, core_s = timed(lambda: repos[c].save(state))
                _, after, after_core_s = timed(repos[c].drain)
                if rep == 0:
                    first[c] = elapsed
                    continue
                times[c].append(elapsed)
                later[c].append(after)
                cpu[c].append(core_s + after_core_s)
                ratios[c].append(v.logical_bytes / stored_now(repos[c], v.id))
                large = large_chunks(repos[c], v.id)
                encoded[c].append(sum(ch.codec != "raw" for ch in large) / max(1, len(large)))
        for i, c in enumerate(names):
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {first[c]:.2f} | "
                  f"{statistics.median(times[c]):.3f} | {statistics.median(later[c]):.3f} | "
                  f"{statistics.median(cpu[c]):.2f} | {statistics.median(ratios[c]):.3f} | "
                  f"{statistics.median(encoded[c]):.0%} |")
            repos[c].close()
            shutil.rmtree(os.path.join(scratch, str(i)))
        for c in ("lossless", "lossless, unpaced"):
            paired = statistics.median(a / b for a, b in zip(times[c], times["raw"]))
            summary.append(f"{str(dtype).removeprefix('torch.')}: {c} / raw save time "
                           f"{statistics.median(times[c]) / statistics.median(times['raw']):.2f} "
                           f"(median of each round's own ratio: {paired:.3f}), ratio "
                           f"{statistics.median(ratios[c]):.3f}, CPU {statistics.median(cpu[c]):.2f} core-s "
                           f"against a raw save of {statistics.median(times['raw']):.3f} s")
    print("\n" + "\n".join(summary))


def raw_under_load(scratch: str, repeats: int) -> None:
    """fp32 raw saves alone and while 1 and 2 other threads each keep a core busy with work
    that holds no interpreter lock (blake3 of 8 MiB, over and over), in turn, one training
    step before each save; medians of `repeats` rounds, and of each round's loaded / alone."""
    import blake3

    state = trained_state(torch.float32)
    repo = fp.Repo(os.path.join(scratch, "raw"), create=True, codec="raw")
    blob = os.urandom(8 << 20)
    stop = threading.Event()
    running: list[threading.Event] = []

    def hog(go: threading.Event) -> None:
        while not stop.is_set():
            if go.wait(0.1):
                blake3.blake3(blob).digest()

    for _ in range(2):
        running.append(threading.Event())
        threading.Thread(target=hog, args=(running[-1],), daemon=True).start()
    times = {0: [], 1: [], 2: []}
    for rep in range(repeats + 1):
        for load in times:
            train_step(state, torch.float32)
            for i, go in enumerate(running):
                go.set() if i < load else go.clear()
            time.sleep(0.05)
            elapsed = timed(lambda: repo.save(state))[1]
            for go in running:
                go.clear()
            repo.drain()
            if rep:
                times[load].append(elapsed)
    stop.set()
    repo.close()
    print(f"forkpoint from {os.path.dirname(fp.__file__)}, {len(os.sched_getaffinity(0))} cores\n")
    print("| busy threads beside the save | raw save (s) | / alone (median of rounds) |")
    print("|---|---|---|")
    for load, values in times.items():
        paired = statistics.median(a / b for a, b in zip(values, times[0]))
        print(f"| {load} | {statistics.median(values):.3f} | {paired:.3f} |")


def encode_later_ab(scratch: str, repeats: int) -> None:
    """Same-process A/B: raw, lossless with encode_later (the store's rates primed so that
    every save writes raw) and inline lossless, a repository each, saves alternating with a
    training step before each; each save's background encoding is drained and timed apart.
    Medians of `repeats`."""
    from forkpoint.engine.autocodec import choice_for

    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | raw save (s) | lossless, encode_later=True: save (s) | encoding after the commit (s) "
          "| lossless save (s) |")
    print("|---|---|---|---|---|")
    configs = {"raw": {"codec": "raw"}, "later": {"codec": "lossless", "encode_later": True},
               "inline": {"codec": "lossless"}}
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {c: harness.repo(os.path.join(scratch, f"ab-{c}"), **kw) for c, kw in configs.items()}
        choice = choice_for(repos["later"].store)
        choice.rates, choice.interval = {False: 1e15, True: 1.0}, 1 << 30
        saves, after = ({c: [] for c in configs} for _ in range(2))
        for _ in range(repeats):
            for c, repo in repos.items():
                train_step(state, dtype)
                saves[c].append(timed(lambda: repo.save(state))[1])
                after[c].append(timed(repo.drain)[1])
        med = {c: statistics.median(saves[c]) for c in configs}
        print(f"| {str(dtype).removeprefix('torch.')} | {med['raw']:.3f} | {med['later']:.3f} | "
              f"{statistics.median(after['later']):.2f} | {med['inline']:.3f} |")
        for c, repo in repos.items():
            repo.close()
            shutil.rmtree(os.path.join(scratch, f"ab-{c}"))


def layouts_ab(scratch: str, repeats: int) -> None:
    """Same-process A/B: raw, lossless (each chunk's encode reusing the plane layouts its last
    encode chose: the default), lossless choosing them afresh on every save (the repository's
    layout memory switched off), and the same with deltas, where a chunk's save also reuses
    an earlier save's estimate of how well its value codes (the default: only the delta is
    estimated every save) or estimates both on every save; a repository each, saves alternating with a training step before each.
    Medians of `repeats` (after each repository's first save)."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | codec | save (s) | CPU (core-s) | ratio |")
    print("|---|---|---|---|---|")
    lossless, delta = {"codec": "lossless"}, {"codec": "lossless", "delta": fp.Delta()}
    configs = {"raw": ({"codec": "raw"}, True, True), "lossless": (lossless, True, True),
               "lossless, layouts chosen every save": (lossless, False, True),
               "lossless + Delta()": (delta, True, True),
               "lossless + Delta(), value estimated every save": (delta, True, False),
               "lossless + Delta(), layouts chosen and value estimated every save": (delta, False, False)}
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {}
        for i, (c, (kw, layouts, estimates)) in enumerate(configs.items()):
            repos[c] = harness.repo(os.path.join(scratch, f"layouts-{i}"), unpaced=True, **kw)
            if not layouts:
                repos[c]._layouts = None
            if not estimates:
                repos[c]._value_estimates = None
            repos[c].save(state)
        saves, cpu, ratios = ({c: [] for c in configs} for _ in range(3))
        for _ in range(repeats):
            for c, repo in repos.items():
                train_step(state, dtype)
                v, elapsed, core_s = timed(lambda: repo.save(state))
                saves[c].append(elapsed)
                cpu[c].append(core_s)
                ratios[c].append(v.logical_bytes / v.stored_bytes)
        for i, c in enumerate(configs):
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {statistics.median(saves[c]):.3f} | "
                  f"{statistics.median(cpu[c]):.2f} | {statistics.median(ratios[c]):.3f} |")
            repos[c].close()
            shutil.rmtree(os.path.join(scratch, f"layouts-{i}"))


def pacing_ab(scratch: str, repeats: int) -> None:
    """Same-process A/B of what paces a lossless save: raw; lossless paced (the default);
    paced without the memory of past saves (its first chunks find nothing waiting and go
    raw, and it does not learn whether raw saves measure faster); and every chunk encoded
    (unpaced); and a second raw repository, whose ratio to the first shows what the
    comparison itself resolves. A repository each, saves in turn (in an order shuffled each
    round, so that no arm keeps a place), a training step before each. Medians of `repeats`
    after two saves each; "vs raw" is the
    median of each round's own ratio to the raw save; "copied" is what each save passed
    through the direct-I/O bounce buffer (each repository keeps only its last version, pruned
    after each save, untimed); "written raw" the share of saves that encoded none
    of their large chunks; "95% interval" where the median of the rounds' ratios lies
    (median_interval)."""
    from forkpoint.storage import local

    copied = [0]
    copy = local._copy

    def counted(dst, src):
        copied[0] += src.nbytes
        copy(dst, src)

    local._copy = counted
    print(f"forkpoint from {os.path.dirname(fp.__file__)}, {len(os.sched_getaffinity(0))} cores\n")
    print("| dtype | codec | save (s) | vs raw | 95% interval | CPU (core-s) | ratio | copied (MB) | written raw |")
    print("|---|---|---|---|---|---|---|---|---|")
    configs = {"raw": {"codec": "raw"}, "lossless (paced)": {"codec": "lossless"},
               "paced, no memory of past saves": {"codec": "lossless"},
               "unpaced": {"codec": "lossless", "unpaced": True}, "raw again (control)": {"codec": "raw"}}
    names = list(configs)
    order = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {c: harness.repo(os.path.join(scratch, f"pacing-{i}"), **kw) for i, (c, kw) in enumerate(configs.items())}
        repos["paced, no memory of past saves"]._pacing = None
        times, cpu, ratios, copies, unencoded = ({c: [] for c in names} for _ in range(5))
        for rep in range(repeats + 2):
            for c in order.sample(names, len(names)):
                train_step(state, dtype)
                copied[0] = 0
                v, elapsed, core_s = timed(lambda: repos[c].save(state))
                if rep >= 2:
                    times[c].append(elapsed)
                    cpu[c].append(core_s)
                    ratios[c].append(v.logical_bytes / v.stored_bytes)
                    copies[c].append(copied[0])
                    unencoded[c].append(all(ch.codec == "raw" for ch in large_chunks(repos[c], v.id)))
                repos[c].gc(keep=fp.Keep(last=1), grace=0)
        for i, c in enumerate(names):
            rounds = [a / b for a, b in zip(times[c], times["raw"])]
            low, high = median_interval(rounds)
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {statistics.median(times[c]):.3f} | "
                  f"{statistics.median(rounds):.3f} | {low:.3f}–{high:.3f} | "
                  f"{statistics.median(cpu[c]):.2f} | {statistics.median(ratios[c]):.3f} | "
                  f"{statistics.median(copies[c]) / 1e6:.0f} | {statistics.mean(unencoded[c]):.0%} |")
            repos[c].close()
            shutil.rmtree(os.path.join(scratch, f"pacing-{i}"))
    local._copy = copy


def parallel_speedup(scratch: str, repeats: int) -> None:
    """How much a second thread adds to the vector work a save does (blake3 over a 256 KiB
    buffer, the float codec on a 4 MiB float32 weight; both let go of the interpreter lock) and
    to a scalar loop (two processes of pure Python): per trial, the rate of two threads over
    the rate of one, each measured over 0.2 s. On a machine with two free cores every figure
    is near 2; where the two cores share one core's vector units, or the host takes one, the
    vector figures fall toward 1."""
    import numpy as np

    from forkpoint.codecs import floatcodec
    from forkpoint.format.objects import content_hash

    buffer = bytes(256 << 10)
    weight = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float32).view(np.uint8)
    kernels = {"blake3": lambda: content_hash(buffer),
               "float codec": lambda: floatcodec.encode_pieces(weight, 4)}

    def rate(kernel, seconds: float = 0.2) -> float:
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            kernel()
            done += 1
        return done / (time.perf_counter() - start)

    def speedup(kernel) -> float:
        solo, rates = rate(kernel), [0.0, 0.0]
        threads = [threading.Thread(target=lambda i=i: rates.__setitem__(i, rate(kernel))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(rates) / solo

    loop = [sys.executable, "-c", "import time\nn, t = 0, time.perf_counter()\n"
            "while time.perf_counter() - t < 0.5: n += 1\nprint(n)"]
    print("| trial | blake3 | float codec | Python loop (2 processes) |\n|---|---|---|---|")
    for trial in range(repeats):
        vector = [speedup(k) for k in kernels.values()]
        solo = int(subprocess.run(loop, capture_output=True, text=True).stdout)
        pair = [subprocess.Popen(loop, stdout=subprocess.PIPE, text=True) for _ in range(2)]
        both = sum(int(p.communicate()[0]) for p in pair)
        print(f"| {trial + 1} | {vector[0]:.2f} | {vector[1]:.2f} | {both / solo:.2f} |")


def alternating_delta_saves(scratch: str, state, dtype, repeats: int, gap: int, ways: dict) -> dict:
    """Save the same states (`gap` training steps apart) into one lossless + Delta() repository
    per way, alternating the order; `ways[way](repo)` sets a repository up and returns what to
    call before each of its saves. Per way: lists of save seconds, CPU core-seconds, logical
    and stored bytes, and the share of large chunks stored as deltas."""
    repos, before = {}, {}
    for i, (way, setup) in enumerate(ways.items()):
        repos[way] = fp.Repo(os.path.join(scratch, f"delta-ab-{i}"), create=True, codec="lossless", delta=fp.Delta())
        before[way] = setup(repos[way])
        repos[way].save(state)
    runs = {way: {"save": [], "cpu": [], "logical": [], "stored": [], "deltas": []} for way in ways}
    order = list(ways)
    for rep in range(repeats):
        for _ in range(gap):
            train_step(state, dtype)
        for way in order if rep % 2 == 0 else order[::-1]:
            before[way]()
            v, elapsed, core_s = timed(lambda: repos[way].save(state))
            chunks = large_chunks(repos[way], v.id)
            for key, value in (("save", elapsed), ("cpu", core_s), ("logical", v.logical_bytes),
                               ("stored", v.stored_bytes),
                               ("deltas", sum(c.delta is not None for c in chunks) / len(chunks))):
                runs[way][key].append(value)
    for i, repo in enumerate(repos.values()):
        repo.close()
        shutil.rmtree(os.path.join(scratch, f"delta-ab-{i}"))
    return runs


def estimates_ab(scratch: str, repeats: int, gap: int = 6) -> None:
    """The same states (`gap` training steps apart) saved into two lossless + Delta()
    repositories, one keeping each chunk's value estimate for its next saves (the default), one
    estimating it on every save, the order alternating: the ratio over all delta saves (what
    keeping the estimate costs, on identical data) and the median save time."""
    print("| dtype | codec | save (s) | CPU (core-s) | ratio over the saves |")
    print("|---|---|---|---|---|")

    def every_save(repo):
        repo._value_estimates = None
        return lambda: None

    ways = {"lossless + Delta()": lambda repo: (lambda: None),
            "lossless + Delta(), value estimated every save": every_save}
    for dtype in (torch.float32, torch.bfloat16):
        runs = alternating_delta_saves(scratch, trained_state(dtype), dtype, repeats, gap, ways)
        for c, r in runs.items():
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {statistics.median(r['save']):.3f} | "
                  f"{statistics.median(r['cpu']):.2f} | {sum(r['logical']) / sum(r['stored']):.4f} |")


def delta_sample_ab(scratch: str, repeats: int, gap: int = 6) -> None:
    """The same states (`gap` training steps apart) saved into two lossless + Delta()
    repositories, alternating which goes first: one estimating each chunk's delta from the
    delta of the value's and base's samples and making the whole delta only where it is chosen
    (the default), one making the whole delta before estimating it (the baseline). Both
    choose the same; the median save time, CPU, the share of chunks stored as deltas and the
    ratio over all saves."""
    from forkpoint.engine.delta import DeltaPlan

    print("| dtype | delta made | save (s) | CPU (core-s) | chunks stored as deltas | ratio over the saves |")
    print("|---|---|---|---|---|---|")

    def sample_first(way: bool):
        def setup(repo):
            return lambda: setattr(DeltaPlan, "sample_first", way)
        return setup

    ways = {"only where chosen (estimated from the samples)": sample_first(True),
            "first, then estimated": sample_first(False)}
    for dtype in (torch.float32, torch.bfloat16):
        runs = alternating_delta_saves(scratch, trained_state(dtype), dtype, repeats, gap, ways)
        DeltaPlan.sample_first = True
        for c, r in runs.items():
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {statistics.median(r['save']):.3f} | "
                  f"{statistics.median(r['cpu']):.2f} | {statistics.median(r['deltas']):.0%} | "
                  f"{sum(r['logical']) / sum(r['stored']):.4f} |")


def auto_ab(scratch: str, repeats: int) -> None:
    """Same-process A/B of raw and auto (fresh repositories, saves alternating, a training step
    before each, each repository drained after each save): every save's time after the first,
    marking auto's encoded (exploring) saves with *, and the medians."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        repos = {c: fp.Repo(os.path.join(scratch, f"auto-ab-{c}"), create=True, codec=c) for c in ("raw", "auto")}
        times = {c: [] for c in repos}
        for rep in range(repeats + 1):
            for c, repo in repos.items():
                train_step(state, dtype)
                v, elapsed, _ = timed(lambda: repo.save(state))
                repo.drain()
                encoded = any(ch.codec != "raw" for ch in large_chunks(repo, v.id))
                if rep:
                    times[c].append((elapsed, encoded))
        for c, repo in repos.items():
            listed = " ".join(f"{t:.3f}{'*' if enc else ''}" for t, enc in times[c])
            print(f"{str(dtype).removeprefix('torch.')} {c}: median {statistics.median(t for t, _ in times[c]):.3f} s; "
                  f"saves: {listed}")
            repo.close()
            shutil.rmtree(os.path.join(scratch, f"auto-ab-{c}"))


def compaction(scratch: str, repeats: int, versions: int = 3) -> None:
    """Per dtype: a raw repository holding `versions` versions of the state (one training step
    apart), then `repo.compact(codec="lossless")` timed (all objects raw and out of the page
    cache after the direct-I/O writes); medians of `repeats` fresh repositories. GB/s counts
    decoded bytes; the ratio is logical over stored bytes after compaction."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | versions | logical GB | compact (s) | GB/s | CPU (core-s) | ratio after |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype)
        times, cpu, ratios, logical = [], [], [], 0
        for rep in range(repeats):
            path = os.path.join(scratch, f"compact-{rep}")
            with fp.Repo(path, create=True) as repo:
                saved = []
                for _ in range(versions):
                    train_step(state, dtype)
                    saved.append(repo.save(state))
                logical = sum(v.logical_bytes for v in saved)
                report, elapsed, core_s = timed(lambda: repo.compact(codec="lossless"))
                assert not report.problems, report.problems
                times.append(elapsed)
                cpu.append(core_s)
                ratios.append(logical / repo.du()["objects_bytes"])
            shutil.rmtree(path)
        t = statistics.median(times)
        print(f"| {str(dtype).removeprefix('torch.')} | {versions} | {logical / 1e9:.2f} | {t:.2f} | "
              f"{logical / t / 1e9:.2f} | {statistics.median(cpu):.2f} | {statistics.median(ratios):.3f} |")


def training_loop(scratch: str, repeats: int, steps: int = 40, every: int = 5, batch: int = 256,
                  device: str = "cpu") -> None:
    """Per dtype: `steps` training steps (batch `batch`) with a synchronous save every `every`
    steps into a fresh repository, per codec, and once without saving; the wall time of the
    loop including `close` (which waits for any encoding after the commits). The order of the
    codecs rotates by round; medians of `repeats` rounds. Overhead per checkpoint = (loop -
    loop without checkpoints) / checkpoints."""
    print(f"forkpoint from {os.path.dirname(fp.__file__)}\n")
    print("| dtype | codec | loop (s) | overhead per checkpoint (s) | CPU (core-s) | ratio |")
    print("|---|---|---|---|---|---|")
    configs = {"no checkpoint": None, "raw": {"codec": "raw"}, "lossless": {"codec": "lossless"},
               "lossless, encode_later=True": {"codec": "lossless", "encode_later": True},
               "auto": {"codec": "auto"}}
    names = list(configs)
    saves = steps // every
    for dtype in (torch.float32, torch.bfloat16):
        state = trained_state(dtype, device)
        walls, cpu, ratios = ({c: [] for c in names} for _ in range(3))
        for _, order in harness.rounds(names, repeats):
            for c in order:
                path = os.path.join(scratch, f"loop-{names.index(c)}")
                repo = harness.repo(path, **configs[c]) if configs[c] else None

                def loop():
                    for step in range(1, steps + 1):
                        train_step(state, dtype, batch)
                        if repo is not None and step % every == 0:
                            repo.save(state, step=step)
                    if device != "cpu":
                        torch.cuda.synchronize()
                    if repo is not None:
                        repo.close()

                _, wall, core_s = timed(loop)
                walls[c].append(wall)
                cpu[c].append(core_s)
                if repo is not None:
                    with fp.Repo(path) as done:
                        v = done.version("main")
                        ratios[c].append(v.logical_bytes / stored_now(done, v.id))
                    shutil.rmtree(path)
        base = statistics.median(walls["no checkpoint"])
        for c in names:
            wall = statistics.median(walls[c])
            print(f"| {str(dtype).removeprefix('torch.')} | {c} | {wall:.2f} | "
                  f"{(wall - base) / saves if configs[c] else 0:.3f} | {statistics.median(cpu[c]):.1f} | "
                  f"{statistics.median(ratios[c]) if ratios[c] else float('nan'):.3f} |")


if __name__ == "__main__":
    main()
