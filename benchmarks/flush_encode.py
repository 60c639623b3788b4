"""Flushing from a memory tier under codec="auto": raw copies against encoding on the way down.

The 24M-parameter MLP + AdamW state of benchmarks/codecs.py (fp32 or bf16) is saved
synchronously into tiers=[mem://, LOWER], a training step before each save, by two
repositories in alternation: codec="raw" and codec="auto". Saves into the memory tier stay raw
under auto (raw measures faster there); each flush to LOWER encodes the auto objects where
LOWER's AutoChoice, learnt from the flushes to it, says encoded writes are faster (an object
store tries encoding first). LOWER is a real S3-compatible server (moto in server mode,
started here) or a local directory. Reported per repository: the save (commit into memory),
the flush that follows it (repo.drain()), the process CPU of both, and the bytes the lower
tier holds per version. Medians over the saves after each repository's first.

    python benchmarks/flush_encode.py --lower s3 --saves 8
    python benchmarks/flush_encode.py --lower /work/flush-bench --saves 8
"""

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import torch

import forkpoint as fp
from forkpoint.format.objects import object_key

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

def _codecs_bench():
    """benchmarks/codecs.py as a module (its name is the standard library's too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("codecs_bench", os.path.join(os.path.dirname(__file__), "codecs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_bench = _codecs_bench()
trained_state, train_step, timed = _bench.trained_state, _bench.train_step, _bench.timed

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto():
    """(endpoint URL, process) of a moto S3 server on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(CREDS)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url, timeout=1)
            return url, proc
        except Exception:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def lower_bytes(repo, vid: str) -> int:
    """Bytes the lower tier's objects of version `vid` take."""
    low = repo.stores[-1]
    objects = {c.object for leaf in repo.manifest(vid).leaves for c in leaf.chunks}
    return sum(low.size(object_key(o)) for o in objects)


def main() -> None:
    ap = harness.arguments(__doc__, repeats=None, directory=False)
    ap.add_argument("--lower", default="s3", help="'s3' (a moto server) or a directory")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    state = trained_state(dtype)
    proc = None
    if args.lower == "s3":
        import s3fs

        endpoint, proc = start_moto()
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(**opts).mkdir("flush-bench")
        lower = lambda name: fp.tier(f"s3://flush-bench/{name}", **opts)  # noqa: E731
        cleanup = lambda: None  # noqa: E731
    else:
        root = tempfile.mkdtemp(dir=args.lower)
        lower = lambda name: fp.tier(os.path.join(root, name))  # noqa: E731
        cleanup = lambda: shutil.rmtree(root, ignore_errors=True)  # noqa: E731
    try:
        repos = {codec: fp.Repo(tiers=[f"mem://{uuid.uuid4().hex}", lower(codec)], create=True, codec=codec)
                 for codec in ("raw", "auto")}
        rows = {codec: [] for codec in repos}
        for i in range(args.saves):
            for codec, repo in (repos.items() if i % 2 == 0 else reversed(repos.items())):
                train_step(state, dtype)
                v, save_s, save_cpu = timed(lambda: repo.save(state, step=i))
                _, flush_s, flush_cpu = timed(repo.drain)
                rows[codec].append((save_s, flush_s, save_cpu + flush_cpu, lower_bytes(repo, v.id),
                                    v.logical_bytes))
        print(f"lower tier: {args.lower}, {args.dtype}, {args.saves} saves each; medians of saves 2..{args.saves}")
        print("| codec | save into memory (s) | flush (s) | CPU, save + flush (core-s) | lower tier MB per version | ratio |")
        print("|---|---|---|---|---|---|")
        for codec, r in rows.items():
            r = r[1:]
            med = [statistics.median(x[j] for x in r) for j in range(5)]
            print(f"| {codec} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.2f} | {med[3] / 1e6:.0f} | "
                  f"{med[4] / med[3]:.3f} |")
        for codec, r in rows.items():
            print(codec, "flush s per save:", " ".join(f"{x[1]:.2f}" for x in r))
        for repo in repos.values():
            repo.close()
    finally:
        cleanup()
        if proc is not None:
            proc.terminate()


if __name__ == "__main__":
    main()
