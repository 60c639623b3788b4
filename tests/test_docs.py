"""The documentation site builds with `mkdocs build --strict` (no broken link, no missing API
reference), and every code block of the guides runs: a guide's Python blocks, in order, as
one script in a fresh directory, then its shell blocks there; the MPI page's two programs
under mpiexec on 4 and then 3 ranks."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=500, **kwargs)
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


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_every_code_block_of_a_guide_runs(guide, tmp_path):
    python = blocks(guide, "python")
    assert python, f"{guide.name} has no Python block"
    script = tmp_path / "guide.py"
    script.write_text("\n".join(python))
    run([sys.executable, str(script)], tmp_path)
    for block in blocks(guide, "bash"):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                run(["bash", "-c", command], tmp_path)


def test_the_mpi_pages_programs_run_on_4_then_3_ranks(tmp_path):
    save, restart = blocks(DOCS / "MPI.md", "python")
    mpiexec = shutil.which("mpiexec", path=str(BIN)) or "mpiexec"
    (tmp_path / "save.py").write_text(save)
    (tmp_path / "restart.py").write_text(restart + "\nassert u.shape[0] in (341, 342)\n")
    run([mpiexec, "-n", "4", sys.executable, "save.py"], tmp_path)
    run([mpiexec, "-n", "3", sys.executable, "restart.py"], tmp_path)
