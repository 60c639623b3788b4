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


def payload_plane_coders(payload) -> list[list[int]]:
    """The coder of each plane of each segment of a float-planes payload."""
    from forkpoint.format import floatcodec

    version, itemsize, _, count, per = floatcodec._HEAD.unpack_from(payload)
    at = floatcodec._HEAD.size + (floatcodec._ROW.size if version >= floatcodec.GRID_VERSION else 0)
    return [list(payload[at + j * (itemsize + 1) + 1:at + (j + 1) * (itemsize + 1)])
            for j in range(-(-count // per))]


def object_plane_coders(repo, version, path: str) -> list[list[int]]:
    """payload_plane_coders of the float-planes object holding leaf `path` (one chunk) of `version`."""
    from forkpoint.format.objects import OBJECT_HEADER_SIZE, object_key, unpack_header

    (leaf,) = [leaf for leaf in repo.manifest(version.id).leaves if leaf.path == path]
    (chunk,) = leaf.chunks
    blob = repo.store.read(object_key(chunk.object))
    return payload_plane_coders(blob[unpack_header(blob[:OBJECT_HEADER_SIZE], chunk.object)[2]:])
