"""Save and load of a state with many small tensors (~24k leaves), forkpoint against its peers.

State: 1000 blocks of Linear(64, 64) + LayerNorm(64) + Linear(64, 64) and AdamW's state
(6000 parameters, two moments and a step counter each: 24k leaves, 0.1 GB). Each round takes
one optimizer step (every leaf changes) and then saves and loads with every method, in turn,
to the same disk (files made durable); the table shows medians of the rounds. `--saves N`
then saves N more versions into one repository and reports the process's resident memory.
`--loop N` trains N steps (batch 16) with a checkpoint every 5, as train_overhead.py does,
with no checkpoint, forkpoint's asynchronous Checkpointer, torch.save and dcp.async_save
(interleaved `--loop-repeats` times), and reports the stall per checkpoint.

    python benchmarks/many_leaves.py --repeats 7 --saves 40 --loop 25 --dir /work
    python benchmarks/many_leaves.py --methods forkpoint --repeats 7 --validation --dir /work
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
from train_overhead import DCPAsync, Forkpoint, NoCheckpoint, TorchSave, timed_loop  # noqa: E402


warnings.filterwarnings("ignore")


def make_state(blocks: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                                      torch.nn.Linear(64, 64)) for _ in range(blocks)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model, opt) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(f) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


LOOP_METHODS = {m.name: m for m in (NoCheckpoint, Forkpoint, TorchSave, DCPAsync)}


def loop_wall(method: str, blocks: int, steps: int, root: str) -> tuple[float, int]:
    """(wall seconds, checkpoints) of `steps` training steps with `method` checkpointing every 5."""
    model, opt = make_state(blocks)
    batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    return timed_loop(LOOP_METHODS[method](), model, opt, batch, steps, 5,
                      os.path.join(root, f"loop-{method.split()[0]}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loop_stalls(blocks: int, steps: int, repeats: int, root: str) -> None:
    """Print the stall per checkpoint of each method in a training loop of this state; every
    run is a fresh process (dcp.async_save's process group and threads outlive its saves)."""
    walls: dict[str, list[float]] = {name: [] for name in LOOP_METHODS}
    count = {}
    for rep in range(repeats):
        for name in LOOP_METHODS:
            out = subprocess.run([sys.executable, __file__, "--loop-one", name, "--loop", str(steps),
                                  "--blocks", str(blocks), "--dir", root], check=True, capture_output=True,
                                 text=True, env={**os.environ, "MASTER_PORT": str(free_port())}).stdout.split()
            walls[name].append(float(out[-2]))
            count[name] = int(out[-1])
            print(f"loop {rep + 1} {name}: {walls[name][-1]:.2f} s, {count[name]} checkpoints", flush=True)
    base = statistics.median(walls["no checkpoint"])
    print(f"\n{steps} steps, a checkpoint every 5, medians of {repeats}; no-checkpoint loop {base:.2f} s "
          f"({base / steps:.3f} s/step)\n\n| method | wall (s) | stall per checkpoint (s) |\n|---|---|---|")
    for name in LOOP_METHODS:
        wall = statistics.median(walls[name])
        print(f"| {name} | {wall:.2f} | {(wall - base) / count[name] if count[name] else 0.0:.3f} |")


def validation_section(repo, repeats: int) -> None:
    """The manifest schema check's share of a load by a fresh Repo (its manifest not cached):
    loads with and without `check_manifest`, alternating, medians of `repeats`."""
    import forkpoint.format.manifest as manifest_module

    real = manifest_module.check_manifest
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for _ in range(repeats):
        for way in times:
            manifest_module.check_manifest = real if way == "checked" else (lambda record, where: None)
            fresh = fp.Repo(repo.url)
            times[way].append(timed(lambda: fresh.load("main")))
            fresh.close()
    manifest_module.check_manifest = real
    checked, unchecked = (statistics.median(times[w]) for w in ("checked", "unchecked"))
    print(f"\nload by a fresh Repo, medians of {repeats}: with the manifest check {checked:.3f} s, "
          f"without {unchecked:.3f} s ({checked / unchecked:.3f}x)")


def main():
    ap = harness.arguments(__doc__, repeats=5)
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--saves", type=int, default=0)
    ap.add_argument("--methods", default="forkpoint,torch.save,dcp")
    ap.add_argument("--loop", type=int, default=0, help="training steps of the loop section (0: skip it)")
    ap.add_argument("--loop-repeats", type=int, default=3)
    ap.add_argument("--loop-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--validation", action="store_true", help="also time the manifest check's share of a load")
    args = ap.parse_args()
    if args.loop_one:
        torch.set_num_threads(2)
        wall, n = loop_wall(args.loop_one, args.blocks, args.loop, args.dir)
        print(f"{wall:.4f} {n}")
        return
    methods = args.methods.split(",")
    model, opt = make_state(args.blocks)
    train_step(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    root = harness.scratch(args.dir, prefix="fp-many-")
    repo = fp.Repo(os.path.join(root, "repo"), create=True)
    leaves = len(repo.manifest(repo.save(state, step=0).id).leaves)
    nbytes = sum(leaf.nbytes for leaf in repo.manifest().leaves)
    print(f"state: {leaves} leaves, {nbytes / 1e6:.1f} MB; dir {root}")
    times: dict[str, list[float]] = {}
    for r in range(args.repeats):
        train_step(model, opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        if "forkpoint" in methods:
            times.setdefault("forkpoint save", []).append(timed(lambda: repo.save(state, step=r + 1)))
            times.setdefault("forkpoint load", []).append(timed(lambda: repo.load("main")))
        if "torch.save" in methods:
            path = os.path.join(root, "state.pt")

            def torch_save():
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            times.setdefault("torch.save", []).append(timed(torch_save))
            times.setdefault("torch.load", []).append(timed(lambda: torch.load(path, weights_only=True)))
        if "dcp" in methods:
            import torch.distributed.checkpoint as dcp

            where = os.path.join(root, "dcp")

            def dcp_save():
                shutil.rmtree(where, ignore_errors=True)
                dcp.save(state, checkpoint_id=where)
                harness.fsync_tree(where)

            times.setdefault("dcp.save", []).append(timed(dcp_save))
            times.setdefault("dcp.load", []).append(timed(lambda: dcp.load(state, checkpoint_id=where)))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()), flush=True)
    print("\n| method | median (s) | per leaf (us) |\n|---|---|---|")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.3f} | {m / leaves * 1e6:.0f} |")
    if args.saves:
        before = rss_mb()
        save_times = []
        for i in range(args.saves):
            train_step(model, opt)
            save_times.append(timed(lambda: repo.save({"model": model.state_dict(), "optim": opt.state_dict()},
                                                      step=1000 + i)))
        print(f"\n{args.saves} more saves: median {statistics.median(save_times):.3f} s, last 10 median "
              f"{statistics.median(save_times[-10:]):.3f} s; resident memory {before:.0f} -> {rss_mb():.0f} MB")
    if args.validation:
        validation_section(repo, args.repeats)
    repo.close()
    if args.loop:
        loop_stalls(args.blocks, args.loop, args.loop_repeats, root)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
