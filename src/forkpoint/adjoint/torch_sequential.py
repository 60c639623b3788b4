"""Memory-bounded backpropagation through a sequence of modules, driven by Revolve.

A drop-in for `torch.utils.checkpoint.checkpoint_sequential`: the forward pass keeps at
most `snapshots` intermediate inputs (the input included) and the backward pass recomputes
the rest along the optimal binomial schedule. The CPU random state is replayed per step,
so modules such as dropout see the same masks and gradients match plain backprop.
"""

from dataclasses import dataclass

import torch

from .schedule import ADJOINT, ADVANCE, END_FORWARD, FREE, RESTORE, TAKE, revolve


@dataclass
class SlotStats:
    """The most bytes of stored states held at once by the calls given this record."""

    peak_bytes: int = 0

    def held(self, slots: dict) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for t in slots.values()))


def _run(modules, rng_states, state, a, b):
    for j in range(a, b):
        torch.set_rng_state(rng_states[j])
        state = modules[j](state)
    return state


class _RevolveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, modules, snapshots, stats, x, *params):
        sched = revolve(len(modules), snapshots)
        actions = list(sched)
        rng_states, slots, state = [], {}, x.detach()
        with torch.no_grad():
            pos = 0
            while actions[pos].kind != END_FORWARD:
                act = actions[pos]
                if act.kind == TAKE:
                    slots[act.a] = state
                    if stats is not None:
                        stats.held(slots)
                elif act.kind == ADVANCE:
                    for j in range(act.a, act.b):
                        rng_states.append(torch.get_rng_state())
                        state = modules[j](state)
                pos += 1
            rng_states.append(torch.get_rng_state())
            out = modules[-1](state)
        ctx.modules, ctx.actions, ctx.pos, ctx.slots, ctx.last = modules, actions, pos, slots, state
        ctx.stats = stats
        ctx.rng_states = rng_states
        ctx.counts = [sum(1 for _ in m.parameters()) for m in modules]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        modules, slots, rng = ctx.modules, ctx.slots, ctx.rng_states
        offsets = [0]
        for n in ctx.counts:
            offsets.append(offsets[-1] + n)
        param_grads = [None] * offsets[-1]
        state, grad = ctx.last, grad_out
        ctx.last = None
        resume = torch.get_rng_state()
        for act in ctx.actions[ctx.pos + 1:]:
            if act.kind == RESTORE:
                state = slots[act.a]
            elif act.kind == TAKE:
                slots[act.a] = state
                if ctx.stats is not None:
                    ctx.stats.held(slots)
            elif act.kind == FREE:
                slots.pop(act.a, None)
            elif act.kind == ADVANCE:
                with torch.no_grad():
                    state = _run(modules, rng, state, act.a, act.b)
            elif act.kind == ADJOINT:
                i = act.a
                params = list(modules[i].parameters())
                with torch.enable_grad():
                    xi = state.detach().requires_grad_(True)
                    torch.set_rng_state(rng[i])
                    yi = modules[i](xi)
                    grads = torch.autograd.grad(yi, [xi] + params, grad, allow_unused=True)
                grad = grads[0]
                param_grads[offsets[i]:offsets[i + 1]] = grads[1:]
                state = None
        torch.set_rng_state(resume)
        return (None, None, None, grad, *param_grads)


def checkpoint_sequential(functions, input, snapshots: int, stats: SlotStats | None = None):
    """Run `functions` (an nn.Sequential or list of modules) on `input`, keeping at most
    `snapshots` stored states and recomputing the rest on backward (Revolve); `stats`, where
    given, records the most bytes of states held."""
    modules = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if not modules:
        raise ValueError("checkpoint_sequential needs at least one module")
    params = [p for m in modules for p in m.parameters()]
    return _RevolveFunction.apply(modules, snapshots, stats, input, *params)
