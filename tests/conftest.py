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
