"""`forkpoint audit -- python train.py ...`: the resume audit of a script that uses a Checkpointer.

The command runs the script three times with FORKPOINT_AUDIT set; `import forkpoint` then
installs a Checkpointer extension that, instead of the script's own schedule and repository,
saves once after step k-1 into a private repository (reference), or saves nothing (control),
or restores from it (resumed); records, at each `ck.step` from step k on, the loss the
script reports (`metrics={"loss": ...}`), the checkpointed state, the global random streams
and the loop's local variables; and ends the process after step k+j-1.
"""

import json
import os
import sys

from ..repo import Repo
from .fingerprint import object_kind, rng_fingerprints, value_digest

ENV = "FORKPOINT_AUDIT"


def _pieces(ck, frame_locals: dict) -> dict[str, list]:
    """{piece: [kind, digest, saved]}: the state's top-level entries, the random streams and
    the calling loop's locals that are not the state's own objects."""
    from ..state import capture

    state = ck.state
    saved_ids = {id(obj) for _, obj in capture(state)[1]}
    out = {}
    if isinstance(state, dict):
        for name, obj in state.items():
            out[f"state[{name!r}]"] = [object_kind(obj), value_digest(obj), True]
            saved_ids.add(id(obj))
    for name, digest in rng_fingerprints().items():
        out[name] = [name, digest, False]
    for name, obj in frame_locals.items():
        if name.startswith("_") or id(obj) in saved_ids or obj is ck or obj is state or callable(obj) and not hasattr(obj, "state_dict"):
            continue
        kind = object_kind(obj)
        if kind in ("str", "Namespace", "Repo", "Checkpointer", "bool", "NoneType", "list", "dict"):
            continue
        out[f"local {name}"] = [kind, value_digest(obj), False]
    return out


def install(spec: dict) -> None:
    """Register the extension that makes every Checkpointer of this process play `spec`'s phase."""
    from .. import checkpointer

    k, j, phase = int(spec["steps"]), int(spec["then"]), spec["phase"]
    records: dict = {"losses": {}, "pieces": {}}

    def finish() -> None:
        with open(spec["out"], "w") as f:
            json.dump(records, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    private: list[Repo] = []

    def private_repository(repo, branch):
        """The script's repository is not the audit's business: it is never written."""
        if not private:
            private.append(Repo(spec["repo"], create=True))
        return private[0], "main"

    def extend(ck) -> None:
        if phase != "resumed":
            ck.resume = lambda *args, **kwargs: 0

        def step(step_number, metrics=None):
            step_number = int(step_number)
            if phase == "reference" and step_number == k - 1:
                ck.save(step_number, sync=True)
            if step_number >= k:
                loss = (metrics or {}).get("loss")
                records["losses"][str(step_number)] = None if loss is None else float(loss).hex()
                records["pieces"][str(step_number)] = _pieces(ck, dict(sys._getframe(1).f_locals))
            if step_number >= k + j - 1:
                finish()
            return None

        ck.step = step

    checkpointer.REPOSITORY_OVERRIDE = private_repository
    checkpointer.EXTENSIONS.append(extend)


def install_from_environment() -> None:
    spec = os.environ.get(ENV)
    if spec:
        install(json.loads(spec))
