"""Whether a version fits the live objects a restore fills: every check of a strict restore
(missing, unexpected, shape, dtype, an optimizer of another class or over other parameters),
listed in one StateMismatchError with the way on.
"""

import os
import warnings

from ..errors import StateMismatchError
from ..format.manifest import Manifest
from ..format.paths import has_prefix, join_path
from ..state import is_module
from ..state.leaves import dtype_name
from ..state.stateful import another_class, class_name


def check_restore(m: Manifest, stored: dict, containers: set, live: dict, objects, scope,
                  strict: bool, classes: dict[str, str]) -> None:
    """StateMismatchError listing at once every way version `m`'s `stored` paths do not fit the
    `live` leaves and stateful `objects` within `scope`, with the way on; a warning instead for
    a class change that strict=False lets through."""
    def in_scope(p):
        return scope is None or any(has_prefix(p, s) for s in scope)

    changed = _class_changes(classes, objects, in_scope)
    if changed and not strict:
        warnings.warn(f"version {m.version.id}: restoring with strict=False into an object of another "
                      f"class than the one saved: {'; '.join(changed)}", stacklevel=4)

    open_prefixes = [keys_path(k) for k, o in objects if not is_module(o)]

    def checked(p):
        return not any(has_prefix(p, o) for o in open_prefixes)

    missing = sorted(p for p in live if in_scope(p) and p not in stored and checked(p))
    unexpected = sorted(p for p in stored if p not in live and checked(p))
    for keys, obj in objects:
        prefix = keys_path(keys)
        if (not is_module(obj) and in_scope(prefix) and prefix not in containers
                and not any(has_prefix(p, prefix) for p in stored)):
            missing.append(prefix)
    mismatched = list(changed) if strict else []
    for path, node in stored.items():
        if node.get("t") != "leaf" or path not in live:
            continue
        leaf, value = m.leaves[node["i"]], live[path]
        shape = getattr(value, "shape", None)
        if shape is None or leaf.kind in ("bytes", "pickle", "numpy_scalar"):
            continue
        live_dtype = dtype_name(value.dtype)
        if list(shape) != leaf.shape:
            mismatched.append(f"{path}: stored shape {leaf.shape}, live {list(shape)}")
        elif live_dtype != leaf.dtype and strict:
            mismatched.append(f"{path}: stored dtype {leaf.dtype}, live {live_dtype}")
    if not any(": stored shape " in p for p in mismatched):  # else the model changed, which explains it
        mismatched += _optimizer_mismatches(m, stored, objects, in_scope)
    if mismatched or (strict and (missing or unexpected)):
        lines = [f"cannot restore version {m.version.id} (step {m.version.step}) strictly:"]
        # The cause first: a shape or dtype mismatch explains the missing and unexpected
        # paths that usually follow it (a fresh optimizer has no state yet).
        if mismatched:
            lines.append(f"  mismatched ({len(mismatched)}): " + listing(mismatched, "; "))
        if missing:
            lines.append(f"  missing in the version ({len(missing)}): " + listing(missing))
        if unexpected:
            lines.append(f"  unexpected in the version ({len(unexpected)}): " + listing(unexpected))
        lines.append("  " + _parts_hint(live, objects, stored, mismatched, missing, unexpected))
        raise StateMismatchError("\n".join(lines))


def listing(items: list[str], sep: str = ", ", shown: int = 6) -> str:
    """The first `shown` items, then how many more and the prefix they share."""
    if len(items) <= shown + 2:
        return sep.join(items)
    rest = items[shown:]
    common = os.path.commonprefix([p.split(":")[0] for p in rest]).rpartition("/")[0]
    where = f" under {common}/" if common else ""
    return sep.join(items[:shown]) + f"{sep}and {len(rest)} more{where}"


def _parts_hint(live: dict, objects, stored: dict, mismatched, missing, unexpected) -> str:
    """How to restore anyway. Without a mismatch: the parts given that the version holds and
    that match exactly (a model restored alone from a version that also holds its optimizer is
    the common case). A shape mismatch is named instead (strict=False does not bypass it, and
    the optimizer state of a model of another shape would not fit the new one either)."""
    def top(p: str) -> str:
        return p.split(":")[0].split("/")[0]

    given = {top(p) for p in live} | {top(keys_path(k)) for k, _ in objects}
    troubled = {top(p) for p in missing + mismatched} | {top(p) for p in unexpected if top(p) in given}
    clean = sorted((given & {top(p) for p in stored}) - troubled)
    first = top((mismatched or missing or unexpected)[0])
    if any(": stored shape " in p for p in mismatched):
        return (f"a leaf of another shape cannot be restored into {first!r}: build it with the stored "
                "shapes, or restore the other parts only (paths=[...], rename={...})")
    if any(OPTIMIZER_MISMATCH in p for p in mismatched):
        return (f"{first!r} was built over other parameters or in another order than the run's: build it as the "
                "run did (over model.parameters(), in the same groups), or leave it out (paths=[...])")
    if any(": stored state of " in p for p in mismatched):
        others = f"restore the others only (paths={clean!r})" if clean else "leave it out (paths=[...])"
        return (f"{first!r} holds the state of another class: build the one the version was saved "
                f"from, or {others}; strict=False hands it the stored state anyway")
    if mismatched:
        return "strict=False restores into the live dtypes (the values converted); or paths=[...] leaves the part out"
    if clean:
        return f"to restore only the parts that match, pass paths={clean!r}; or strict=False, rename={{...}}"
    return f"to restore only some parts, pass paths=[{first!r}, ...]; or strict=False, rename={{...}}"


def _class_changes(classes: dict[str, str], objects, in_scope) -> list[str]:
    """'path: stored state of a <class>, live <class>' for each live torch object other than a
    module (an optimizer, a scheduler, a GradScaler) whose class has another name than the torch
    class recorded at its path: torch hands an AdamW state to SGD without a word, replacing its
    hyperparameters. Modules are checked by their keys; classes outside torch (the user's own, a
    wrapper such as accelerate's) by their own load_state_dict, so renaming one breaks nothing."""
    changes = []
    for keys, obj in objects:
        path = keys_path(keys)
        was, now = classes.get(path, ""), class_name(obj)
        if another_class(was, now) and not is_module(obj) and in_scope(path):
            changes.append(f"{path}: stored state of a {was.replace(':', '.')}, live {now.replace(':', '.')}")
    return changes


PARAM_SHAPED_STATE = frozenset({"Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam",
                                "Adadelta", "Rprop", "ASGD"})
"""torch optimizers whose per-parameter state tensors have their parameter's shape (Adafactor's
factored moments and LBFGS's history do not)."""

OPTIMIZER_MISMATCH = "the live optimizer's parameter"


def _optimizer_mismatches(m: Manifest, stored: dict, objects, in_scope) -> list[str]:
    """A line for each stored per-parameter state tensor of a torch optimizer that does not fit
    the live optimizer's parameter of its index (the optimizer built over its parameters in
    another order): torch loads such a state and fails at the first step with a broadcast error."""
    lines = []
    for keys, obj in objects:
        klass, prefix = type(obj), keys_path(keys)
        if not klass.__module__.startswith("torch.optim") or klass.__name__ not in PARAM_SHAPED_STATE \
                or not in_scope(prefix):
            continue
        params = [p for group in obj.param_groups for p in group["params"]]
        for path, node in stored.items():
            parts = (path[len(prefix) + 1:] if prefix else path).split("/")
            if (node.get("t") != "leaf" or not has_prefix(path, prefix) or len(parts) != 3 or parts[0] != "state"
                    or not parts[1].isdigit()):
                continue
            shape, i = m.leaves[node["i"]].shape, int(parts[1])
            if not shape:
                continue
            if i >= len(params):
                lines.append(f"{path}: {OPTIMIZER_MISMATCH} {i} does not exist (it has {len(params)})")
            elif list(params[i].shape) != shape:
                lines.append(f"{path}: saved for a parameter of shape {shape}, {OPTIMIZER_MISMATCH} {i} has "
                             f"shape {list(params[i].shape)}")
    return lines


def keys_path(keys: tuple) -> str:
    """The state path of capture's typed `keys`."""
    return join_path(*keys)
