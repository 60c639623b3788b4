"""`forkpoint demo`: a training run that is killed, resumes exactly, and forks.

The parent drives child processes (`python -m forkpoint.cli.demo train ...`) so that the
kill is a real SIGKILL of a process in the middle of training.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from ..repo import Repo


def train(repo_url: str, branch: str, steps: int, lr: float | None, log_path: str,
          start: str | None, every: int | None, sleep: float) -> None:
    """Train a small MLP on synthetic data, checkpointing with a Checkpointer."""
    import torch

    import forkpoint as fp

    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh() + 0.05 * torch.randn(1024, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    sampler = fp.ResumableSampler(len(x), seed=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32,
                                         sampler=sampler, generator=torch.Generator())
    repo = fp.Repo(repo_url, create=True)
    if start and repo.head(branch) is None:
        repo.fork(start, branch)
    state = {"model": model, "optim": opt, "sched": sched, "rng": fp.RNGState(), "data": sampler}
    ck = fp.Checkpointer(repo, state, every=every, branch=branch)
    step = ck.resume() if every else 0
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    batches = iter(loader)
    with open(log_path, "a") as log:
        while step < steps:
            try:
                xb, yb = next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            log.write(json.dumps({"step": step, "loss": loss.item(), "pid": os.getpid()}) + "\n")
            log.flush()
            if every:
                ck.step(step, metrics={"loss": loss.item()})
            step += 1
            time.sleep(sleep)
    ck.close()
    repo.close()


def _phase(console, text: str):
    """A spinner while a phase's training process runs (on a terminal only)."""
    return console.status(text) if console.is_terminal else contextlib.nullcontext()


def _child(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "forkpoint.cli.demo", "train", *args])


def _losses(path: str) -> dict[int, float]:
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def _cli(console, *args: str) -> None:
    console.print(f"\n[bold]$ forkpoint {' '.join(args)}[/bold]")
    sys.stdout.flush()
    subprocess.run([sys.executable, "-m", "forkpoint.cli.main", *args], check=True)


def run_demo(directory: str, steps: int, console) -> None:
    """Run the whole demo in `directory` (wiped first)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    repo_url = os.path.join(directory, "repo")
    logs = {name: os.path.join(directory, f"{name}.jsonl") for name in ("reference", "main", "fork")}
    common = ["--steps", str(steps), "--sleep", "0.05"]

    console.print("[bold]1. reference run[/bold] (no interruption, no checkpoints)")
    with _phase(console, "training the reference run"):
        _child(["--repo", repo_url, "--branch", "main", "--log", logs["reference"], "--every", "0",
                *common]).wait()

    console.print("[bold]2. training run with a checkpoint every 5 steps[/bold]")
    with _phase(console, "training until the run is killed"):
        _kill_halfway(_child(["--repo", repo_url, "--branch", "main", "--log", logs["main"], "--every", "5",
                              *common]), repo_url, steps)
    last = max(_losses(logs["main"]))
    committed = Repo(repo_url).version("main")
    lost = (f"steps {committed.step + 1}..{last} are lost and will be recomputed" if last > committed.step
            else "no step is lost")
    console.print(f"   [red]SIGKILL[/red] after step {last}; newest committed version is step "
                  f"{committed.step}, so {lost}")

    console.print("[bold]3. resume[/bold]: a new process restores model, optimizer, scheduler, RNG and data position")
    with _phase(console, "resuming and training to the end"):
        _child(["--repo", repo_url, "--branch", "main", "--log", logs["main"], "--every", "5", *common]).wait()
    ref, resumed = _losses(logs["reference"]), _losses(logs["main"])
    mismatched = [s for s in ref if ref[s] != resumed.get(s)]
    for s in range(committed.step - 1, min(committed.step + 5, steps)):
        mark = "resumed here" if s == committed.step + 1 else ""
        console.print(f"   step {s:3}  reference {ref[s]:.9f}  interrupted+resumed {resumed[s]:.9f}  {mark}")
    if mismatched:
        console.print(f"   [red]loss curves differ at steps {mismatched[:10]}[/red]")
        sys.exit(1)
    console.print(f"   [green]all {len(ref)} losses are bit-identical to the uninterrupted run[/green]")

    start = next(v for v in Repo(repo_url).log("main") if v.step is not None and v.step <= steps // 3)
    console.print(f"[bold]4. fork[/bold] 'lr-sweep' from step {start.step} ({start.id[:12]}) with lr=3e-3")
    with _phase(console, "training the fork"):
        _child(["--repo", repo_url, "--branch", "lr-sweep", "--log", logs["fork"], "--every", "5",
                "--start", start.id, "--lr", "3e-3", *common]).wait()

    _show_lineage(console, repo_url)


def _kill_halfway(proc, repo_url: str, steps: int) -> None:
    """SIGKILL the training run `proc` shortly after it committed a version past half its steps."""
    repo = None
    while proc.poll() is None:
        if repo is None and os.path.exists(os.path.join(repo_url, "forkpoint.json")):
            repo = Repo(repo_url)
        head = repo.head("main") if repo else None
        if head and repo.version(head).step >= steps // 2:
            time.sleep(0.13)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.02)


def _show_lineage(console, repo_url: str) -> None:
    """The log, the diff of the two runs, where they diverge, and the disk use."""
    _cli(console, "log", "-r", repo_url)
    _cli(console, "diff", "-r", repo_url, "main", "lr-sweep")
    div = Repo(repo_url).first_divergence("main", "lr-sweep", atol=1e-6)
    if div:
        console.print(f"\nruns diverge first at step {div.step} ({len(div.paths)} leaves, max |diff| {div.max_abs:.3g})")
    _cli(console, "du", "-r", repo_url)
    console.print(f"\nsee it in a browser: [bold]forkpoint ui -r {repo_url}[/bold]; "
                  f"plot it: [bold]forkpoint plot loss -r {repo_url} --out loss.png[/bold]")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m forkpoint.cli.demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--repo", required=True)
    t.add_argument("--branch", default="main")
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--log", required=True)
    t.add_argument("--start", default=None)
    t.add_argument("--every", type=int, default=5)
    t.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args(argv)
    train(a.repo, a.branch, a.steps, a.lr, a.log, a.start, a.every or None, a.sleep)


if __name__ == "__main__":
    main()
