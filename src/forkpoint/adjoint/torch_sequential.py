"""Memory-bounded backpropagation through a sequence of modules, driven by a schedule.

A drop-in for `torch.utils.checkpoint.checkpoint_sequential`: the forward pass keeps at
most `snapshots` intermediate inputs (the input included) and the backward pass recomputes
the rest along the optimal binomial schedule (Revolve). A multilevel schedule keeps some
states on a second level, host memory (`offload`), and copies them back when restored. The
CPU random state is replayed per step, so modules such as dropout see the same masks and
gradients match plain backprop.
"""

from dataclasses import dataclass, field

import torch

from .schedule import ADJOINT, ADVANCE, END_FORWARD, FREE, RESTORE, TAKE, Schedule, revolve


@dataclass
class SlotStats:
    """The most bytes of stored states held at once on each level (0: the module's device,
    1: host memory) by the calls given this record; `peak_bytes` is level 0's."""

    peak: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.peak.get(0, 0)

    def held(self, slots: dict) -> None:
        for level in {lv for _, lv in slots}:
            held = sum(t.nbytes for (_, lv), t in slots.items() if lv == level)
            self.peak[level] = max(self.peak.get(level, 0), held)


class _Slots(dict):
    """States held by (step, level); level 1 lives in host memory and is copied back on restore."""

    def __init__(self, stats: SlotStats | None, host: str | None):
        super().__init__()
        self.stats, self.host = stats, host

    def take(self, step: int, level: int, state) -> None:
        if level > 0 and self.host is not None and state.device.type != self.host:
            state = _pinned_copy(state) if state.is_cuda else state.to(self.host)
        self[(step, level)] = state
        if self.stats is not None:
            self.stats.held(self)

    def restore(self, step: int, level: int, device):
        state = self[(step, level)]
        return state.to(device, non_blocking=True) if state.device != device else state


def _pinned_copy(state):
    out = torch.empty(state.shape, dtype=state.dtype, pin_memory=True)
    out.copy_(state, non_blocking=True)
    return out


def _run(modules, rng_states, state, a, b):
    for j in range(a, b):
        torch.set_rng_state(rng_states[j])
        state = modules[j](state)
    return state


class _ScheduledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, modules, schedule, stats, host, x, *params):
        actions = list(schedule)
        rng_states, slots, state = [], _Slots(stats, host), x.detach()
        with torch.no_grad():
            pos = 0
            while actions[pos].kind != END_FORWARD:
                act = actions[pos]
                if act.kind == TAKE:
                    slots.take(act.a, act.level, state)
                elif act.kind == ADVANCE:
                    for j in range(act.a, act.b):
                        rng_states.append(torch.get_rng_state())
                        state = modules[j](state)
                pos += 1
            rng_states.append(torch.get_rng_state())
            out = modules[-1](state)
        ctx.modules, ctx.actions, ctx.pos, ctx.slots, ctx.last = modules, actions, pos, slots, state
        ctx.rng_states, ctx.device = rng_states, x.device
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
                state = slots.restore(act.a, act.level, ctx.device)
            elif act.kind == TAKE:
                slots.take(act.a, act.level, state)
            elif act.kind == FREE:
                slots.pop((act.a, act.level), None)
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
        return (None, None, None, None, grad, *param_grads)


def run_scheduled(modules: list, input, schedule: Schedule, stats: SlotStats | None = None,
                  host: str | None = None):
    """Run `modules` on `input` along `schedule` (Revolve or multilevel); states it takes at
    level 1 are kept on `host` memory (None: where they are)."""
    params = [p for m in modules for p in m.parameters()]
    return _ScheduledFunction.apply(modules, schedule, stats, host, input, *params)


def checkpoint_sequential(functions, input, snapshots: int, stats: SlotStats | None = None):
    """Run `functions` (an nn.Sequential or list of modules) on `input`, keeping at most
    `snapshots` stored states and recomputing the rest on backward (Revolve); `stats`, where
    given, records the most bytes of states held."""
    modules = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if not modules:
        raise ValueError("checkpoint_sequential needs at least one module")
    return run_scheduled(modules, input, revolve(len(modules), snapshots), stats)
