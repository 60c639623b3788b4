"""fp.audit on real loops: a correct one is exact, each missing piece is named, a loop that
is nondeterministic by itself is reported as such."""

import functools

import pytest

import forkpoint as fp
from helpers import audit_loops


def run_audit(variant: str) -> fp.AuditReport:
    return fp.audit(functools.partial(audit_loops.build, variant), functools.partial(audit_loops.step, variant),
                    steps=3, then=3, state=functools.partial(audit_loops.state, variant))


def test_a_correct_loop_is_exact():
    report = run_audit("correct")
    assert report.exact and not report.missing and str(report).startswith("exact"), report


@pytest.mark.parametrize("variant, named", [
    ("torch_rng", "torch RNG"), ("numpy_rng", "numpy RNG"), ("python_rng", "Python RNG"),
    ("sched", "objects['sched']: LR scheduler"), ("sampler", "objects['sampler']: sampler or data-loader position"),
    ("scaler", "objects['scaler']: GradScaler"), ("buffers", "objects['model'] (buffers): module buffers"),
    ("param_groups", "objects['opt'] (param groups): optimizer param groups"),
    ("counter", "steps_done: a Python counter in the loop")])
def test_each_missing_piece_is_named(variant, named):
    report = run_audit(variant)
    assert not report.exact and not report.nondeterministic, report
    assert report.diverged_at is not None and report.diverged_at >= 3, report
    assert any(m.startswith(named) for m in report.missing), (named, report.missing, str(report))
    assert len(report.missing) <= 2, report.missing
    assert named.split(":")[0] in str(report)
    assert FIX[variant] in str(report), str(report)


FIX = {"torch_rng": "fp.RNGState()", "numpy_rng": "fp.RNGState()", "python_rng": "fp.RNGState()",
       "sched": "add the scheduler", "sampler": "fp.ResumableLoader", "scaler": "add the GradScaler",
       "buffers": "save the module itself", "param_groups": "save the optimizer itself",
       "counter": "keep the counter in the state"}


def test_a_nondeterministic_loop_is_not_blamed_on_the_checkpoint():
    report = run_audit("nondeterministic")
    assert report.nondeterministic and not report.exact and "even without a checkpoint" in str(report)


def test_functions_a_fresh_process_cannot_import_are_refused():
    with pytest.raises(TypeError, match="define it at module level"):
        fp.audit(lambda: {}, audit_loops.step)


def _audit_cli(*script_args):
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    return subprocess.run([sys.executable, "-m", "forkpoint.cli.main", "audit", "--steps", "4", "--then", "3", "--",
                           sys.executable, *script_args], capture_output=True, text=True, timeout=600, cwd=here)


def test_the_example_training_script_resumes_exactly(tmp_path):
    import os

    example = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "train.py")
    run = _audit_cli(example, "--repo", str(tmp_path / "runs"), "--steps", "50")
    assert run.returncode == 0 and run.stdout.startswith("exact"), run.stdout + run.stderr
    assert not (tmp_path / "runs" / "versions").exists() or not os.listdir(tmp_path / "runs" / "versions"), \
        "the audit writes nothing to the script's own repository"
    assert not (tmp_path / "runs" / "holders").exists(), "nor holds its branch (the phases run side by side)"


@pytest.mark.parametrize("forget, named", [("nothing", None), ("sched", "local sched: LR scheduler"),
                                           ("rng", "torch RNG")])
def test_a_script_audit_names_what_the_checkpoint_forgot(tmp_path, forget, named):
    run = _audit_cli("helpers/audit_script.py", "--repo", str(tmp_path / "r"), "--forget", forget)
    if named is None:
        assert run.returncode == 0 and run.stdout.startswith("exact"), run.stdout + run.stderr
    else:
        assert run.returncode == 1 and named in run.stdout and "not exact" in run.stdout, run.stdout + run.stderr


def test_bad_audit_arguments_and_a_script_too_short_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        fp.audit(audit_loops.build, audit_loops.step, steps=0)
    short = _audit_cli("helpers/audit_script.py", "--repo", str(tmp_path / "r"), "--steps", "5")
    assert short.returncode != 0 and "run at least 7 steps" in short.stderr, short.stderr
