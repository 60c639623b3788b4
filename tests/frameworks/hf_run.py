"""A tiny GPT-2 (random weights from a config, no downloads) trained with the HF Trainer,
checkpointing through forkpoint; writes its final parameters to --out."""

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import forkpoint as fp  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=128):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class CountSteps(TrainerCallback):
    """Counts the optimizer steps this process ran."""

    ran = 0

    def on_step_end(self, args, state, control, **kwargs):
        CountSteps.ran += 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--plain", action="store_true", help="the Trainer's own checkpointing")
    p.add_argument("--async", dest="asynchronous", action="store_true", help="install(sync=False)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=a.dir, max_steps=a.steps, save_steps=a.save_steps, save_strategy="steps",
                             per_device_train_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True,
                             seed=0, logging_steps=1, dataloader_num_workers=0, save_total_limit=a.limit,
                             disable_tqdm=True, warmup_steps=2, lr_scheduler_type="linear")
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[CountSteps()])
    if not a.plain:
        fp.transformers.install(trainer, fp.Repo(a.repo, create=True), sync=not a.asynchronous)
    resume = {"true": True, None: None}.get(a.resume, a.resume)
    trainer.train(resume_from_checkpoint=resume)
    torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
                "step": trainer.state.global_step, "ran": CountSteps.ran}, a.out)


if __name__ == "__main__":
    main()
