"""Worker functions for the multi-process tests (spawned by torch.multiprocessing)."""

import datetime
import faulthandler
import json
import os
import signal
import threading
import traceback
import time

import torch
import torch.distributed as dist

import forkpoint as fp
from forkpoint.format.objects import object_key


INIT_SECONDS = 60
"""How long a rank waits for the others to join the process group before it raises."""


def init(rank: int, world: int, rendezvous: str) -> None:
    """Join the launch's process group through the file `rendezvous` (a fresh one per launch:
    no port that another test could take between its choice and its use)."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=INIT_SECONDS))


def build_fsdp(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 13), torch.nn.Linear(13, 5))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def build_ddp(seed: int = 1):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(7, 600), torch.nn.Linear(600, 600)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, kind: str, steps: int, rank: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        if kind == "fsdp":
            loss = model(torch.randint(0, 4096, (8,), generator=g)).pow(2).mean()
        else:
            loss = model(torch.randn(4, 7, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(train_state) -> dict:
    """Every tensor of a TrainState as a full (unsharded) tensor, keyed by a flat path."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}")
        elif isinstance(obj, torch.Tensor):
            out[path] = full(obj).detach().clone()

    walk(train_state.state_dict(), "")
    return out


def main(rank, name, world, rendezvous, out, *args):
    """Spawned entry: run `_<name>`(rank, world, out, *args) in a process group; write its
    result or traceback to out/rank<r>.json. SIGUSR1 writes every thread's stack to
    out/rank<r>.stack (the launcher sends it to a rank that hangs); out/rank<r>.phase says
    whether the rank is still joining the process group ("init") or past it ("run")."""
    stacks = open(os.path.join(out, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _write(os.path.join(out, f"rank{rank}.phase"), "init")
    try:
        init(rank, world, rendezvous)
        _write(os.path.join(out, f"rank{rank}.phase"), "run")
        record = {"ok": True, "result": globals()["_" + name](rank, world, out, *args)}
    except BaseException as e:
        record = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _save(rank, world, out, url, steps):
    fsdp, fopt = build_fsdp()
    ddp, dopt = build_ddp()
    train(fsdp, fopt, "fsdp", steps, rank)
    train(ddp, dopt, "ddp", steps, rank)
    repo = fp.dist.Repo(url, create=True, timeout=60)
    sampler = fp.dist.DistributedResumableSampler(100, seed=3)
    it = iter(sampler)
    taken = [next(it) for _ in range(5)]
    fsdp_state = fp.dist.TrainState(fsdp, fopt)
    state = {"fsdp": fsdp_state, "ddp": {"model": ddp, "optim": dopt}, "rng": fp.RNGState(),
             "data": sampler, "note": fp.RankLocal({"rank": torch.tensor([rank])}, on_resize="first")}
    torch.manual_seed(1000 + rank)
    version = repo.save(state, step=steps, message=f"saved by {world} ranks")
    next_rand = float(torch.rand(1))
    reference = full_state(fsdp_state)
    reference.update({f"ddp{k}": v.clone() for k, v in ddp.module.state_dict().items()})
    if rank == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
    return {"version": version.id, "taken": taken, "next_rand": next_rand,
            "written": repo.stats().get("stages", {}).get("write", {}).get("bytes_done", 0)}


def _restore(rank, world, out, cases):
    """Restore each (repository, reference file) into freshly initialised models; compare."""
    results = []
    for url, reference_path in cases:
        fsdp, fopt = build_fsdp(seed=99)
        ddp, dopt = build_ddp(seed=98)
        repo = fp.dist.Repo(url)
        sampler = fp.dist.DistributedResumableSampler(100, seed=3)
        fsdp_state = fp.dist.TrainState(fsdp, fopt)
        note = fp.RankLocal({"rank": torch.tensor([-1])}, on_resize="first")
        state = {"fsdp": fsdp_state, "ddp": {"model": ddp, "optim": dopt}, "rng": fp.RNGState(),
                 "data": sampler, "note": note}
        version = repo.restore(state, "main")
        reference = torch.load(reference_path)
        got = full_state(fsdp_state)
        got.update({f"ddp{k}": v for k, v in ddp.module.state_dict().items()})
        momentum = [k for k, v in dopt.state.items() if "momentum_buffer" in v]
        bad = sorted(k for k in reference if k in got and not torch.equal(reference[k], got[k]))
        results.append({"version": version.id, "bad": bad, "keys": sorted(got), "ref_keys": sorted(reference),
                        "consumed": sampler.consumed, "rest": list(iter(sampler)), "note": int(note.obj["rank"][0]),
                        "rand": float(torch.rand(1)), "momentum": len(momentum)})
        repo.close()
    return results


def _killed_save(rank, world, out, url, victim):
    repo = fp.dist.Repo(url, create=True, timeout=5)
    model, opt = build_fsdp()
    if rank == victim:
        write = repo.store.write
        calls = []

        def write_then_die(key, parts):
            calls.append(key)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(key, parts)

        repo.store.write = write_then_die
    start = time.monotonic()
    try:
        repo.save({"train": fp.dist.TrainState(model, opt)}, step=1)
    except fp.dist.DistSaveError as e:
        return {"raised": str(e), "heads": repo.branches(), "seconds": time.monotonic() - start}
    return {"raised": None}




def _crash_point_save(rank, world, out, url, victim, at):
    """Each rank saves version `rank`-independent step 2 on top of step 1. The `victim` rank
    dies (SIGKILL) right before its `at`-th mutating storage operation of that second save
    (at < 0: nobody dies; the result lists each rank's operations as "NAME FOLDER")."""
    from forkpoint.storage.local import LocalStore

    repo = fp.dist.Repo(url, create=True, timeout=3)
    model, opt = build_fsdp()
    state = {"train": fp.dist.TrainState(model, opt), "note": fp.RankLocal({"r": torch.tensor([rank])})}
    repo.save(state, step=1)
    train(model, opt, "fsdp", 1, rank)
    counted = []
    for name in ("write", "create_exclusive", "delete", "touch"):
        real = getattr(LocalStore, name)

        def op(store, key, *args, _real=real, _name=name, **kwargs):
            counted.append(f"{_name} {str(key).split('/')[0]}")
            if rank == victim and len(counted) > at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(store, key, *args, **kwargs)

        setattr(LocalStore, name, op)
    try:
        version = repo.save(state, step=2)
    except fp.dist.DistSaveError as e:
        return {"raised": str(e), "ops": counted}
    return {"raised": None, "ops": counted, "version": version.id}


def _dcp_save(rank, world, out, url):
    """FSDP2 state saved by the real dcp.save through forkpoint's Writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import forkpoint.dcp

    model, opt = build_fsdp()
    train(model, opt, "fsdp", 2, rank)
    repo = fp.dist.Repo(url, create=True)
    msd, osd = get_state_dict(model, opt)
    writer = forkpoint.dcp.Writer(repo, branch="dcp", step=2)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    reference = full_state(fp.dist.TrainState(model, opt))
    if rank == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
    native = repo.save({"train": fp.dist.TrainState(model, opt)}, branch="native", step=2)
    return {"version": writer.version.id if writer.version else None, "native": native.id}


def _dcp_load(rank, world, out, url, reference_path):
    """dcp.load through forkpoint's Reader, of the DCP-written and the native version."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import forkpoint.dcp

    repo = fp.dist.Repo(url)
    reference = torch.load(reference_path)
    results = {}
    for ref, prefix in (("dcp", ""), ("native", "train.")):
        model, opt = build_fsdp(seed=7)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load({prefix + "model": msd, prefix + "optim": osd} if prefix else sd,
                 storage_reader=forkpoint.dcp.Reader(repo, ref))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        got = full_state(fp.dist.TrainState(model, opt))
        results[ref] = sorted(k for k in reference if not torch.equal(reference[k], got[k]))
    return results


def _three_versions(repo, rank):
    """Train one FSDP step before each of three saves; return (version ids, full states)."""
    fsdp, fopt = build_fsdp()
    references, ids = [], []
    for _ in range(3):
        train(fsdp, fopt, "fsdp", 1, rank)
        state = fp.dist.TrainState(fsdp, fopt)
        ids.append(repo.save({"fsdp": state}).id)
        references.append(full_state(state))
    return ids, references


def _mismatches(repo, ids, references) -> list[str]:
    """Restore each version into a fresh FSDP model; list the tensors that differ."""
    bad = []
    for vid, reference in zip(ids, references):
        fresh, fresh_opt = build_fsdp(seed=7)
        state = fp.dist.TrainState(fresh, fresh_opt)
        repo.restore({"fsdp": state}, vid)
        got = full_state(state)
        bad += [f"{vid}:{k}" for k in reference if not torch.equal(reference[k], got[k])]
    return bad


def _delta_saves(rank, world, out, url):
    """Three versions with training between them, deltas on; restore each into a fresh model."""
    repo = fp.dist.Repo(url, create=True, timeout=60, codec="lossless", delta=fp.Delta(max_chain=3))
    ids, references = _three_versions(repo, rank)
    deltas = [sum(1 for leaf in repo.manifest(v).leaves for c in leaf.chunks if c.delta) for v in ids]
    bad = _mismatches(repo, ids, references)
    repo.close()
    return {"deltas": deltas, "bad": bad}


def _tiered_saves(rank, world, out, fast, slow):
    """Three versions into [fast tier, slow tier] (one node: every rank reaches both)."""
    repo = fp.dist.Repo(tiers=[fp.tier(fast, keep=1), slow], create=True, timeout=60)
    ids, references = _three_versions(repo, rank)
    repo.drain()
    dist.barrier()
    where = [repo.where(v) for v in ids]
    repo.close()
    if rank == 0:
        torch.save(references, os.path.join(out, "references.pt"))
    return {"ids": ids, "where": where}


def _tiered_restore(rank, world, out, fast, slow, ids, references_path):
    """Restore every version on `world` ranks through the tiers (the fast one may be gone)."""
    repo = fp.dist.Repo(tiers=[fast, slow], create=True, timeout=60)
    bad = _mismatches(repo, ids, torch.load(references_path))
    repo.close()
    return {"bad": bad}


def _node_tiers(nodes, shared, rank, node_size=2):
    """Tier 0 local to a simulated node (ranks r // node_size share it), the shared tier below."""
    node = os.path.join(nodes, f"node{rank // node_size}")
    return [fp.tier(node, keep=2, flush_every=2, local=True), shared]


def _mixed_state(fsdp, fopt, ddp, dopt, rank, step):
    return {"fsdp": fp.dist.TrainState(fsdp, fopt), "ddp": {"model": ddp, "optim": dopt},
            "note": fp.RankLocal({"rank": torch.tensor([rank, step])}, on_resize="first")}


def _mixed_reference(state) -> dict:
    reference = full_state(state["fsdp"])
    reference.update({f"ddp{k}": v.clone() for k, v in state["ddp"]["model"].module.state_dict().items()})
    return reference


def _node_local_saves(rank, world, out, nodes, shared):
    """Three versions of FSDP + DDP + rank-local state (one asynchronous) into node-local tier 0."""
    fsdp, fopt = build_fsdp()
    ddp, dopt = build_ddp()
    repo = fp.dist.Repo(tiers=_node_tiers(nodes, shared, rank), create=True, timeout=60)
    ids, references = [], []
    for step in range(3):
        train(fsdp, fopt, "fsdp", 1, rank)
        train(ddp, dopt, "ddp", 1, rank)
        state = _mixed_state(fsdp, fopt, ddp, dopt, rank, step)
        saved = repo.save(state, step=step, sync=step != 1)
        ids.append((saved if step != 1 else saved.wait()).id)
        references.append(_mixed_reference(state))
    repo.drain()
    dist.barrier()
    result = {"ids": ids, "node_ranks": repo.node_ranks, "where": [repo.where(v) for v in ids]}
    repo.close()
    if rank == 0:
        torch.save(references, os.path.join(out, "references.pt"))
    return result


def _node_local_restore(rank, world, out, nodes, shared, references_path, node_size):
    """Restore "main" into fresh models through node-local tiers; compare with every reference."""
    fsdp, fopt = build_fsdp(seed=99)
    ddp, dopt = build_ddp(seed=98)
    repo = fp.dist.Repo(tiers=_node_tiers(nodes, shared, rank, node_size), create=True, timeout=60)
    state = _mixed_state(fsdp, fopt, ddp, dopt, -1, -1)
    version = repo.restore(state, "main")
    got = _mixed_reference(state)
    matches = [i for i, ref in enumerate(torch.load(references_path))
               if all(torch.equal(ref[k], got[k]) for k in ref)]
    note = state["note"].obj["rank"].tolist()
    repo.close()
    return {"version": version.id, "matches": matches, "note": note}


def _memory_tier_saves(rank, world, out, shared):
    """A Checkpointer saving asynchronously into a process-private memory tier over a shared disk."""
    fsdp, fopt = build_fsdp()
    repo = fp.dist.Repo(tiers=[fp.tier("mem://run", keep=1), shared], create=True, timeout=60)
    ck = fp.Checkpointer(repo, {"fsdp": fp.dist.TrainState(fsdp, fopt)}, every=1)
    for step in range(3):
        train(fsdp, fopt, "fsdp", 1, rank)
        ck.step(step)
    ck.close()
    repo.drain()
    reference = full_state(fp.dist.TrainState(fsdp, fopt))
    result = {"node_ranks": repo.node_ranks, "head": repo.head()}
    repo.close()
    if rank == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
    return result


def _shared_restore(rank, world, out, shared, reference_path):
    """Restore the shared tier's head into a fresh FSDP model; list the tensors that differ."""
    repo = fp.dist.Repo(shared, timeout=60)
    fresh, fresh_opt = build_fsdp(seed=7)
    state = fp.dist.TrainState(fresh, fresh_opt)
    version = repo.restore({"fsdp": state}, "main")
    reference, got = torch.load(reference_path), full_state(state)
    repo.close()
    return {"version": version.id, "bad": [k for k in reference if not torch.equal(reference[k], got[k])]}


def _node_local_flush_failure(rank, world, out, nodes, shared):
    """A node-local tier needs a shared tier below; a rank whose flush copies fail makes the
    coordinated flush fail on every rank, and the version stays on the nodes only."""
    refusals = []
    for tiers in ([fp.tier(os.path.join(nodes, f"alone{rank}"), local=True)],
                  [fp.tier(os.path.join(nodes, f"unbounded{rank}"), local=True), shared]):
        try:
            fp.dist.Repo(tiers=tiers, create=True)
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    if rank == 1:
        import forkpoint.repo.placement as placement

        def unreachable(sources, dst, *rest):
            raise OSError(f"simulated: {dst.url} unreachable")

        placement.copy_object = unreachable
    fsdp, fopt = build_fsdp()
    repo = fp.dist.Repo(tiers=[fp.tier(os.path.join(nodes, f"node{rank}"), keep=2, local=True), shared],
                        create=True, timeout=20)
    state = fp.dist.TrainState(fsdp, fopt)
    vid = repo.save({"fsdp": state}).id
    repo.drain()
    dist.barrier()
    errors = repo.stats()["flush_errors"]
    where = repo.where(vid)
    fresh, fresh_opt = build_fsdp(seed=7)
    restored = fp.dist.TrainState(fresh, fresh_opt)
    got = repo.restore({"fsdp": restored}, "main").id
    same = all(torch.equal(a, b) for a, b in zip(full_state(state).values(), full_state(restored).values()))
    repo.close()
    return {"refusals": refusals, "errors": errors, "where": where, "vid": vid, "restored": got, "same": same}


def _node_local_crash(rank, world, out, nodes, shared):
    """Two versions into node-local tiers (flush every 2nd), then rank 3 (on the second node) is
    SIGKILLed while its copies for the second version's coordinated flush run (slowed down here
    so that the kill lands during them); the survivors' flush fails and reports it."""
    fsdp, fopt = build_fsdp()
    ddp, dopt = build_ddp()
    repo = fp.dist.Repo(tiers=_node_tiers(nodes, shared, rank), create=True, timeout=5)
    if rank == 3:
        _slow_flush_copies(60)
    ids, references = [], []
    for step in range(2):
        train(fsdp, fopt, "fsdp", 1, rank)
        train(ddp, dopt, "ddp", 1, rank)
        state = _mixed_state(fsdp, fopt, ddp, dopt, rank, step)
        ids.append(repo.save(state, step=step).id)
        references.append(_mixed_reference(state))
    if rank == 0:
        torch.save(references, os.path.join(out, "references.pt"))
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    repo.drain()
    errors = repo.stats()["flush_errors"]
    repo.close()
    return {"ids": ids, "errors": errors}


def _slow_flush_copies(seconds: float) -> None:
    """Make this process's flush copies wait `seconds` first (so that a kill lands before they end)."""
    import forkpoint.repo.placement as placement

    real = placement.copy_object

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    placement.copy_object = slow


def _tiered_killed(rank, world, out, fast, slow):
    """Three versions into [a fast tier every rank reaches, a slow one], rank 0's flush copies
    slowed down; then every rank is SIGKILLed with the flushes undone."""
    if rank == 0:
        _slow_flush_copies(60)
    repo = fp.dist.Repo(tiers=[fp.tier(fast, keep=3), slow], create=True, timeout=60)
    ids, references = _three_versions(repo, rank)
    if rank == 0:
        torch.save(references, os.path.join(out, "references.pt"))
        with open(os.path.join(out, "ids.json"), "w") as f:
            json.dump(ids, f)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_flushes(rank, world, out, fast, slow, references_path, node_size):
    """Resume a killed job through a Checkpointer (which finishes the flushes it left undone)
    into fresh models, wait for the flushes; report what was restored and the flush errors.
    `node_size` 0: tier 0 reaches every rank; else node-local tiers of that many ranks."""
    fsdp, fopt = build_fsdp(seed=7)
    if node_size:
        ddp, dopt = build_ddp(seed=8)
        tiers, state = _node_tiers(fast, slow, rank, node_size), _mixed_state(fsdp, fopt, ddp, dopt, -1, -1)
        full_of = _mixed_reference
    else:
        tiers, state = [fp.tier(fast, keep=3), slow], {"fsdp": fp.dist.TrainState(fsdp, fopt)}
        full_of = lambda s: full_state(s["fsdp"])  # noqa: E731
    repo = fp.dist.Repo(tiers=tiers, timeout=60)
    ck = fp.Checkpointer(repo, state, every=1000)
    start = ck.resume()
    got = full_of(state)
    matches = [i for i, ref in enumerate(torch.load(references_path)) if all(torch.equal(ref[k], got[k]) for k in ref)]
    ck.close()
    repo.drain()
    dist.barrier()
    result = {"next": start, "version": ck.last_version.id, "matches": matches,
              "errors": repo.stats()["flush_errors"]}
    repo.close()
    return result


def _plain_killed(rank, world, out, fast, slow):
    """A Checkpointer over a plain fp.Repo in a DDP run (rank 0 writes), rank 0's flush copies
    slowed down; every rank is SIGKILLed after two saves, with their flushes undone."""
    if rank == 0:
        _slow_flush_copies(60)
    ddp, dopt = build_ddp()
    repo = fp.Repo(tiers=[fast, slow], create=True)
    ck = fp.Checkpointer(repo, {"model": ddp, "optim": dopt}, every=1, sync=True)
    for step in range(2):
        train(ddp, dopt, "ddp", 1, rank)
        ck.step(step)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _plain_resume(rank, world, out, fast, slow):
    """Resume that run through its Checkpointer; report this rank's finished flush tasks."""
    ddp, dopt = build_ddp(seed=5)
    repo = fp.Repo(tiers=[fast, slow])
    ck = fp.Checkpointer(repo, {"model": ddp, "optim": dopt}, every=1000)
    start = ck.resume()
    ck.close()
    repo.drain()
    dist.barrier()
    flushes = repo.stats()["stages"].get("flush", {}).get("done", 0)
    repo.close()
    return {"next": start, "flushes": flushes}


def _finish_only(rank, world, out, nodes, shared, failing=-1):
    """Open node-local tiers and call finish_flushes alone; report this rank's flush tasks, or
    the error it raised (rank `failing` cannot read its tier 0)."""
    repo = fp.dist.Repo(tiers=_node_tiers(nodes, shared, rank), create=True, timeout=60)
    if rank == failing:
        def unreadable(key):
            raise OSError(f"simulated: {key} unreadable")

        repo.store.exists = unreadable
    try:
        tasks = repo.finish_flushes()
    except fp.errors.ForkpointError as e:
        repo.close()
        return {"error": str(e)}
    repo.drain()
    result = {"tasks": len(tasks), "errors": repo.stats()["flush_errors"]}
    repo.close()
    return result


def _cuda_replicated_saves(rank, world, out, url, device="cuda"):
    """Replicated CUDA tensors (identical on every rank) saved asynchronously and synchronously:
    each rank copies to the host only the pieces it writes."""
    from forkpoint.engine.save import SaveOptions

    torch.manual_seed(0)
    state = {"w": torch.randn(512, 1024, device=device), "b": torch.randn(300, device=device)}
    repo = fp.dist.Repo(url, create=True, timeout=60, options=SaveOptions(chunk_bytes=256 << 10))
    first = repo.save(state, step=1, sync=False)
    first.wait_capture()
    state["w"].mul_(2)
    first = first.wait()
    second = repo.save(state, step=2)
    written = repo.stats()["stages"]["write"]["bytes_done"]
    repo.close()
    if rank == 0:
        torch.save({k: v.cpu() for k, v in state.items()}, os.path.join(out, "reference.pt"))
    return {"versions": [first.id, second.id], "written": written}


def _refused_save(rank, world, out, url, refuser):
    """Rank `refuser` passes a bad step: every rank fails at once, and the next save works."""
    repo = fp.dist.Repo(url, create=True, timeout=60)
    start = time.monotonic()
    try:
        repo.save({"w": torch.ones(10)}, step="x" if rank == refuser else 1)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    version = repo.save({"w": torch.full((10,), 2.0)}, step=2)
    repo.close()
    return {"raised": raised, "seconds": seconds, "next": version.id}


def _disagreeing_save(rank, world, out, url):
    """Ranks pass different steps, then different structures: each save fails on every rank
    with an error that says how they differ. Then a step given on one rank only (None on the
    other, as DeepSpeed's integration does) is the version's."""
    repo = fp.dist.Repo(url, create=True, timeout=60)
    raised = []
    for kwargs, state in (({"step": rank}, {"w": torch.ones(10)}),
                          ({"step": 1}, {"w": torch.ones(10), **({"extra": torch.ones(2)} if rank else {})})):
        try:
            repo.save(state, **kwargs)
            raised.append(None)
        except fp.dist.DistSaveError as e:
            raised.append(str(e))
    known = [repo.save({"w": torch.full((10,), float(i))}, step=(7 + i) if rank == i else None).step for i in (0, 1)]
    repo.close()
    return raised + [known]


def _policies_differ(rank, world, out, url, plain):
    """A Checkpointer per rank whose policy is due every 2 steps on rank 0 and every 3 on the
    others, over fp.dist.Repo (or, with `plain`, a plain Repo saving synchronously, whose
    saves end in a barrier): the ranks agree on each save, so none waits for the others."""
    ddp, dopt = build_ddp()
    repo = fp.Repo(url, create=True) if plain == "1" else fp.dist.Repo(url, create=True, timeout=30)
    ck = fp.Checkpointer(repo, {"model": ddp, "optim": dopt}, every=2 if rank == 0 else 3, sync=plain == "1")
    for step in range(8):
        train(ddp, dopt, "ddp", 1, rank)
        ck.step(step)
    ck.close()
    return [v.step for v in fp.Repo(url).log()]


def _replica_tiers(nodes, shared, rank, budget=None, node_size=1):
    """Tier 0 local to each simulated node (ranks r // node_size share it), replicated once to
    the next node; the shared tier below."""
    node = os.path.join(nodes, f"node{rank // node_size}")
    return [fp.tier(node, keep=2, local=True, replicas=1, budget=budget), shared]


def _hold_object_writes(store) -> None:
    """Every later write of an object to `store` waits for good (the process is killed meanwhile)."""
    never = threading.Event()
    for name in ("write", "adopt"):
        real = getattr(store, name)

        def held(key, *args, _real=real, **kwargs):
            if key.startswith("objects/"):
                never.wait()
            return _real(key, *args, **kwargs)
        setattr(store, name, held)


def _wait_flushed(repo, vid: str, seconds: float = 60.0) -> None:
    """Wait until every object of `vid` on this node's tier 0 is on the shared tier too."""
    mine = [o for o in repo.history.manifest_by_id(vid).objects() if repo.stores[0].exists(object_key(o))]
    deadline = time.monotonic() + seconds
    while not all(repo.stores[1].exists(object_key(o)) for o in mine):
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {vid}'s objects of this node did not reach the shared tier")
        time.sleep(0.05)


def _replicated_saves(rank, world, out, nodes, shared, saves=3, budget=None, victim=-1, node_size=1,
                      flushed=False):
    """`saves` versions of FSDP + DDP + rank-local state into replicated node-local tiers; rank
    `victim` is SIGKILLed while it exchanges the last version's replicas (its node then lost):
    before its part of that version reaches the shared tier, or with `flushed` just after."""
    fsdp, fopt = build_fsdp()
    ddp, dopt = build_ddp()
    repo = fp.dist.Repo(tiers=_replica_tiers(nodes, shared, rank, budget, node_size), create=True, timeout=30)
    if rank == victim:
        real_replicate, real_exchange, calls = repo.replicator.replicate, repo.replicator.peers.exchange, []

        def replicate(vid):
            calls.append(vid)
            return real_replicate(vid)

        def exchange(sends, receives):
            if len(calls) == saves:  # the last version's first exchange
                if flushed:
                    _wait_flushed(repo, calls[-1])
                os.kill(os.getpid(), signal.SIGKILL)
            return real_exchange(sends, receives)
        repo.replicator.replicate, repo.replicator.peers.exchange = replicate, exchange
    ids, references, marked = [], [], []
    for step in range(saves):
        if rank == victim and step == saves - 1 and not flushed:
            _hold_object_writes(repo.stores[1])  # its part of the last version never reaches the shared tier
        train(fsdp, fopt, "fsdp", 1, rank)
        train(ddp, dopt, "ddp", 1, rank)
        state = _mixed_state(fsdp, fopt, ddp, dopt, rank, step)
        references.append(_mixed_reference(state))  # collective: before the victim can die
        ids.append(repo.save(state, step=step).id)
        if rank == 0:
            torch.save(references, os.path.join(out, "references.pt"))
        if victim < 0:
            marked.append(repo.replicated(ids[-1]))
        else:  # the victim dies in here, replicating the last version; no collective after that
            repo.replicator.wait()
            marked.append(repo.replicator.replicated(ids[-1]))
    result = {"ids": ids, "replicated": marked}
    if victim < 0:
        repo.drain()
        dist.barrier()
        repo.close()
    return result


def _counting_reads(store) -> list:
    """Count the reads of objects from `store` (read, read_into, map of keys under objects/):
    [count] grows as they happen (manifests and refs are not counted)."""
    count = [0]
    for name in ("read", "read_into", "map"):
        real = getattr(store, name)

        def counted(key, *args, _real=real, **kwargs):
            count[0] += key.startswith("objects/")
            return _real(key, *args, **kwargs)
        setattr(store, name, counted)
    return count


def _replicated_restore(rank, world, out, nodes, shared, references_path, resume=False, node_size=1):
    """Restore "main" through replicated node-local tiers into fresh models (with `resume`, by
    Checkpointer.resume); count the shared tier's reads."""
    import dataclasses

    fsdp, fopt = build_fsdp(seed=99)
    ddp, dopt = build_ddp(seed=98)
    repo = fp.dist.Repo(tiers=_replica_tiers(nodes, shared, rank, None, node_size), create=True, timeout=30)
    reads = _counting_reads(repo.stores[1])
    state = _mixed_state(fsdp, fopt, ddp, dopt, -1, -1)
    if resume:
        ck = fp.Checkpointer(repo, state, every=1)
        ck.resume()
        version = ck.last_version
    else:
        version = repo.restore(state, "main")
    shared_reads = reads[0]
    got = _mixed_reference(state)
    matches = [i for i, ref in enumerate(torch.load(references_path))
               if all(torch.equal(ref[k], got[k]) for k in ref)]
    recovery = repo.replicator.last_recovery
    result = {"version": version.id, "matches": matches, "shared_reads": shared_reads,
              "note": state["note"].obj["rank"].tolist(), "replicated": repo.replicated(version.id),
              "recovery": dataclasses.asdict(recovery) if recovery else None}
    repo.close()
    return result
