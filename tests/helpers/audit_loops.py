"""Training loops for the resume audit: one correct, one per missing piece, one nondeterministic.
`build(variant)` and `step(variant, objects, i)` (bound with functools.partial)."""

import os
import random

import numpy as np
import torch

import forkpoint as fp

X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(256, 1, generator=torch.Generator().manual_seed(2))
steps_done = 0  # the "counter" loop's Python counter


class Moments:
    """Saves an optimizer's per-parameter state but not its param groups (a hand-made state)."""

    def __init__(self, opt):
        self.opt = opt

    def state_dict(self):
        return {"state": self.opt.state_dict()["state"]}

    def load_state_dict(self, sd):
        self.opt.load_state_dict({"state": sd["state"], "param_groups": self.opt.state_dict()["param_groups"]})


def build(variant: str) -> dict:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    norm = torch.nn.BatchNorm1d(16) if variant in ("correct", "buffers") else torch.nn.Identity()
    drop = torch.nn.Dropout(0.2) if variant in ("correct", "torch_rng") else torch.nn.Identity()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), norm, torch.nn.ReLU(), drop, torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    objects = {"model": model, "opt": opt, "sampler": fp.ResumableSampler(256, seed=3)}
    if variant in ("correct", "sched"):
        objects["sched"] = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    if variant == "scaler":
        objects["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
    return objects


def state(variant: str, objects: dict):
    """What the variant's (possibly wrong) Checkpointer saves."""
    saved = dict(objects)
    if variant == "correct":
        saved["rng"] = fp.RNGState()
    elif variant == "sched":
        saved.pop("sched")
    elif variant == "sampler":
        saved.pop("sampler")
    elif variant == "scaler":
        saved.pop("scaler")
    elif variant == "buffers":
        saved["model"] = dict(objects["model"].named_parameters())
    elif variant == "param_groups":
        saved["opt"] = Moments(objects["opt"])
    return saved


def step(variant: str, objects: dict, i: int):
    global steps_done
    model, opt = objects["model"], objects["opt"]
    it = iter(objects["sampler"])
    idx = [next(it) for _ in range(16)]
    x, y = X[idx], Y[idx]
    if variant == "numpy_rng":
        x = x + torch.from_numpy(np.random.normal(0, 0.1, size=tuple(x.shape)).astype(np.float32))
    if variant == "python_rng":
        x = x * (1 + random.random())
    if variant == "counter":
        x = x * (1 + 0.1 * steps_done)
        steps_done += 1
    if variant == "nondeterministic":
        x = x + float(int.from_bytes(os.urandom(2), "little")) * 1e-6
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    if "scaler" in objects:
        objects["scaler"].scale(loss).backward()
        objects["scaler"].step(opt)
        objects["scaler"].update()
    else:
        loss.backward()
        opt.step()
    if "sched" in objects:
        objects["sched"].step()
    if variant == "param_groups":
        for group in opt.param_groups:
            group["lr"] *= 0.8
    return loss
