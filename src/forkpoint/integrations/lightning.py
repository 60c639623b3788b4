"""PyTorch Lightning: a CheckpointIO plugin that stores checkpoints as forkpoint versions.

`Trainer(plugins=[fp.lightning.CheckpointIO(repo)])`: every checkpoint Lightning writes
(ModelCheckpoint every n steps, top-k, last; SLURM's hpc_ckpt on requeue) becomes a version
on `branch`, tagged after its file name and carrying the monitored metrics; a small pointer
file at the path keeps Lightning's path logic (top-k bookkeeping, last, `ckpt_path="hpc"`)
working. `trainer.fit(ckpt_path=...)` takes such a path or any ref ("main", a tag, an id).
`remove_checkpoint` untags the version and lets retention (`keep`) release it.

Lightning's checkpoint dict is stored as a tree: tensors as leaves, plain data (numbers,
strings, lists, dicts, None) in the manifest, without pickle. Other objects (an argparse
Namespace in hparams, a custom class) are refused with an error naming their path unless
`allow_pickle=True`, which then must be given on load too.
"""

import os

from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO

from ..policy.retention import Keep
from .pointers import read_pointer, resolve, tag_for, write_pointer


def monitored_metrics(checkpoint: dict) -> dict:
    """{monitor: current score} of each ModelCheckpoint whose state is in `checkpoint`."""
    metrics = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("ModelCheckpoint") and isinstance(state, dict) and state.get("monitor"):
            score = state.get("current_score")
            if score is not None:
                metrics[str(state["monitor"])] = float(score)
    return metrics


class CheckpointIO(_LightningCheckpointIO):
    """Lightning CheckpointIO over `repo`. With sync=False the call returns once the state is
    copied (capture); writing and committing go on in the background."""

    def __init__(self, repo, branch: str = "main", keep: Keep | None = None, allow_pickle: bool = False,
                 sync: bool = True, gc_grace: float = 600.0):
        super().__init__()
        self.repo, self.branch, self.allow_pickle, self.sync = repo, branch, allow_pickle, sync
        self.keep = keep or Keep(last=1, tags=True)
        self.gc_grace = gc_grace

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        tag = tag_for(path)
        args = dict(branch=self.branch, step=checkpoint.get("global_step"), message=f"lightning {os.path.basename(str(path))}",
                    metrics=monitored_metrics(checkpoint), meta={"lightning_path": str(path)},
                    allow_pickle=self.allow_pickle)
        if self.sync:
            self._publish(self.repo.save(checkpoint, **args), path, tag)
            return
        pending = self.repo.save(checkpoint, sync=False, **args)
        pending.wait_capture()
        self.repo.background(lambda: self._publish(pending.wait(), path, tag))

    def _publish(self, version, path, tag: str) -> None:
        self.repo.tag(tag, version.id, force=True)
        write_pointer(path, self.repo.url, version.id, tag)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        self.repo.drain()
        return self.repo.load(resolve(path), map_location=map_location, allow_pickle=self.allow_pickle)

    def remove_checkpoint(self, path) -> None:
        self.repo.drain()
        record = read_pointer(path)
        if record is None:
            return
        tag = record.get("tag")
        if tag and self.repo.tags().get(tag) == record.get("version"):
            self.repo.delete_tag(tag)
        os.remove(str(path))
        self.repo.background(self.repo.gc, keep=self.keep, branches=[self.branch], grace=self.gc_grace)

    def teardown(self) -> None:
        self.repo.drain()
