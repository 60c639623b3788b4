"""The package as a user installs it: an sdist and a wheel built from the tree, each installed
into a fresh virtual environment without the test extras, the README's quickstart run from
the wheel (twice: the second run resumes a finished run and trains nothing), a numpy-only
save and load from the sdist, the C kernels built at install."""

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.timeout(900)

KERNELS = ("from forkpoint.codecs import kernels; from forkpoint.storage import streamcopy; "
           "assert kernels.planes is not None and streamcopy._stream is not None, 'C kernels missing'")
NUMPY_ONLY = """
import sys, numpy as np, forkpoint as fp
repo = fp.Repo(sys.argv[1], create=True, codec="lossless")
a = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
v = repo.save({"a": a, "step": 3}, step=3)
assert np.array_equal(repo.load(v.id)["a"], a) and repo.verify().ok
assert "torch" not in sys.modules
print("numpy-only ok", v.id)
"""


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, ROOT])
    wheels, sdists = list(out.glob("forkpoint-*.whl")), list(out.glob("forkpoint-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def fresh_venv(path: Path) -> Path:
    """A new virtual environment (its own site-packages only); its python."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def quickstart() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"## Quickstart.*?```python\n(.*?)```", readme, re.S).group(1)


def test_the_wheel_with_the_torch_extra_runs_the_readme_quickstart(built, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "-q", f"{built['wheel']}[torch]"])
    extras = run([python, "-c", "import importlib.util as u; print([m for m in ('pytest', 'lightning', "
                  "'transformers', 'moto', 'deepspeed', 'mpi4py') if u.find_spec(m)])"])
    assert extras.stdout.strip() == "[]", "the test stack is not installed with the package"
    run([python, "-c", KERNELS])
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    first = run([python, script], cwd=tmp_path)
    assert "step=499" in first.stdout and "'final': True" in first.stdout, first.stdout
    again = run([python, script], cwd=tmp_path)
    assert "finished at step 499" in again.stderr, again.stderr
    log = run([tmp_path / "venv" / "bin" / "forkpoint", "log", "-r", tmp_path / "runs" / "quickstart"])
    assert re.search(r"\(main\)\s+step 499", log.stdout) and "step 400" in log.stdout, log.stdout


def test_the_sdist_installs_without_torch_and_saves_numpy_state(built, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "-q", built["sdist"]])
    run([python, "-c", KERNELS])
    script = tmp_path / "numpy_only.py"
    script.write_text(NUMPY_ONLY)
    out = run([python, script, tmp_path / "repo"])
    assert "numpy-only ok" in out.stdout
    missing = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert missing.returncode != 0, "torch is only in the torch extra"
