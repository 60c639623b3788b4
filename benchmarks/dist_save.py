"""Distributed save and restore: forkpoint vs DCP on an FSDP2 model, and commit latency.

4 ranks (gloo, CPU) hold an FSDP2-sharded stack of Linear(2048, 2048) layers with AdamW
state (~500 MB in all). Each repeat trains one step (so every tensor changes), then times,
in rotating order: forkpoint sync save, forkpoint async save (stall = until the call
returned and the capture finished, so training may go on; total = until committed),
dcp.save, and dcp.async_save (stall = until it returned; total = until its future is
done). Then the stall per checkpoint inside a training loop: the extra time of a loop that
checkpoints every 5 steps (forkpoint's asynchronous Checkpointer, or dcp.async_save) over
the same loop without checkpoints. Every method starts from the live model and optimizer: DCP's times include
get_state_dict, as forkpoint's include fp.dist.TrainState's (which calls it). Times are the slowest rank's. Then 2 ranks restore the newest forkpoint version and
the newest DCP checkpoint into a freshly initialised model and optimizer (page cache
dropped before each when possible), measured whole (from a fresh model: get_state_dict,
whose optimizer initialisation runs one optimizer step, the read, set_state_dict) and as
the read alone (into state dicts already initialised). Last, sync saves of a tiny state on 1, 2, 4, 8 and 16
ranks measure the cost of coordination and commit. With --node-local, only: sync saves to a
node-local tier 0 in /dev/shm against saves to the shared disk, and the coordinated flush.

    python benchmarks/dist_save.py --repeats 3 --dir /work/bench-dist
"""

import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

warnings.filterwarnings("ignore")

LAYERS, WIDTH = 10, 2048
LOOP_STEPS, EVERY = 10, 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_caches() -> bool:
    """Drop the page cache (as benchmarks/tiers_restore.py does), so restores read the disk."""
    from tiers_restore import drop_caches as drop

    return drop()


def build(seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt):
    import torch

    model(torch.randn(8, WIDTH)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return slowest(time.perf_counter() - start), out


def save_phase(rank, world, args, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import forkpoint as fp

    model, opt = build(0)
    step(model, opt)
    repo = fp.dist.Repo(os.path.join(args.dir, "fp-repo"), create=True, timeout=120)
    state = {"train": fp.dist.TrainState(model, opt)}
    repo.warm_staging(state)
    results = {k: [] for k in ("fp_sync", "fp_async_stall", "fp_async_total", "dcp", "dcp_async_stall",
                               "dcp_async_total")}
    nbytes = sum(t.to_local().nbytes for t in _tensors(get_state_dict(model, opt)))
    methods = ["fp_sync", "fp_async", "dcp", "dcp_async"]
    for r in range(args.repeats):
        for name in methods[r % 4:] + methods[:r % 4]:
            step(model, opt)
            path = os.path.join(args.dir, f"dcp-{name}-{r}")
            if name == "fp_sync":
                results["fp_sync"].append(timed(lambda: repo.save(state, step=r, sync=True))[0])
            elif name == "fp_async":
                dist.barrier()
                start = time.perf_counter()
                pending = repo.save(state, step=r, sync=False)
                pending.wait_capture()
                stall = time.perf_counter() - start
                pending.wait()
                total = time.perf_counter() - start
                results["fp_async_stall"].append(slowest(stall))
                results["fp_async_total"].append(slowest(total))
            elif name == "dcp":
                def save():
                    msd, osd = get_state_dict(model, opt)
                    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

                results["dcp"].append(timed(save)[0])
            else:
                dist.barrier()
                start = time.perf_counter()
                msd, osd = get_state_dict(model, opt)
                future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path)
                stall = time.perf_counter() - start
                future.result()
                total = time.perf_counter() - start
                results["dcp_async_stall"].append(slowest(stall))
                results["dcp_async_total"].append(slowest(total))
            dist.barrier()
            if rank == 0 and name.startswith("dcp") and r < args.repeats - 1:
                shutil.rmtree(path, ignore_errors=True)
    loops = in_loop_stalls(rank, args, model, opt, repo, state)
    repo.close()
    return {"results": results, "loops": loops, "local_bytes": nbytes}


def in_loop_stalls(rank, args, model, opt, repo, state) -> dict:
    """Seconds per loop of LOOP_STEPS training steps with no checkpoint, with an
    asynchronous forkpoint Checkpointer (its hooks wait only where the optimizer would
    overwrite state not yet captured), and with dcp.async_save (on its own process group and
    waiting for the previous save before the next, as DCP recommends); a checkpoint every
    EVERY steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import forkpoint as fp

    import torch.distributed as dist

    ck = fp.Checkpointer(repo, state, every=EVERY, branch="loop")
    dcp_group = dist.new_group(backend="gloo")
    times = {"none": [], "fp": [], "dcp_async": []}
    methods = list(times)
    for r in range(args.repeats):
        for name in methods[r % 3:] + methods[:r % 3]:
            future = None

            def loop():
                nonlocal future
                for i in range(LOOP_STEPS):
                    step(model, opt)
                    if name == "fp":
                        ck.step(i)
                    elif name == "dcp_async" and i % EVERY == EVERY - 1:
                        if future is not None:
                            future.result()
                        msd, osd = get_state_dict(model, opt)
                        future = dcp.async_save({"model": msd, "optim": osd},
                                                checkpoint_id=os.path.join(args.dir, f"loop-{r}-{i}"),
                                                process_group=dcp_group)
                if name == "fp":
                    ck.wait()
                elif future is not None:
                    future.result()

            times[name].append(timed(loop)[0])
    ck.close()
    return times


def _tensors(sds):
    import torch

    out = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, torch.Tensor) and hasattr(x, "to_local"):
            out.append(x)

    walk(sds)
    return out


def restore_phase(rank, world, args, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import forkpoint as fp

    last = args.repeats - 1
    results = {"fp_restore": [], "dcp_load": [], "fp_read": [], "dcp_read": []}
    for r in range(args.repeats):
        for name in (("fp", "dcp", "fp_read", "dcp_read") if r % 2 == 0 else ("dcp_read", "fp_read", "dcp", "fp")):
            if name.endswith("_read"):
                model, opt = build(1)
                msd, osd = get_state_dict(model, opt)
                if rank == 0:
                    drop_caches()
                dist.barrier()
                if name == "fp_read":
                    repo = fp.dist.Repo(os.path.join(args.dir, "fp-repo"))
                    results[name].append(timed(lambda: repo.restore({"train": {"model": msd, "optim": osd}},
                                                                    "main"))[0])
                    repo.close()
                else:
                    path = os.path.join(args.dir, f"dcp-dcp-{last}")
                    results[name].append(timed(lambda: dcp.load({"model": msd, "optim": osd}, checkpoint_id=path))[0])
                continue
            model, opt = build(1)
            if rank == 0:
                drop_caches()
            dist.barrier()
            if name == "fp":
                repo = fp.dist.Repo(os.path.join(args.dir, "fp-repo"))
                results["fp_restore"].append(timed(lambda: repo.restore({"train": fp.dist.TrainState(model, opt)},
                                                                        "main"))[0])
                repo.close()
            else:
                path = os.path.join(args.dir, f"dcp-dcp-{last}")

                def load():
                    msd, osd = get_state_dict(model, opt)
                    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
                    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

                results["dcp_load"].append(timed(load)[0])
    return {"results": results}


def commit_phase(rank, world, args, out):
    import torch

    import forkpoint as fp

    repo = fp.dist.Repo(os.path.join(args.dir, f"commit-{world}"), create=True, timeout=120)
    times = []
    for i in range(args.commits + 2):
        state = {"x": torch.full((256,), float(i)), "local": fp.RankLocal(torch.full((16,), float(rank)))}
        times.append(timed(lambda: repo.save(state, step=i))[0])
    size = os.path.getsize(os.path.join(args.dir, f"commit-{world}", "versions", repo.version("main").id + ".json"))
    repo.close()
    return {"times": times[2:], "manifest_bytes": size}


def node_local_phase(rank, world, args, out):
    """Sync saves to a shared disk repository against saves to a node-local tier 0 in /dev/shm
    (ranks 0-1 and 2-3 as two nodes) over the same disk, and the time until the coordinated
    flush has committed each version on the disk."""
    import torch.distributed as dist

    import forkpoint as fp

    model, opt = build(0)
    step(model, opt)
    state = {"train": fp.dist.TrainState(model, opt)}
    shm = os.path.join(args.node_dir, f"fp-bench-{os.getpid() if rank == 0 else ''}")
    base = [shm]
    dist.broadcast_object_list(base, src=0)
    shared = fp.dist.Repo(os.path.join(args.dir, "nl-shared"), create=True, timeout=120)
    top = "mem://nl" if args.node_dir == "mem" else os.path.join(base[0], f"node{rank // 2}")
    tiered = fp.dist.Repo(tiers=[fp.tier(top, keep=2, local=True), os.path.join(args.dir, "nl-below")],
                          create=True, timeout=120)
    shared.warm_staging(state)
    tiered.warm_staging(state)
    results = {"shared_save": [], "local_save": [], "local_flushed": []}
    try:
        for r in range(args.repeats):
            for name in (["shared", "local"] if r % 2 == 0 else ["local", "shared"]):
                step(model, opt)
                if name == "shared":
                    results["shared_save"].append(timed(lambda: shared.save(state, step=r))[0])
                    continue
                dist.barrier()
                start = time.perf_counter()
                tiered.save(state, step=r)
                saved = time.perf_counter() - start
                tiered.drain()
                dist.barrier()
                flushed = time.perf_counter() - start
                results["local_save"].append(slowest(saved))
                results["local_flushed"].append(slowest(flushed))
    finally:
        shared.close()
        tiered.close()
        dist.barrier()
        if rank == 0 and args.node_dir != "mem":
            shutil.rmtree(base[0], ignore_errors=True)
    return {"results": results}


def worker(rank, world, port, phase, args, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = globals()[f"{phase}_phase"](rank, world, args, out)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(phase: str, world: int, args) -> dict:
    out = os.path.join(args.dir, f"{phase}-{world}.json")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, phase, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"{phase} on {world} ranks failed: exit codes {[p.exitcode for p in procs]}")
    with open(out) as f:
        return json.load(f)


def main():
    parser = harness.arguments(__doc__, repeats=3, dir_default="/tmp/forkpoint-bench-dist")
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--skip-save", action="store_true", help="only the commit latency table")
    parser.add_argument("--node-local", action="store_true",
                        help="only: sync saves to a node-local tier 0 (--node-dir) against a shared disk")
    parser.add_argument("--node-dir", default="/dev/shm",
                        help="where --node-local puts each node's tier 0 (mem: a mem:// tier per process)")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    med = statistics.median
    report = {}
    if args.node_local:
        res = {k: med(v) for k, v in launch("node_local", 4, args)["results"].items()}
        print(f"4 ranks as 2 nodes, medians of {args.repeats}, slowest rank: sync save to the shared disk "
              f"{res['shared_save']:.3f} s; to a node-local tier 0 in {args.node_dir} {res['local_save']:.3f} s "
              f"(ratio {res['local_save'] / res['shared_save']:.2f}), committed on the disk below after "
              f"{res['local_flushed']:.3f} s")
        print(json.dumps(res))
        return
    if not args.skip_save:
        saved = launch("save", 4, args)
        res = saved["results"]
        report["save"] = {k: round(med(v), 3) for k, v in res.items()}
        report["state_mb_per_rank"] = round(saved["local_bytes"] / 1e6, 1)
        loops = {k: med(v) for k, v in saved["loops"].items()}
        per = LOOP_STEPS // EVERY
        report["loop"] = {"step_s": round(loops["none"] / LOOP_STEPS, 3),
                          "fp_stall": round((loops["fp"] - loops["none"]) / per, 3),
                          "dcp_async_stall": round((loops["dcp_async"] - loops["none"]) / per, 3)}
        restored = launch("restore", 2, args)
        report["restore_4_to_2"] = {k: round(med(v), 3) for k, v in restored["results"].items()}
        s, r = report["save"], report["restore_4_to_2"]
        print(f"state: ~{4 * report['state_mb_per_rank']:.0f} MB on 4 ranks; medians of {args.repeats}, slowest rank")
        print(f"  save (sync)       forkpoint {s['fp_sync']:.3f} s   dcp.save {s['dcp']:.3f} s   "
              f"ratio {s['fp_sync'] / s['dcp']:.2f}")
        print(f"  async stall       forkpoint {s['fp_async_stall']:.3f} s   dcp.async_save {s['dcp_async_stall']:.3f} s   "
              f"ratio {s['fp_async_stall'] / s['dcp_async_stall']:.2f}")
        lp = report["loop"]
        print(f"  in a training loop ({lp['step_s']:.3f} s/step, a checkpoint every {EVERY} steps), stall per "
              f"checkpoint: forkpoint {lp['fp_stall']:.3f} s   dcp.async_save {lp['dcp_async_stall']:.3f} s")
        print(f"  async total       forkpoint {s['fp_async_total']:.3f} s   dcp.async_save {s['dcp_async_total']:.3f} s")
        print(f"  restore 4->2      forkpoint {r['fp_restore']:.3f} s   dcp.load {r['dcp_load']:.3f} s   "
              f"ratio {r['fp_restore'] / r['dcp_load']:.2f}")
        print(f"  read 4->2 into initialised state dicts: forkpoint {r['fp_read']:.3f} s   dcp.load "
              f"{r['dcp_read']:.3f} s   ratio {r['fp_read'] / r['dcp_read']:.2f}")
    report["commit"] = {}
    print("commit latency (sync save of a tiny state: writes + coordination + commit)")
    for world in (1, 2, 4, 8, 16):
        c = launch("commit", world, args)
        report["commit"][world] = {"median_s": round(med(c["times"]), 4), "manifest_bytes": c["manifest_bytes"]}
        print(f"  {world:2d} ranks: {med(c['times']) * 1000:7.1f} ms   manifest {c['manifest_bytes']} bytes")
    print(json.dumps(report))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
