import os
import sys

import pytest

import forkpoint as fp

HERE = os.path.dirname(__file__)


@pytest.fixture
def repo(tmp_path):
    r = fp.Repo(str(tmp_path / "repo"), create=True)
    yield r
    r.close()


@pytest.fixture
def helper_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    return env


def python():
    return sys.executable


@pytest.fixture
def kernels_setting():
    """run(value, code) -> stdout of `code` run by a fresh Python whose FORKPOINT_PORTABLE_KERNELS
    is `value` (None: unset), which chooses the native kernels at import."""
    import subprocess

    def run(value, code: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "FORKPOINT_PORTABLE_KERNELS"}
        if value is not None:
            env["FORKPOINT_PORTABLE_KERNELS"] = value
        return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                              text=True).stdout
    return run


def race_before_publish(repo, other_save):
    """Make `repo`'s next ref publish run `other_save()` first: a writer that wins the race."""
    real = repo._publish_ref
    fired = []

    def racing(*args, **kwargs):
        if not fired:
            fired.append(1)
            other_save()
        return real(*args, **kwargs)

    repo._publish_ref = racing
