"""Resume audit: does restoring the checkpointed state reproduce the uninterrupted run, bit for bit?

Three fresh processes run the loop: the reference (k steps, checkpoint, j more steps), a
control without a checkpoint (k + j steps: a loop that differs from the reference is
nondeterministic by itself, and no checkpoint is blamed), and the resumed run (build anew,
restore the checkpoint, the same j steps). Losses and every loop object are compared after
each step; when the resumed run differs, what the loop depends on (each loop object, split
into parameters/buffers and state/param groups, the global random streams, the step
function's globals) is compared between the checkpoint moment and right after the restore,
and the pieces that differ are named.
"""

import concurrent.futures
import multiprocessing
import pickle
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from .fingerprint import loop_objects, object_kind, rng_fingerprints, value_digest

FIXES = {
    "torch RNG": "add fp.RNGState() to the state", "numpy RNG": "add fp.RNGState() to the state",
    "Python RNG": "add fp.RNGState() to the state", "CUDA RNG": "add fp.RNGState() to the state",
    "LR scheduler": "add the scheduler to the state",
    "GradScaler": "add the GradScaler to the state",
    "sampler or data-loader position": "iterate an fp.ResumableLoader (or an fp.ResumableSampler) and add it to "
                                       "the state: it records the position the loop reached",
    "module buffers": "save the module itself (its state_dict holds the buffers), not only its parameters",
    "module parameters": "save the module",
    "optimizer param groups": "save the optimizer itself (its state_dict holds the param groups)",
    "optimizer state": "save the optimizer",
    "a Python counter in the loop": "keep the counter in the state (a dict entry or an object with "
                                    "state_dict) or derive it from the step number",
}


@dataclass
class AuditReport:
    """The audit's verdict; str() is the sentence to show."""

    exact: bool
    nondeterministic: bool = False
    steps: int = 0
    then: int = 0
    diverged_at: int | None = None
    first_difference: str | None = None
    missing: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    message: str = ""

    def __str__(self) -> str:
        return self.message


def _bits(loss) -> str | None:
    if loss is None:
        return None
    value = loss.item() if hasattr(loss, "item") else float(loss)
    return struct.pack("<d", value).hex()


def _pieces(objects: dict) -> dict[str, tuple[str, str | None]]:
    """{piece name: (kind, digest)} of every loop object, modules and optimizers split."""
    torch = sys.modules.get("torch")
    out: dict[str, tuple[str, str | None]] = {}
    for name, obj in objects.items():
        if torch is not None and isinstance(obj, torch.nn.Module):
            out[f"{name} (parameters)"] = ("module parameters", value_digest(dict(obj.named_parameters())))
            out[f"{name} (buffers)"] = ("module buffers", value_digest(dict(obj.named_buffers())))
        elif torch is not None and isinstance(obj, torch.optim.Optimizer):
            sd = obj.state_dict()
            out[f"{name} (state)"] = ("optimizer state", value_digest(sd["state"]))
            out[f"{name} (param groups)"] = ("optimizer param groups", value_digest(sd["param_groups"]))
        else:
            out[name] = (object_kind(obj), value_digest(obj))
    for name, digest in rng_fingerprints().items():
        out[name] = (name, digest)
    return out


def _run(phase: str, build: Callable, step: Callable, state_of: Callable | None, k: int, j: int,
         url: str) -> dict:
    """One process of the audit (see the module's docstring); returns plain data."""
    from ..repo import Repo

    objects = build()
    if not isinstance(objects, dict):
        raise TypeError(f"build() must return a dict of the loop's objects, got {type(objects).__name__}")
    state = state_of(objects) if state_of is not None else objects
    reachable = loop_objects(step, {f"objects[{k!r}]": v for k, v in objects.items()})
    repo = Repo(url, create=True)
    result = {}
    if phase == "resumed":
        repo.restore(state, "main")
        result["before"] = _pieces(reachable)
    else:
        for i in range(k):
            step(objects, i)
        if phase == "reference":
            result["before"] = _pieces(reachable)
            repo.save(state, step=k - 1)
    losses, after = [], []
    for i in range(k, k + j):
        losses.append(_bits(step(objects, i)))
        after.append({name: digest for name, (_, digest) in _pieces(reachable).items()})
    repo.close()
    return {**result, "losses": losses, "after": after}


RANDOM_KINDS = {"Python RNG", "numpy RNG", "torch RNG", "CUDA RNG", "RNGState"}


def _noisy(a: dict, b: dict) -> set[str]:
    """Random streams that differ between two uninterrupted runs (left unseeded): not a sign
    of nondeterminism while the losses agree, and no use for diagnosing a resume."""
    kinds = {name: kind for name, (kind, _) in a["before"].items()} if "before" in a else {}
    return {name for sa, sb in zip(a["after"], b["after"]) for name in sa
            if sa[name] != sb.get(name) and (kinds.get(name, name) in RANDOM_KINDS)}


def _first_difference(a: dict, b: dict, k: int, skip=frozenset()) -> tuple[int | None, str | None]:
    for i, (la, lb, sa, sb) in enumerate(zip(a["losses"], b["losses"], a["after"], b["after"])):
        if la != lb:
            return k + i, "loss"
        for name in sa:
            if name not in skip and sa[name] != sb.get(name):
                return k + i, name
    return None, None


def audit(build: Callable, step: Callable, steps: int = 3, then: int = 3, state: Callable | None = None,
          timeout: float = 600.0) -> AuditReport:
    """Check that resuming `step`'s loop from a checkpoint reproduces the uninterrupted run.

    `build()` makes the loop's objects (a dict: model, optimizer, scheduler, sampler, ...);
    `step(objects, i)` runs training step i and returns its loss (or None); `state(objects)`
    gives the tree a Checkpointer would save (default: the whole dict). All three must be
    importable (defined at module level): each phase runs in a fresh process."""
    if steps < 1 or then < 1:
        raise ValueError(f"steps and then must be at least 1, got {steps} and {then}")
    for fn in (build, step, state):
        if fn is not None:
            try:
                pickle.dumps(fn)
            except Exception:
                raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} cannot be sent to a fresh process: "
                                "define it at module level (not a lambda or a local function)") from None
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="forkpoint-audit-") as where:
        with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
            reference = pool.submit(_run, "reference", build, step, state, steps, then, f"{where}/repo")
            control = pool.submit(_run, "control", build, step, state, steps, then, f"{where}/control")
            ref = reference.result(timeout)
            resumed = pool.submit(_run, "resumed", build, step, state, steps, then, f"{where}/repo")
            ctl, res = control.result(timeout), resumed.result(timeout)
    return _loop_report(ref, ctl, res, steps, then)


def _loop_report(ref: dict, ctl: dict, res: dict, steps: int, then: int) -> AuditReport:
    """The audit's verdict from the three phases' records (see audit)."""
    report = AuditReport(exact=False, steps=steps, then=then)
    noisy = _noisy(ref, ctl)
    at, what = _first_difference(ref, ctl, steps, skip=noisy)
    if at is not None:
        report.nondeterministic, report.diverged_at, report.first_difference = True, at, what
        report.message = (f"not reproducible even without a checkpoint: two uninterrupted runs differ at step "
                          f"{at} ({what}); make the loop deterministic first (seeds, "
                          "torch.use_deterministic_algorithms(True), a fixed data order), then audit again")
        return report
    at, what = _first_difference(ref, res, steps, skip=noisy)
    report.diverged_at, report.first_difference = at, what
    before, after = ref["before"], res["before"]
    differ = [name for name in before if name not in noisy and before[name][1] is not None
              and before[name][1] != after.get(name, (0, None))[1]]
    report.unchecked = [f"{name} ({kind})" for name, (kind, digest) in before.items() if digest is None]
    report.missing = [f"{name}: {before[name][0]}" for name in differ]
    if at is None and not differ:
        report.exact = True
        report.message = (f"exact: resuming after step {steps - 1} reproduced the next {then} steps bit for bit "
                          f"(losses and every loop object)")
        return report
    hints = [FIXES.get(before[name][0], f"save {name.split(' (')[0]}") for name in differ]
    if at is None:
        report.message = ("the next steps matched, but after the restore these differ from the checkpointed run: "
                          + "; ".join(report.missing) + " (" + "; ".join(dict.fromkeys(hints)) + ")")
        return report
    if differ:
        report.message = (f"not exact: the resumed run first differs at step {at} ({what}); not restored: "
                          + "; ".join(report.missing) + " (" + "; ".join(dict.fromkeys(hints)) + ")")
    else:
        suspects = [u for u in report.unchecked if "sampler or data-loader" in u] or report.unchecked
        report.message = (f"not exact: the resumed run first differs at step {at} ({what}), and every piece the "
                          "audit can read matched after the restore; likely missing: "
                          + ("; ".join(suspects) if suspects else "state the step reads from elsewhere "
                             "(another module's globals, a file, the clock)"))
    return report


def audit_command(argv: list[str], steps: int = 3, then: int = 3, timeout: float = 600.0) -> AuditReport:
    """The resume audit of a script that uses a Checkpointer (see automation.script_audit):
    run `argv` as reference, control and resumed run, compare what each recorded."""
    if steps < 1 or then < 1:
        raise ValueError(f"steps and then must be at least 1, got {steps} and {then}")
    ref, ctl, res = _run_phases(argv, steps, then, timeout)
    return _script_report(ref, ctl, res, steps, then)


def _run_phases(argv: list[str], steps: int, then: int, timeout: float) -> tuple[dict, dict, dict]:
    """Run `argv` as the reference and the control (at once), then as the resumed run from the
    reference's repository; what each recorded."""
    import json
    import os
    import subprocess

    from .script_audit import ENV

    with tempfile.TemporaryDirectory(prefix="forkpoint-audit-") as where:
        def start(phase: str, repo: str):
            spec = {"phase": phase, "steps": steps, "then": then, "repo": f"{where}/{repo}",
                    "out": f"{where}/{phase}.json"}
            return subprocess.Popen(argv, env={**os.environ, ENV: json.dumps(spec)}, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)

        def finish(proc, phase: str) -> dict:
            _, err = proc.communicate(timeout=timeout)
            path = f"{where}/{phase}.json"
            if not os.path.exists(path):
                tail = "\n".join(err.strip().splitlines()[-5:])
                raise RuntimeError(f"the {phase} run of {' '.join(argv)} ended (exit {proc.returncode}) before "
                                   f"Checkpointer.step({steps + then - 1}): it must call ck.step every step and run "
                                   f"at least {steps + then} steps\n{tail}")
            with open(path) as f:
                return json.load(f)

        reference, control = start("reference", "repo"), start("control", "control")
        ref = finish(reference, "reference")
        resumed = start("resumed", "repo")
        ctl, res = finish(control, "control"), finish(resumed, "resumed")
        return ref, ctl, res


def _script_report(ref: dict, ctl: dict, res: dict, steps: int, then: int) -> AuditReport:
    """The audit's verdict from the three runs' records (see audit_command)."""
    report = AuditReport(exact=False, steps=steps, then=then)

    noisy = {name for key, pieces in ref["pieces"].items() for name, (kind, digest, _) in pieces.items()
             if kind in RANDOM_KINDS and digest != (ctl["pieces"].get(key, {}).get(name) or [None, None])[1]}

    def first(a: dict, b: dict):
        for s in range(steps, steps + then):
            key = str(s)
            if a["losses"].get(key) != b["losses"].get(key):
                return s, "loss", key
            pa, pb = a["pieces"].get(key, {}), b["pieces"].get(key, {})
            for name, (_, digest, _) in pa.items():
                if name not in noisy and digest is not None and digest != (pb.get(name) or [None, None])[1]:
                    return s, name, key
        return None, None, None

    at, what, _ = first(ref, ctl)
    if at is not None:
        report.nondeterministic, report.diverged_at, report.first_difference = True, at, what
        report.message = (f"not reproducible even without a checkpoint: two uninterrupted runs differ at step {at} "
                          f"({what}); make the script deterministic first, then audit again")
        return report
    at, what, key = first(ref, res)
    report.diverged_at, report.first_difference = at, what
    last = ref["pieces"].get(str(steps + then - 1), {})
    report.unchecked = sorted(f"{name} ({kind})" for name, (kind, digest, _) in last.items() if digest is None)
    if at is None:
        report.exact = True
        report.message = (f"exact: resuming after step {steps - 1} reproduced the next {then} steps bit for bit "
                          "(losses, the checkpointed state, the random streams and the loop's variables)")
        return report
    pa, pb = ref["pieces"].get(key, {}), res["pieces"].get(key, {})
    differ = [(name, kind) for name, (kind, digest, saved) in pa.items()
              if not saved and name not in noisy and digest is not None and digest != (pb.get(name) or [None, None])[1]]
    report.missing = [f"{name}: {kind}" for name, kind in differ]
    if differ:
        hints = dict.fromkeys(FIXES.get(kind, f"save {name}") for name, kind in differ)
        report.message = (f"not exact: the resumed run first differs at step {at} ({what}); not in the checkpoint: "
                          + "; ".join(report.missing) + " (" + "; ".join(hints) + ")")
    else:
        report.message = (f"not exact: the resumed run first differs at step {at} ({what}); nothing outside the "
                          "checkpoint that the audit can read differed; likely missing: "
                          + ("; ".join(report.unchecked) or "state the loop reads from elsewhere"))
    return report
