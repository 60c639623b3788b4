"""Hugging Face export: peak memory of `forkpoint export --format hf` against the state's size.

    python -m benchmarks hf_export [--mib 1024] [--shard 100MB]

Saves a model-like state (float32 matrices of 32 MiB) into a local repository, then, each in
a fresh process, measures the peak resident memory (VmHWM) of: importing torch and
forkpoint only (the baseline), loading the whole state with repo.load, and exporting it as
a Hugging Face directory in shards of `--shard`. The export holds about one shard at a time.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PEAK = """
import json, sys, time
import torch, forkpoint as fp
from forkpoint.cli.hf_export import export_hf, parse_size
what, url, out, shard = sys.argv[1:5]
start = time.perf_counter()
if what == "load":
    tree = fp.Repo(url).load("main")
elif what == "export":
    export_hf(fp.Repo(url), "main", out, max_shard_bytes=parse_size(shard))
# VmHWM: this process image's peak (ru_maxrss would carry the parent's over exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_mib": hwm / 1024, "seconds": time.perf_counter() - start}))
"""


def main() -> None:
    p = harness.arguments(__doc__.splitlines()[0], repeats=None, directory=False)
    p.add_argument("--mib", type=int, default=1024, help="size of the model state")
    p.add_argument("--shard", default="100MB", help="--max-shard-size of the export")
    args = p.parse_args()
    import forkpoint as fp

    tmp = tempfile.mkdtemp(prefix="hf-export-")
    try:
        url = os.path.join(tmp, "repo")
        rng = np.random.default_rng(0)
        n = args.mib // 32
        state = {"model": {f"layers.{i}.weight": rng.standard_normal((2048, 4096), dtype=np.float32)
                           for i in range(n)}}
        fp.Repo(url, create=True).save(state, step=1)
        del state
        results = {}
        for what in ("baseline", "load", "export"):
            out = os.path.join(tmp, f"export-{time.monotonic_ns()}")
            proc = subprocess.run([sys.executable, "-c", PEAK, what, url, out, args.shard],
                                  capture_output=True, text=True, check=True)
            results[what] = json.loads(proc.stdout.strip().splitlines()[-1])
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        base = results["baseline"]["peak_mib"]
        print(f"state {n * 32} MiB in {n} tensors; export in shards of {args.shard}: {len(files)} files")
        print(f"{'':<22}{'peak RSS MiB':>14}{'above baseline':>16}{'seconds':>9}")
        for what, r in results.items():
            print(f"{what:<22}{r['peak_mib']:>14.0f}{r['peak_mib'] - base:>16.0f}{r['seconds']:>9.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
