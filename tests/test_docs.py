"""The documentation site builds with `mkdocs build --strict` (no broken link, no missing API
reference), and every code block of the guides runs in a fresh directory: plain Python blocks
as one script, programs with the command their first line gives (torchrun, mpiexec), shell
blocks line by line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import procs

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.md"))
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
       "NO_MKDOCS_2_WARNING": "1"}
pytestmark = pytest.mark.timeout(600)


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)


def run(cmd, cwd, **kwargs) -> subprocess.CompletedProcess:
    proc = procs.run(cmd, timeout=500, cwd=cwd, env=ENV, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed in {cwd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_the_site_builds_strictly(tmp_path):
    out = run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], ROOT)
    assert "WARNING" not in out.stderr, out.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("forkpoint.Repo.save", "forkpoint.Checkpointer", "forkpoint.Block", "load_block"):
        assert name in api, f"{name} missing from the API reference"
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-shard-size" in cli and "forkpoint diff" in cli, "the CLI reference is generated from click"


RUN_BLOCK = re.compile(r"\A# (\S+\.py); run with: (.+)\n")
"""A block headed `# NAME; run with: COMMAND` is a program of its own: saved as NAME, run
with COMMAND (torchrun, mpiexec, or python twice)."""
PAGES = GUIDES + [DOCS / "MPI.md", DOCS / "AUTOMATION.md"]


RANKED = ("distributed", "MPI")
"""Pages whose programs run several ranks."""


@pytest.mark.parametrize("page", [pytest.param(p, id=p.stem, marks=[pytest.mark.ranks] if p.stem in RANKED else [])
                                  for p in PAGES])
def test_every_code_block_of_a_guide_runs(page, tmp_path):
    """The page's plain Python blocks, in order, as one script; then its programs (run
    blocks) and its shell blocks, in the order they appear."""
    python = blocks(page, "python")
    assert python, f"{page.name} has no Python block"
    plain = [b for b in python if not RUN_BLOCK.match(b)]
    if plain:
        (tmp_path / "page.py").write_text("\n".join(plain))
        run([sys.executable, "page.py"], tmp_path)
    text = page.read_text()
    later = sorted([(text.index(b), "python", b) for b in python if RUN_BLOCK.match(b)] +
                   [(text.index(b), "bash", b) for b in blocks(page, "bash")])
    for _, kind, block in later:
        if kind == "python":
            name, command = RUN_BLOCK.match(block).groups()
            (tmp_path / name).write_text(block)
            run(["bash", "-c", command], tmp_path)
            continue
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                run(["bash", "-c", command], tmp_path)
