"""A training script with a Checkpointer for `forkpoint audit`; --forget leaves a piece out
of the checkpoint (as users do)."""

import argparse

import torch

import forkpoint as fp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--forget", choices=["nothing", "sched", "rng"], default="nothing")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    state = {"model": model, "optim": opt, "sched": sched, "rng": fp.RNGState()}
    if args.forget != "nothing":
        state.pop(args.forget)
    ck = fp.Checkpointer(fp.Repo(args.repo, create=True), state, every=10)
    step = ck.resume()
    while step < args.steps:
        loss = model(data).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ck.step(step, metrics={"loss": loss.item()})
        step += 1
    ck.close(final_step=step - 1)


if __name__ == "__main__":
    main()
