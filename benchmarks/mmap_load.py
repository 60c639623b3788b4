"""Loading a checkpoint into fresh memory vs memory-mapping it: forkpoint `load()` and
`load(mmap=True)` against `torch.load(mmap=True)` and safetensors `load_file`, on the
1.48 GB model + AdamW state, from files in the page cache and from a /dev/shm tier.

forkpoint verifies every byte in both modes (blake3 over 1 MiB blocks); the peers verify
nothing. Medians of `--repeats` runs, methods interleaved.

    python benchmarks/mmap_load.py --repeats 5 --dir /work
"""

import os
import shutil
import statistics
import sys
import time
import uuid
import warnings

import torch

import forkpoint as fp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from save_load import make_state  # noqa: E402

warnings.filterwarnings("ignore")


def touch_all(tree) -> float:
    """Read every floating-point tensor once (a mapped tensor is only paged in when used)."""
    total = 0.0
    for v in tree.values():
        if isinstance(v, dict):
            total += touch_all(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            total += float(v.sum()) if v.is_floating_point() else 0.0
    return total


def main():
    ap = harness.arguments(__doc__, repeats=5)
    ap.add_argument("--params-m", type=int, default=123)
    args = ap.parse_args()
    model, opt, nbytes = make_state(args.params_m)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    flat = {f"{k}": v for k, v in model.state_dict().items()}
    disk = harness.scratch(args.dir, prefix="fp-mmap-")
    shm = f"/dev/shm/fp-mmap-{uuid.uuid4().hex[:8]}" if os.path.isdir("/dev/shm") else None
    repo = fp.Repo(os.path.join(disk, "repo"), create=True)
    ref = repo.save(state).id
    repos = {"disk (page cache)": repo}
    if shm:
        repos["/dev/shm"] = fp.Repo(shm, create=True)
        repos["/dev/shm"].save(state)
    torch.save(state, os.path.join(disk, "state.pt"))
    from safetensors.torch import load_file, save_file

    save_file(flat, os.path.join(disk, "model.safetensors"))
    methods = {}
    for where, r in repos.items():
        head = r.head("main")
        methods[f"forkpoint load, {where}"] = lambda r=r, h=head: r.load(h)
        methods[f"forkpoint load(mmap=True), {where}"] = lambda r=r, h=head: r.load(h, mmap=True)
    methods["torch.load(mmap=True), disk (page cache)"] = lambda: torch.load(os.path.join(disk, "state.pt"),
                                                                             mmap=True, weights_only=True)
    methods["safetensors load_file (model only), disk"] = lambda: {"model": load_file(os.path.join(disk, "model.safetensors"))}
    times = {name: [] for name in methods}
    touched = {name: [] for name in methods}
    names = list(methods)
    for _, order in harness.rounds(names, args.repeats):
        for name in order:
            t0 = time.perf_counter()
            tree = methods[name]()
            t1 = time.perf_counter()
            touch_all(tree)
            t2 = time.perf_counter()
            times[name].append(t1 - t0)
            touched[name].append(t2 - t0)
            del tree
    print(f"state {nbytes / 1e9:.2f} GB (model + AdamW), medians of {args.repeats}\n")
    harness.table(["method", "call (s)", "call + first touch of every tensor (s)"],
                  [[name, f"{statistics.median(times[name]):.3f}", f"{statistics.median(touched[name]):.3f}"]
                   for name in names])
    for r in repos.values():
        r.close()
    shutil.rmtree(disk, ignore_errors=True)
    if shm:
        shutil.rmtree(shm, ignore_errors=True)
    del ref


if __name__ == "__main__":
    main()
