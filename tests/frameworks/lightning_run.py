"""A tiny Lightning run for the plug-in tests: trains, checkpoints through forkpoint, and
writes its final parameters to --out."""

import argparse
import os
import signal
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.environments import SLURMEnvironment  # noqa: E402

import forkpoint as fp  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 16, custom: bool = False, nan_loss_from: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        diverged = self.hparams.nan_loss_from is not None and self.current_epoch >= self.hparams.nan_loss_from
        self.log("train_loss", loss * float("nan") if diverged else loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)}

    def on_train_start(self):
        self.start_step = self.trainer.global_step

    def on_save_checkpoint(self, checkpoint):
        if self.hparams.custom:
            checkpoint["custom"] = object()


class Preempt(Callback):
    """Sends SLURM's requeue signal to this process at a step, then dies as a killed job does."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hpc", action="store_true", help="save an hpc_ckpt as SLURM's requeue handler does")
    p.add_argument("--custom", action="store_true")
    p.add_argument("--nan-loss-from", type=int, default=None, help="log a NaN train_loss from this epoch on")
    p.add_argument("--async", dest="sync", action="store_false")
    p.add_argument("--slurm-signal-at", type=int, default=None)
    p.add_argument("--devices", type=int, default=1, help="more than 1: DDP over that many CPU processes")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    repo = fp.Repo(a.repo, create=True)
    ckpt = ModelCheckpoint(dirpath=a.dir, monitor="train_loss", save_top_k=a.top_k, save_last=True, every_n_epochs=1)
    plugins = [fp.lightning.CheckpointIO(repo, sync=a.sync)]
    callbacks = [ckpt]
    if "SLURM_JOB_ID" in os.environ:
        plugins.append(SLURMEnvironment(auto_requeue=True))
    if a.slurm_signal_at is not None:
        callbacks.append(Preempt(a.slurm_signal_at))
    trainer = pl.Trainer(max_epochs=a.epochs, plugins=plugins,
                         callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=a.dir, accelerator="cpu", devices=a.devices,
                         strategy="ddp" if a.devices > 1 else "auto")
    model = Tiny(custom=a.custom, nan_loss_from=a.nan_loss_from)
    trainer.fit(model, data(), ckpt_path=a.ckpt_path)
    if a.hpc:
        trainer.save_checkpoint(f"{a.dir}/hpc_ckpt_1.ckpt")
    if trainer.is_global_zero:
        torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
                    "best": ckpt.best_model_path, "global_step": trainer.global_step,
                    "start_step": model.start_step}, a.out)
    repo.close()


if __name__ == "__main__":
    main()
