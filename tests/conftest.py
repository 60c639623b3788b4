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
