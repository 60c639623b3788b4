"""Training stall per checkpoint with each framework's default checkpointing against the
forkpoint plug-in: Lightning, Hugging Face Trainer, DeepSpeed (ZeRO-1, CPU).

Same model for all (an MLP of 6 × Linear(1536, 1536), ~14M parameters; with AdamW ~170 MB of
state), same data, `--steps` steps with a checkpoint every `--every` steps, CPU. Stall per
checkpoint = (wall time − wall time of the same run without checkpoints) / checkpoints. Each
run ends with every checkpoint durable. Each configuration runs in its own process, all in
one invocation, `--repeats` times interleaved; medians are reported.

    python benchmarks/frameworks.py --repeats 3 --dir /work/bench-fw
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

warnings.filterwarnings("ignore")
WIDTH, LAYERS, BATCH = 1536, 6, 32


def mlp():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def batches(n):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, WIDTH, generator=g) for _ in range(n)]


def run_lightning(mode, steps, every, d):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import forkpoint as fp

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(batches(steps))), batch_size=BATCH)
    callbacks, plugins = [], []
    if mode != "none":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(d, "ckpt"), every_n_train_steps=every, save_top_k=-1))
    if mode.startswith("forkpoint"):
        plugins.append(fp.lightning.CheckpointIO(fp.Repo(os.path.join(d, "repo"), create=True),
                                                 sync=mode == "forkpoint-sync"))
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, plugins=plugins, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         enable_checkpointing=mode != "none")
    start = time.perf_counter()
    trainer.fit(Module(), data)
    trainer.strategy.checkpoint_io.teardown()
    os.sync()
    return time.perf_counter() - start


def run_transformers(mode, steps, every, d):
    import torch
    from transformers import Trainer, TrainingArguments

    import forkpoint as fp

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return {"loss": self.net(x).pow(2).mean()}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.cat(batches(steps))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i]}

    args = TrainingArguments(output_dir=os.path.join(d, "out"), max_steps=steps, per_device_train_batch_size=BATCH,
                             save_strategy="no" if mode == "none" else "steps", save_steps=every, report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, logging_steps=10 ** 6)
    trainer = Trainer(model=Model(), args=args, train_dataset=Data())
    if mode.startswith("forkpoint"):
        fp.transformers.install(trainer, fp.Repo(os.path.join(d, "repo"), create=True),
                                sync=mode == "forkpoint-sync")
    start = time.perf_counter()
    trainer.train()
    os.sync()
    return time.perf_counter() - start


def run_deepspeed(mode, steps, every, d):
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29000 + os.getpid() % 1000), "DS_ACCELERATOR": "cpu"})
    import deepspeed

    import forkpoint as fp

    deepspeed.init_distributed(dist_backend="gloo")
    model = mlp()
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if mode.startswith("forkpoint"):
        fp.deepspeed.install(engine, fp.Repo(os.path.join(d, "repo"), create=True), sync=mode == "forkpoint-sync",
                             decoupled=mode == "forkpoint-decoupled")
    data = batches(steps)
    start = time.perf_counter()
    for step in range(steps):
        loss = engine(data[step]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if mode != "none" and (step + 1) % every == 0:
            engine.save_checkpoint(os.path.join(d, "ckpt"))
    if mode.startswith("forkpoint"):
        engine.checkpoint_engine.cleanup()
    os.sync()
    return time.perf_counter() - start


MODES = {"lightning": ["none", "default", "forkpoint-sync", "forkpoint-async"],
         "transformers": ["none", "default", "forkpoint-sync", "forkpoint-async"],
         "deepspeed": ["none", "default", "forkpoint-sync", "forkpoint-async", "forkpoint-decoupled"]}


def child(framework, mode, steps, every, d):
    import torch

    torch.set_num_threads(2)
    seconds = globals()[f"run_{framework}"](mode, steps, every, d)
    print(json.dumps({"seconds": seconds}))


def main():
    p = harness.arguments(__doc__, repeats=3, dir_default="/tmp/forkpoint-bench-fw")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--frameworks", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.steps, a.every, a.dir)
    chosen = a.frameworks.split(",")
    for name in [n for n in MODES if n not in chosen]:
        del MODES[name]
    times = {(f, m): [] for f, modes in MODES.items() for m in modes}
    for r in range(a.repeats):
        for framework, modes in MODES.items():
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                d = os.path.join(a.dir, f"{framework}-{mode}")
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                out = subprocess.run([sys.executable, __file__, "--child", framework, mode, "--steps", str(a.steps),
                                      "--every", str(a.every), "--dir", d], capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"{framework} {mode} failed:\n{out.stderr[-3000:]}")
                times[(framework, mode)].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
                shutil.rmtree(d, ignore_errors=True)
    n = a.steps // a.every
    report = {}
    print(f"{a.steps} steps, a checkpoint every {a.every} ({n} checkpoints), medians of {a.repeats}")
    for framework, modes in MODES.items():
        base = statistics.median(times[(framework, "none")])
        print(f"{framework}: {base / a.steps:.3f} s/step without checkpoints")
        for mode in modes[1:]:
            stall = (statistics.median(times[(framework, mode)]) - base) / n
            report[f"{framework}/{mode}"] = round(stall, 3)
            print(f"  {mode:16s} stall per checkpoint {stall:.3f} s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
