"""Crash safety: SIGKILL a saving process at 30+ random moments, then check every version."""

import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import forkpoint as fp
import procs

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "helpers"))
from crash_saver import state_for  # noqa: E402


def _check_all(url):
    repo = fp.Repo(url)
    steps = []
    for v in repo.log("main"):
        out = repo.load(v.id)
        expected = state_for(v.step)
        assert out["step"] == v.step
        for k in ("w", "b", "frozen"):
            assert np.array_equal(out[k], expected[k]), (v.id, k)
        assert all(np.array_equal(out["small"][k], expected["small"][k]) for k in expected["small"])
        steps.append(v.step)
    assert steps == list(range(steps[0], -1, -1)) if steps else True, steps
    repo.close()
    return steps


def _wait_until_ready(proc, timeout=procs.CHILD_SECONDS):
    """Block until the saver prints "ready" (imports done, repository open), so the random kill
    lands in its saves however slow the machine is to start Python and torch."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        raise AssertionError(f"the crash saver did not start within {timeout:.0f} s: {line!r}")


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_sigkill_at_random_moments_loses_nothing_committed(tmp_path, codec):
    """"lossless" (with encode_later): the store's learnt rates say raw saves are faster, so
    each save writes raw and its objects are rewritten encoded after the commit, while the
    kills land."""
    url = str(tmp_path / "repo")
    rnd = random.Random(1234)
    kills, seen, commits = 0, 0, 0
    if codec == "lossless":
        fp.Repo(url, create=True).close()
        os.makedirs(os.path.join(url, "stats"))
        with open(os.path.join(url, "stats", "auto-codec.json"), "w") as f:
            json.dump({"format": "forkpoint.auto-codec", "format_version": [1, 1], "interval": 64,
                       "rates": {"raw": 1e15, "encoded": 1.0}}, f)
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "helpers") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    least_kills = 32 if codec == "raw" else 16
    while kills < least_kills or (commits < 10 and kills < 8 * least_kills):
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "crash_saver.py"), url, "main",
                                 codec], stdout=subprocess.PIPE, env=env)
        _wait_until_ready(proc)
        time.sleep(rnd.uniform(0.25, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        printed = proc.stdout.read().split()
        kills += 1
        commits += len(printed)
        if not os.path.exists(os.path.join(url, "forkpoint.json")):
            continue
        repo = fp.Repo(url)
        head = repo.head("main")
        if head is not None:
            newest = repo.version(head).step
            assert newest >= seen, "a committed version disappeared"
            if printed:
                assert newest >= int(printed[-1]), "a save reported as committed is not the head"
            seen = newest
        repo.close()
    steps = _check_all(url)
    assert len(steps) >= 10, f"too few saves completed to be a meaningful test: {steps}"
    report = fp.Repo(url).verify()
    assert report.ok, report.problems
    gc = fp.Repo(url).gc(grace=0)
    assert fp.Repo(url).verify().ok
    assert _check_all(url) == steps
    assert gc.deleted_temp + gc.deleted_objects >= 0
    if codec == "lossless":
        assert "float-planes" in fp.Repo(url).du()["codecs"], "no object was encoded after its commit"
