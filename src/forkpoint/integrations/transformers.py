"""Hugging Face Transformers: Trainer checkpoints as forkpoint versions.

`fp.transformers.install(trainer, repo)` makes the Trainer save each checkpoint (at
`save_steps`, `save_strategy` as configured) as a version on `branch`, tagged
`checkpoint-<step>`, holding the model's state dict, the optimizer, the scheduler, the RNG
states and the TrainerState, with no checkpoint folder written. `trainer.train(
resume_from_checkpoint=<ref>)` then takes a ref ("checkpoint-400", a version id, "main", or
True for the branch head): the version is laid out in a temporary folder exactly as the
Trainer writes its own checkpoints, and the Trainer's own resume logic reads it, so the
resumed run continues exactly. `save_total_limit` maps to retention: older versions lose
their tag and gc releases them. The installed `Callback` also records each log entry's
metrics in the next version. With `sync=False` a checkpoint only schedules the copy: the
optimizer's next step (and the forward of modules that own buffers) waits for the tensors it
would overwrite, and tagging and retention run once the version is committed.
"""

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np
from transformers import TrainerCallback

from ..policy.retention import Keep
from ..state.hooks import CaptureGuard

TAG_PREFIX = "checkpoint-"


class Callback(TrainerCallback):
    """Remembers the newest logged metrics (put into the next version) and waits for the
    repository's background work when training ends."""

    def __init__(self, repo):
        self.repo = repo
        self.metrics: dict = {}
        self.guard = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.metrics.update({k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    def on_train_end(self, args, state, control, **kwargs):
        self.repo.drain()
        if self.guard is not None:
            self.guard.remove()
            self.guard = None


def _rng_state() -> dict:
    """The generators the Trainer saves (python, numpy, cpu, this process's cuda), as plain data."""
    import torch

    from ..state.providers import RNGState

    sd = RNGState().state_dict()
    out = {"python": sd["python"], "numpy": sd["numpy"], "cpu": sd["torch"]}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state()
    return out


def _trainer_rng_file(rng: dict) -> dict:
    """The dict the Trainer writes to rng_state.pth, rebuilt from a stored RNG tree."""
    py, n = rng["python"], rng["numpy"]
    out = {"python": (int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]),
           "numpy": (n["name"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
                     float(n["cached_gaussian"])),
           "cpu": rng["cpu"]}
    if "cuda" in rng:
        out["cuda"] = rng["cuda"]
    return out


def save_version(trainer, repo, branch: str, callback: Callback, sync: bool = True):
    """Save the Trainer's full state as a version tagged checkpoint-<global step>; with
    sync=False return the PendingSave at once (see the module docstring)."""
    for cb in trainer.callback_handler.callbacks + [trainer.control]:
        export = getattr(cb, "state", None)
        if callable(export) and type(cb).__name__ in trainer.state.stateful_callbacks:
            name = type(cb).__name__
            if isinstance(trainer.state.stateful_callbacks[name], list):
                trainer.state.stateful_callbacks[name].append(export())
            else:
                trainer.state.stateful_callbacks[name] = export()
    state = {"model": trainer.model.state_dict(),
             "trainer_state": json.loads(json.dumps(dataclasses.asdict(trainer.state)))}
    if not trainer.args.save_only_model:
        state["optimizer"] = trainer.optimizer.state_dict()
        if trainer.lr_scheduler is not None:
            state["scheduler"] = trainer.lr_scheduler.state_dict()
        state["rng"] = _rng_state()
    step = trainer.state.global_step
    if not sync and callback.guard is None:
        callback.guard = CaptureGuard()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        callback.guard.install([o for o in (trainer.model, optimizer) if o is not None])
    saved = repo.save(state, branch=branch, step=step, message=f"{TAG_PREFIX}{step}", sync=sync,
                      metrics=dict(callback.metrics), meta={"transformers_output_dir": trainer.args.output_dir,
                                                            **_hf_config(trainer.model)})
    if sync:
        return _after_save(trainer, repo, branch, saved)
    callback.guard.add(saved.capture_map)
    repo.background(lambda: _after_save(trainer, repo, branch, saved.wait()))
    return saved


def _hf_config(model) -> dict:
    """{"hf_config": the model's config as plain JSON} (what `forkpoint export --format hf`
    writes as config.json), or {} for a model without one."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    return {"hf_config": json.loads(config.to_json_string(use_diff=False))}


def _after_save(trainer, repo, branch: str, version):
    """Tag the committed version and apply save_total_limit."""
    step = version.step
    repo.tag(f"{TAG_PREFIX}{step}", version.id, force=True)
    limit = trainer.args.save_total_limit
    if limit:
        tags = repo.tags()
        for old in repo.log(branch)[limit:]:
            name = f"{TAG_PREFIX}{old.step}"
            if tags.get(name) == old.id:
                repo.delete_tag(name)
        repo.background(repo.gc, keep=Keep(last=limit, tags=True), branches=[branch])
    return version


def materialize(repo, ref: str, directory: str) -> None:
    """Lay version `ref` out in `directory` as the Trainer lays out a checkpoint folder."""
    import torch
    from safetensors.torch import save_file

    tree = repo.load(ref)
    model, seen = {}, set()
    for key, tensor in tree["model"].items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and ident in seen:
            continue
        seen.add(ident)
        model[key] = tensor.contiguous()
    save_file(model, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    if "optimizer" in tree:
        torch.save(tree["optimizer"], os.path.join(directory, "optimizer.pt"))
    if "scheduler" in tree:
        torch.save(tree["scheduler"], os.path.join(directory, "scheduler.pt"))
    if "rng" in tree:
        torch.save(_trainer_rng_file(tree["rng"]), os.path.join(directory, "rng_state.pth"))
    with open(os.path.join(directory, "trainer_state.json"), "w") as f:
        json.dump(tree["trainer_state"], f, indent=2, sort_keys=True)


def install(trainer, repo, branch: str = "main", sync: bool = True):
    """Make `trainer` checkpoint to `repo` and resume from refs; return the trainer."""
    callback = Callback(repo)
    trainer.add_callback(callback)
    trainer._save_checkpoint = lambda model, trial: save_version(trainer, repo, branch, callback, sync)
    original_train = trainer.train

    def train(resume_from_checkpoint=None, *args, **kwargs):
        ref = resume_from_checkpoint
        if ref is True:
            ref = repo.head(branch)
            if ref is None:
                raise ValueError(f"no version on branch {branch!r} of {repo.url} to resume from")
        if not isinstance(ref, str) or os.path.isdir(ref):
            return original_train(ref, *args, **kwargs)
        directory = tempfile.mkdtemp(prefix="forkpoint-resume-")
        try:
            materialize(repo, ref, directory)
            return original_train(directory, *args, **kwargs)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    trainer.train = train
    return trainer
