"""What the benchmarks share: the options they all take, the training state most of them save,
rounds in an order that rotates, optional peers, and the table of medians.

Run a benchmark as `python -m benchmarks <name> [options]` (see benchmarks/__main__.py) or as
`python benchmarks/<name>.py [options]`. The options shared by all of them are documented once,
in COMMON_OPTIONS (and in docs/BENCHMARKS.md, "Running the benchmarks").
"""

import argparse
import importlib
import json
import os
import sys
import tempfile

import forkpoint as fp

COMMON_OPTIONS = """\
--repeats N   rounds of every method; tables show the median of the rounds
--dir PATH    where scratch repositories and files go (default: a new temporary directory;
              give a path on the disk you want measured)
--json PATH   where the figures are also written, as JSON (benchmarks that keep them)
--only A,B    the methods to run, by the names the table shows (benchmarks with peers)"""

WIDTH = 3200
"""Features of the MLP layers of the standard training state (mlp_adamw)."""


def arguments(description: str, *, repeats: int | None = 5, directory: bool = True, dir_default: str | None = None,
              dir_help: str | None = None, json_path: str | None = None,
              methods: list[str] | None = None) -> argparse.ArgumentParser:
    """A parser for a benchmark, holding the options it shares with the others (COMMON_OPTIONS,
    shown by --help): --repeats (default `repeats`; none where None), --dir where `directory`
    (default `dir_default`), --json where `json_path` is given, --only where it runs `methods`."""
    ap = argparse.ArgumentParser(description=description, epilog="options the benchmarks share:\n" + COMMON_OPTIONS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help="rounds; tables show medians")
    if directory:
        ap.add_argument("--dir", default=dir_default, help=dir_help or "scratch directory (default: a new temporary one)")
    if json_path:
        ap.add_argument("--json", default=json_path, help="where the figures are written as JSON")
    if methods:
        ap.add_argument("--only", default=None, help=f"comma-separated methods to run, of: {', '.join(methods)}")
    return ap


def only(ap: argparse.ArgumentParser, methods: list, selection: str | None, always: tuple[str, ...] = ()) -> list:
    """The `methods` (objects with a `name`) named in the comma-separated `selection` (all of
    them where None), with those named in `always`; a parser error naming the choices for an
    unknown name."""
    if not selection:
        return methods
    wanted = set(selection.split(",")) | set(always)
    unknown = wanted - {m.name for m in methods}
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {[m.name for m in methods]}")
    return [m for m in methods if m.name in wanted]


def scratch(parent: str | None, prefix: str = "fp-bench-") -> str:
    """A new scratch directory under `parent` (--dir; the system's temporary directory where None)."""
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def optional(module: str) -> bool:
    """Whether the optional peer `module` imports; where not, say so on stderr."""
    try:
        importlib.import_module(module)
        return True
    except Exception as e:  # a peer is optional: report and skip it
        print(f"skipping {module}: {e}", file=sys.stderr)
        return False


def rounds(methods: list, repeats: int):
    """(round, `methods` in that round's order) for `repeats` rounds: the order rotates, so no
    method always runs first or always after the same one (caches, the disk's write-back)."""
    for rep in range(repeats):
        k = rep % len(methods)
        yield rep, methods[k:] + methods[:k]


def mlp_adamw(params_m: int, *, lr: float = 1e-4, stepped: bool = False, device: str = "cpu"):
    """(model, optimizer): a stack of Linear(WIDTH, WIDTH) layers of about `params_m` million
    parameters with AdamW, seeded; `stepped`, after one step on random gradients (so the
    optimizer holds its two moments: about 12 bytes a parameter in all)."""
    import torch

    torch.manual_seed(0)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if stepped:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def state_bytes(model) -> int:
    """Bytes of a float32 model's parameters with AdamW's two moments."""
    return sum(p.numel() * 4 * 3 for p in model.parameters())


def train_step(model, opt, batch) -> float:
    """One step of the standard training loop (the mean square of the output as the loss)."""
    loss = model(batch).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def fsync_tree(path: str) -> None:
    """Make every file and directory under `path` durable, as a peer that does not do so itself
    must be for a fair comparison."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def table(headers: list[str], rows: list[list]) -> None:
    """Print a Markdown table (cells as given: format numbers before)."""
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def write_json(path: str, data) -> None:
    """Write `data` as JSON at `path`, making its directory."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def repo(path: str, unpaced: bool = False, **options) -> fp.Repo:
    """A new repository at `path` with `options`; `unpaced` has every chunk of its saves
    encoded (its stores no longer pace encoding: the codec's own ratio and cost)."""
    opened = fp.Repo(path, create=True, **options)
    return unpaced_repo(opened) if unpaced else opened


def unpaced_repo(opened: fp.Repo) -> fp.Repo:
    """`opened`, its saves encoding every chunk (see `repo`)."""
    for store in opened.stores:
        store.paces_encoding = False
    return opened
