"""Process-group set-up from the launcher's environment: torchrun or SLURM srun."""

import os
import re
import subprocess
from dataclasses import dataclass


@dataclass
class Launch:
    """Where this process sits: global rank, world size, rank on its node, and the launcher."""

    rank: int
    world: int
    local_rank: int
    launcher: str


def detect(env=None) -> Launch:
    """Read rank and world size from torchrun's (RANK, WORLD_SIZE, LOCAL_RANK) or SLURM's
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) variables; a single process otherwise."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return Launch(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm")
    return Launch(0, 1, 0, "none")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as "gpu[003-005,9],cpu1" (without scontrol)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def master_address(env) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT, or under SLURM the job's first node and a port from the job id."""
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"], int(env.get("MASTER_PORT", 29500))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1", int(env.get("MASTER_PORT", 29500))
    try:
        host = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=10, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        host = first_host(nodelist)
    port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
    return host, port


def init_from_env(backend: str | None = None, timeout: float = 1800.0) -> Launch:
    """Initialise torch.distributed from torchrun's or srun's environment (no-op when it is
    already initialised or there is one process); return this process's Launch."""
    import datetime

    import torch
    import torch.distributed as dist

    launch = detect()
    if dist.is_initialized() or launch.world == 1 and launch.launcher == "none":
        return launch
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if launch.launcher == "slurm":
        host, port = master_address(os.environ)
        init = f"tcp://{host}:{port}"
    else:
        init = "env://"
    dist.init_process_group(backend, init_method=init, rank=launch.rank, world_size=launch.world,
                            timeout=datetime.timedelta(seconds=timeout))
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    return launch
