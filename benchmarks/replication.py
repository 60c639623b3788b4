"""Replicated node-local tiers: recovery after losing a node, and the training stall replication adds.

Four simulated nodes (one gloo rank each, tier 0 in its own /dev/shm directory) hold an FSDP2
stack of Linear(WIDTH, WIDTH) layers with AdamW state (--mib in all, spread over the nodes).
Each rank's shard is its node's part, so a lost node's part exists only on the shared tier
and, with replicas=1, on the next node.

Recovery: after two saves, node 1 is lost (its tier-0 directory wiped; the job restarts with
its processes new). Timed, slowest rank, from opening the repository to the end of restore
(repeated --repeats times, medians):
  - peers: tier 0 with replicas=1 (node 1's part comes back from node 2's memory);
  - shared disk: tier 0 without replicas over a local-disk shared tier, the page cache dropped
    before the restart where the machine allows it (restore then reads the shared tier);
  - S3: the same over a moto S3 server (--s3).
Stall: a loop of --steps training steps checkpointing every --every steps through a
Checkpointer (asynchronous saves), with replicas=1 and with replicas=0, against the same loop
without checkpoints; stall per checkpoint = (loop - baseline) / checkpoints, slowest rank,
median over --repeats runs in rotating order. Also the time the loop spends inside
Checkpointer.step per checkpoint (what the training waits for, apart from the CPU the
background work takes from it where the cores are all busy).

    python -m benchmarks replication --mib 2048 --repeats 3 --s3
"""

import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

warnings.filterwarnings("ignore")

WORLD, LAYERS = 4, 8


def width_for(mib: int) -> int:
    """The layer width whose LAYERS layers' weights and two AdamW moments take about `mib` MiB."""
    return max(64, int(((mib << 20) / (LAYERS * 3 * 4)) ** 0.5))


def build(width: int, seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def step(model, opt, width: int) -> None:
    import torch

    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def tiers(case: dict, rank: int):
    import forkpoint as fp

    node = os.path.join(case["nodes"], f"node{rank}")
    return [fp.tier(node, keep=2, local=True, replicas=case["replicas"]),
            fp.tier(case["shared"], **case.get("options", {}))]


def worker(rank: int, job: str, case: dict, rendezvous: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    import forkpoint as fp

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    width = case["width"]
    model, opt = build(width, seed=0 if job != "restore" else 7)
    step(model, opt, width)
    result = {}
    if job == "save":
        repo = fp.dist.Repo(tiers=tiers(case, rank), create=True, timeout=600)
        for i in range(2):
            step(model, opt, width)
            repo.save({"train": fp.dist.TrainState(model, opt)}, step=i)
        result["replicated"] = repo.replicated("main")
        repo.drain()
        repo.close()
    elif job == "restore":
        dist.barrier()
        start = time.perf_counter()
        repo = fp.dist.Repo(tiers=tiers(case, rank), timeout=600)
        version = repo.restore({"train": fp.dist.TrainState(model, opt)}, "main")
        result["seconds"] = time.perf_counter() - start
        result["version"] = version.id
        recovery = repo.replicator.last_recovery if repo.replicator else None
        result["from_peers"] = recovery.from_peers if recovery else 0
        repo.close()
    elif job == "loop":
        repo = fp.dist.Repo(tiers=tiers(case, rank), create=True, timeout=600) if case["every"] else None
        ck = fp.Checkpointer(repo, {"train": fp.dist.TrainState(model, opt)}, every=case["every"]) \
            if repo else None
        dist.barrier()
        start, blocked, cpu = time.perf_counter(), 0.0, time.process_time()
        for s in range(case["steps"]):
            step(model, opt, width)
            if ck:
                before = time.perf_counter()
                ck.step(s)
                blocked += time.perf_counter() - before
        result["seconds"] = time.perf_counter() - start
        result["blocked"] = blocked
        result["cpu"] = time.process_time() - cpu  # every thread of the rank, gloo's included
        if ck:
            ck.close()
            repo.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def launch(job: str, case: dict) -> list[dict]:
    """Run `job` on WORLD spawned ranks; every rank's result."""
    out = tempfile.mkdtemp(prefix="fp-repl-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, job, case, os.path.join(out, "rendezvous"), out))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = []
    for r in range(WORLD):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"{job}: rank {r} failed (exit code {procs[r].exitcode})")
        results.append(json.load(open(path)))
    shutil.rmtree(out)
    return results


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def recovery_case(name: str, base: str, width: int, replicas: int, shared: str, options: dict,
                  repeats: int) -> dict:
    """Save twice, then `repeats` times: lose node 1 and time the restart's restore."""
    case = {"nodes": os.path.join("/dev/shm", f"fp-bench-{name}"), "shared": shared, "options": options,
            "width": width, "replicas": replicas}
    shutil.rmtree(case["nodes"], ignore_errors=True)
    saved = launch("save", case)
    times, dropped = [], False
    for _ in range(repeats):
        lost = os.path.join(case["nodes"], "node1")
        shutil.rmtree(lost, ignore_errors=True)
        dropped = drop_caches()
        results = launch("restore", case)
        times.append(max(r["seconds"] for r in results))
    shutil.rmtree(case["nodes"], ignore_errors=True)
    return {"case": name, "seconds": statistics.median(times), "runs": times, "cache_dropped": dropped,
            "replicated": saved[0]["replicated"], "from_peers": results[1]["from_peers"]}


def stall(base: str, width: int, steps: int, every: int, repeats: int) -> dict:
    """Median stall per checkpoint with and without replicas, against the loop without checkpoints."""
    runs = {"none": [], "replicas=0": [], "replicas=1": []}
    blocked = {"replicas=0": [], "replicas=1": []}
    cpu = {"none": [], "replicas=0": [], "replicas=1": []}
    for i in range(repeats):
        order = list(runs)[i % 3:] + list(runs)[:i % 3]
        for name in order:
            case = {"nodes": "/dev/shm/fp-bench-loop", "shared": os.path.join(base, f"loop-{i}-{name}"),
                    "width": width, "steps": steps, "every": 0 if name == "none" else every,
                    "replicas": 1 if name == "replicas=1" else 0}
            shutil.rmtree(case["nodes"], ignore_errors=True)
            results = launch("loop", case)
            runs[name].append(max(r["seconds"] for r in results))
            cpu[name].append(sum(r["cpu"] for r in results))
            if name in blocked:
                blocked[name].append(max(r["blocked"] for r in results))
            shutil.rmtree(case["nodes"], ignore_errors=True)
            shutil.rmtree(case["shared"], ignore_errors=True)
    checkpoints = steps // every
    base_time = statistics.median(runs["none"])
    out = {"loop_seconds": {k: statistics.median(v) for k, v in runs.items()}, "checkpoints": checkpoints,
           "cpu_seconds": {k: statistics.median(v) for k, v in cpu.items()}}
    for name in ("replicas=0", "replicas=1"):
        out[f"stall_{name}"] = (statistics.median(runs[name]) - base_time) / checkpoints
        out[f"blocked_{name}"] = statistics.median(blocked[name]) / checkpoints
    return out


def main(argv=None) -> int:
    ap = harness.arguments(__doc__, repeats=3, dir_help="where the shared tier goes (default: a temporary directory)")
    ap.add_argument("--mib", type=int, default=2048, help="state size in MiB (weights + AdamW moments)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--s3", action="store_true", help="also recover from a moto S3 server")
    ap.add_argument("--skip-stall", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="fp-bench-repl-")
    width = width_for(args.mib)
    print(f"state: {LAYERS} x Linear({width}, {width}) + AdamW = "
          f"{LAYERS * width * width * 12 / 2**20:.0f} MiB over {WORLD} nodes", flush=True)
    if not args.skip_recovery:
        rows = [recovery_case("peers", base, width, 1, os.path.join(base, "shared-peers"), {}, args.repeats),
                recovery_case("shared disk", base, width, 0, os.path.join(base, "shared-disk"), {}, args.repeats)]
        if args.s3:
            sys.path.insert(0, os.path.dirname(__file__))
            from flush_encode import start_moto

            import s3fs

            endpoint, proc = start_moto()
            try:
                s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("bench")
                rows.append(recovery_case("S3 (moto)", base, width, 0, "s3://bench/run",
                                          {"client_kwargs": {"endpoint_url": endpoint}}, args.repeats))
            finally:
                proc.terminate()
        print("| recover after losing 1 of 4 nodes | restore (s, slowest rank) | runs | objects from peers |")
        print("|---|---|---|---|")
        for r in rows:
            dropped = "" if r["case"] == "peers" or r["cache_dropped"] else " (page cache NOT dropped)"
            print(f"| {r['case']}{dropped} | {r['seconds']:.2f} | {', '.join(f'{t:.2f}' for t in r['runs'])} | "
                  f"{r['from_peers']} |")
        print(f"peers vs shared disk: {rows[1]['seconds'] / rows[0]['seconds']:.1f}x faster" +
              (f"; vs S3: {rows[2]['seconds'] / rows[0]['seconds']:.1f}x" if len(rows) > 2 else ""))
    if not args.skip_stall:
        s = stall(base, width, args.steps, args.every, args.repeats)
        print(f"loop of {args.steps} steps, a checkpoint every {args.every}: " +
              ", ".join(f"{k} {v:.2f} s" for k, v in s["loop_seconds"].items()))
        print(f"stall per checkpoint (loop time added): replicas=0 {s['stall_replicas=0']:.2f} s, replicas=1 "
              f"{s['stall_replicas=1']:.2f} s")
        print("CPU seconds of the loop, all ranks: " +
              ", ".join(f"{k} {v:.1f} s" for k, v in s["cpu_seconds"].items()) +
              f" (this machine has {os.cpu_count()} cores)")
        print(f"time blocked in Checkpointer.step per checkpoint: replicas=0 {s['blocked_replicas=0']:.2f} s, "
              f"replicas=1 {s['blocked_replicas=1']:.2f} s")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
