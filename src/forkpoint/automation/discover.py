"""State discovery: run one training step under a dispatcher-level capture and name every
piece of state it mutates or reads, so the checkpoint holds exactly what the next step needs.

The capture is a TorchDispatchMode: it sees each ATen operator the step runs (forward,
backward and the optimizer's update, foreach kernels included) with its schema, which marks
the arguments written in place and the operators that draw from a random generator. That is
the level torch.compile's functionalisation works at, without compiling: dynamo breaks the
graph at `loss.backward()` and `optimizer.step()`, the two places most state changes. What
no operator touches (a scheduler's epoch counter, a Python counter, numpy's generator) is
found by comparing each object the step can reach before and after it.

The step runs once on the caller's objects, which are put back as they were afterwards.
"""

import copy
import random
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import ForkpointError
from .fingerprint import loop_objects, object_kind, rng_fingerprints, value_digest


class DiscoveryError(ForkpointError):
    """The step could not be run under the capture; the message says where and why."""


@dataclass
class Discovery:
    """What one step mutated and read: names of tensors (model.<param>, model.<buffer>,
    optimizer.state[<param>].<key>), random streams, and other objects whose state changed.
    `state()` is the tree to checkpoint; `missing(tree)` names what a tree leaves out."""

    mutated: list[str] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    random_streams: list[str] = field(default_factory=list)
    changed_objects: list[str] = field(default_factory=list)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    gradients: list[str] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)
    ops: int = 0
    objects: dict = field(default_factory=dict, repr=False)
    """name -> the object to checkpoint (model, optimizer, each changed loop object)."""

    def state(self) -> dict:
        """The state tree a Checkpointer needs to resume this step exactly."""
        from ..state.providers import RNGState

        tree = dict(self.objects)
        if self.random_streams:
            tree["rng"] = RNGState()
        return tree

    def checkpoint_state(self) -> dict:
        """`state()`, by the name a Checkpointer looks for."""
        return self.state()

    def missing(self, tree) -> list[str]:
        """The pieces of `state()` that `tree` (a state tree as given to save) does not hold,
        each as "NAME (KIND): FIX"."""
        from ..state.providers import RNGState
        from .audit import FIXES

        held = _held_ids(tree)
        out = []
        for name, obj in self.objects.items():
            if id(obj) not in held:
                kind = object_kind(obj)
                fix = FIXES.get(kind) or FIXES.get(f"{kind} state") or f"add {name} to the state"
                out.append(f"{name} ({kind}): {fix}")
        if self.random_streams and not any(isinstance(o, RNGState) for o in _objects_in(tree)):
            out.append(f"random streams ({', '.join(self.random_streams)}): {FIXES['torch RNG']}")
        return out

    def __str__(self) -> str:
        lines = [f"one step ran {self.ops} operators"]
        for title, items in (("mutates", self.mutated), ("reads", self.read),
                             ("draws from", self.random_streams), ("changes", self.changed_objects),
                             ("writes gradients of", self.gradients), ("mutates unnamed", self.unnamed)):
            if items:
                lines.append(f"{title} ({len(items)}): {_some(items)}")
        for names in self.tied:
            lines.append(f"tied: {' = '.join(names)}")
        lines.append(f"state to checkpoint: {', '.join(self.state())}")
        return "\n".join(lines)


def discover(model, optimizer, step_fn: Callable, example_batch, extra: dict | None = None) -> Discovery:
    """Run `step_fn(example_batch)` once under capture and return what it mutated and read;
    the model, optimizer, random streams and every object the step reaches are restored."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fp.discover needs the model as a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fp.discover needs a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if not callable(step_fn):
        raise TypeError(f"fp.discover needs step_fn, a function of the batch, got {type(step_fn).__name__}")
    reachable = {k: v for k, v in loop_objects(step_fn, extra).items() if v is not model and v is not optimizer}
    saved = _Snapshot(model, optimizer, reachable)
    before = {name: value_digest(obj) for name, obj in reachable.items()}
    streams_before = rng_fingerprints()
    written, touched, created, seeded, count = set(), set(), set(), set(), [0]

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            count[0] += 1
            inputs = set()
            for i, arg in enumerate(func._schema.arguments):
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                keys = _storages(value)
                inputs.update(keys)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written.update(keys)
            touched.update(inputs - created)
            if torch.Tag.nondeterministic_seeded in func.tags:
                seeded.add("CUDA RNG" if _on_cuda(args, kwargs) else "torch RNG")
            out = func(*args, **kwargs)
            created.update(set(_storages(out if isinstance(out, (list, tuple)) else [out])) - inputs)
            return out

    try:
        with Capture():
            step_fn(example_batch)
    except Exception as e:
        saved.restore()
        raise DiscoveryError(f"the step raised under the capture, so its state cannot be discovered: "
                             f"{type(e).__name__}: {e}; run step_fn(example_batch) alone to check it") from e
    streams_after = rng_fingerprints()
    after = {name: value_digest(obj) for name, obj in reachable.items()}
    grads = _grad_storages(model)
    written.update(saved.changed_module_tensors())  # schemas that do not mark a write (batch norm)
    named = _named_tensors(model, optimizer)  # after the step: optimizers make their state lazily
    saved.restore()
    if count[0] == 0:
        raise DiscoveryError("the step ran no tensor operator: pass the function that runs one training "
                             "step (forward, backward, optimizer.step) on example_batch")
    return _report(model, optimizer, named, reachable, written, touched, created, seeded, grads,
                   {k for k in streams_before if streams_before[k] != streams_after.get(k)},
                   [k for k in reachable if before[k] is not None and before[k] != after[k]], count[0])


def _report(model, optimizer, named, reachable, written, touched, created, seeded, grads, streams, changed, ops):
    found = Discovery(ops=ops)
    by_storage: dict = {}
    for name, key in named:
        by_storage.setdefault(key, []).append(name)
    found.tied = [tuple(names) for names in by_storage.values() if len(names) > 1]
    for key, names in by_storage.items():
        if key in written:
            found.mutated.append(names[0])
        elif key in touched:
            found.read.append(names[0])
    found.gradients = [n for n, _ in grads]
    known = set(by_storage) | {key for _, key in grads} | {
        _key(obj) for obj in reachable.values() if isinstance(obj, sys.modules["torch"].Tensor)}
    # a storage made during the step (an activation, a fresh gradient) is not state; one that
    # existed before, was written and has no name is state the checkpoint would miss
    found.unnamed = [f"a {key[0]} tensor at {key[1]:#x}" for key in sorted(written - known - created, key=str)
                     if key[0] is not None]
    found.random_streams = sorted(seeded | streams)
    found.changed_objects = [f"{name} ({object_kind(reachable[name])})" for name in changed]
    found.objects = {"model": model}
    if optimizer is not None:
        found.objects["optimizer"] = optimizer
    for name in changed:
        found.objects[name] = reachable[name]
    return found


def _storages(value) -> list:
    """The storage keys of the tensors in an operator argument (a tensor or a list of them)."""
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        return [_key(value)]
    if isinstance(value, (list, tuple)):
        return [_key(v) for v in value if isinstance(v, torch.Tensor)]
    return []


def _key(t) -> tuple:
    try:
        storage = t.untyped_storage()
        return (storage.device.type, storage.data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, meta)
        return (None, id(t))


def _on_cuda(args, kwargs) -> bool:
    torch = sys.modules["torch"]
    values = [*args, *kwargs.values()]
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values) or \
        any(isinstance(v, torch.device) and v.type == "cuda" for v in values) or \
        str(kwargs.get("device", "")).startswith("cuda")


def _named_tensors(model, optimizer) -> list[tuple[str, tuple]]:
    """(name, storage key) of every parameter, buffer and optimizer state tensor, tied
    parameters under each of their names."""
    torch = sys.modules["torch"]
    out = [(f"model.{n}", _key(p)) for n, p in model.named_parameters(remove_duplicate=False)]
    out += [(f"model.{n}", _key(b)) for n, b in model.named_buffers(remove_duplicate=False)]
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for i, (param, entry) in enumerate(optimizer.state.items()):
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    out.append((f"optimizer.state[{names.get(id(param), i)}].{k}", _key(v)))
    return out


def _grad_storages(model) -> list[tuple[str, tuple]]:
    return [(f"model.{n}.grad", _key(p.grad)) for n, p in model.named_parameters() if p.grad is not None]


class _Snapshot:
    """Copies of what a step changes, to put back: module and optimizer state, gradients,
    the global random streams, and the objects the step reaches (tensors by value, others by
    state_dict)."""

    def __init__(self, model, optimizer, reachable: dict):
        import torch

        self.model, self.optimizer, self.reachable = model, optimizer, reachable
        self.module = copy.deepcopy(model.state_dict())
        self.grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        self.optim = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        self.objects, self.tensors = {}, {}
        for name, obj in reachable.items():
            if isinstance(obj, torch.Tensor):
                self.tensors[name] = obj.detach().clone()
            elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                try:
                    self.objects[name] = copy.deepcopy(obj.state_dict())
                except Exception:  # not copyable: left as the step leaves it
                    pass

    def changed_module_tensors(self) -> set:
        """Storage keys of the module's parameters and buffers whose values the step changed."""
        import torch

        return {_key(t) for name, t in self.model.state_dict(keep_vars=True).items()
                if isinstance(t, torch.Tensor) and not torch.equal(t.detach(), self.module[name])}

    def restore(self) -> None:
        import torch

        self.model.load_state_dict(self.module)
        for n, p in self.model.named_parameters():
            p.grad = self.grads[n]
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.optim)
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        if self.rng[3] is not None:
            torch.cuda.set_rng_state_all(self.rng[3])
        for name, sd in self.objects.items():
            self.reachable[name].load_state_dict(sd)
        with torch.no_grad():
            for name, value in self.tensors.items():
                self.reachable[name].copy_(value)


def _held_ids(tree) -> set[int]:
    return {id(o) for o in _objects_in(tree)}


def _objects_in(tree, depth: int = 0) -> list:
    """Every object in a state tree (containers walked, up to 20 deep)."""
    if depth > 20:
        return []
    out = [tree]
    if isinstance(tree, dict):
        for v in tree.values():
            out += _objects_in(v, depth + 1)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            out += _objects_in(v, depth + 1)
    return out


def _some(items: list[str], shown: int = 8) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
