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
    real = repo.refs.publish
    fired = []

    def racing(*args, **kwargs):
        if not fired:
            fired.append(1)
            other_save()
        return real(*args, **kwargs)

    repo.refs.publish = racing


STACK_NOTE_LEAD = 15
"""Seconds before a test's timeout at which its threads' stacks are noted for the report."""


def _timeout_of(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


def _stacks_now() -> str:
    """The innermost frames of every thread of this process that is in a test or forkpoint."""
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        frames = [f for f in traceback.extract_stack(frame) if "forkpoint" in f.filename or "tests" in f.filename]
        if frames:
            inner = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
            found.append(f"{names.get(ident, ident)}: {inner}")
    return "; ".join(found) or "no thread in the tests or forkpoint"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Note where the threads are shortly before the test's timeout: CI shows a failure's
    summary line only, and pytest-timeout's own stack dump does not reach it."""
    import threading

    timeout = _timeout_of(item)
    timer = None
    if timeout > STACK_NOTE_LEAD:
        timer = threading.Timer(timeout - STACK_NOTE_LEAD, lambda: setattr(item, "stacks_near_timeout", _stacks_now()))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    stacks = getattr(item, "stacks_near_timeout", None)
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.failed and stacks and crash is not None and "Timeout" in crash.message:
        crash.message = f"{crash.message} Threads {STACK_NOTE_LEAD} s before: {stacks}"
