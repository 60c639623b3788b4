"""Recomputation planned on a module's traced graph: cut the forward where one tensor alone
crosses, measure each stage, and reverse the stages by Revolve within a memory budget.

The forward is traced into an FX graph (torch.fx.symbolic_trace). A point between two nodes
is a cut where exactly one value made before it is used after it (a residual connection keeps
the block's input alive, so a transformer stack cuts between blocks, an MLP between layers).
One run on an example input measures the tensor that crosses each cut and each stage's time;
the budget, in bytes of stage inputs held at once, gives Revolve its snapshots. The stages run
through the schedule executor of `checkpoint_sequential`, which replays the random stream
per stage, so gradients match plain backpropagation bit for bit, dropout included. With
`offload="cpu"` host memory is a second level: the multilevel schedule, given the measured
stage times and the time to copy a stage input, chooses which inputs to keep on the device,
which to copy to the host and which to recompute.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .multilevel import Level, multilevel
from .schedule import Schedule, revolve
from .torch_sequential import SlotStats, run_scheduled


@dataclass
class GraphPlan:
    """What checkpoint_graph chose: `stages` (count), the bytes of each stage's input as
    measured (`input_bytes`, the first being the module's input), each stage's forward seconds,
    `snapshots` (stage inputs held at most), and the stage forwards a training step runs in
    all (`forward_steps`: the forward sweep, the recomputations and each stage's forward under
    autograd in the backward sweep; plain backpropagation runs `stages`)."""

    stages: int
    input_bytes: list[int] = field(default_factory=list)
    stage_seconds: list[float] = field(default_factory=list)
    snapshots: int = 1
    forward_steps: int = 0
    memory_budget: int | None = None
    offload: str | None = None
    copy_seconds: float = 0.0
    """Measured time to copy one stage input to the offload level and back (offload only)."""
    schedule: Schedule | None = field(default=None, repr=False)


class GraphCheckpoint(torch.nn.Module):
    """`module` run as traced stages, Revolve-scheduled under autograd (plain forward
    otherwise); `plan` says how, `stats.peak_bytes` the most stage-input bytes a call held."""

    def __init__(self, module: torch.nn.Module, stages: list, plan: GraphPlan):
        super().__init__()
        self.module = module
        self._stages = stages  # not registered: they share the module's parameters
        self.plan = plan
        self.stats = SlotStats()

    def forward(self, x):
        if not torch.is_grad_enabled():
            return self.module(x)
        return run_scheduled(self._stages, x, self.plan.schedule, self.stats, self.plan.offload)


def checkpoint_graph(module: torch.nn.Module, example_input: torch.Tensor, memory_budget: int | None = None,
                     snapshots: int | None = None, offload: str | None = None) -> GraphCheckpoint:
    """`module` with its activations recomputed by an optimal schedule over its traced graph:
    at most `memory_budget` bytes of stage inputs held (or `snapshots` of them; default: one
    per stage, each stage's forward recomputed once under autograd, as checkpointing every
    stage). `offload="cpu"` adds host memory, unbounded, as a second level whose copies cost
    what they measure. Raises ValueError naming what cannot be traced or cut."""
    if memory_budget is not None and snapshots is not None:
        raise ValueError("give memory_budget or snapshots, not both")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    try:
        traced = fx.symbolic_trace(module)
    except Exception as e:  # torch.fx raises TraceError, TypeError or others from user code
        raise ValueError(f"checkpoint_graph cannot trace {type(module).__name__} with torch.fx: "
                         f"{type(e).__name__}: {e}. Data-dependent control flow must be moved out of "
                         "forward(), or the module split with checkpoint_sequential by hand") from e
    stages = _stages(traced)
    sizes, seconds = _measure(stages, example_input)
    stages, sizes, seconds = _merge_non_tensor_cuts(stages, sizes, seconds)
    n = len(stages)
    if memory_budget is not None:
        snapshots = _snapshots_within(sizes, memory_budget)
    snapshots = n if snapshots is None else max(1, min(int(snapshots), n))
    plan = GraphPlan(stages=n, input_bytes=sizes, stage_seconds=seconds, snapshots=snapshots,
                     memory_budget=memory_budget, offload=offload)
    if offload is None:
        plan.schedule = revolve(n, snapshots)
    else:
        plan.copy_seconds = _copy_seconds(example_input, offload)
        step = max(sum(seconds) / n, 1e-9)
        cost = plan.copy_seconds / 2 / step  # one way, in stage forwards
        plan.schedule = multilevel(n, [Level(slots=snapshots), Level(slots=None, write_cost=cost, read_cost=cost)],
                                   forward_cost=1.0, backward_cost=2.0)
    plan.forward_steps = plan.schedule.advances + 1 + n
    return GraphCheckpoint(module, stages, plan)


def _copy_seconds(x: torch.Tensor, host: str, repeats: int = 5) -> float:
    """The median time to copy `x` to `host` memory and back (a copy in place where it is there)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        if x.device.type == host:
            x.clone()
        else:
            x.to(host).to(x.device)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _snapshots_within(sizes: list[int], budget: int) -> int:
    """The most stage inputs that fit `budget` bytes whichever of them are held."""
    largest = sorted(sizes, reverse=True)
    if budget < largest[0]:
        raise ValueError(f"memory_budget {budget} bytes is below the largest stage input ({largest[0]} bytes); "
                         f"the least budget is {largest[0]}")
    held, count = 0, 0
    for size in largest:
        if held + size > budget:
            break
        held, count = held + size, count + 1
    return count


def _cuts(graph: fx.Graph) -> list[int]:
    """Indexes i of compute nodes after which only node i's value is still needed."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(f"checkpoint_graph needs a forward of one tensor input, this one takes "
                         f"{[p.name for p in placeholders]}")
    last_use = {}
    for n in graph.nodes:
        for arg in n.all_input_nodes:
            last_use[arg] = max(last_use.get(arg, -1), order[n])
    cuts = []
    for i, n in enumerate(nodes[:-1]):
        here = order[n]
        live = [m for m in last_use if m.op != "get_attr" and order[m] <= here < last_use[m]]
        if live == [n]:
            cuts.append(i)
    return cuts


def _stages(traced: fx.GraphModule) -> list[fx.GraphModule]:
    """The traced forward split at its cuts into modules of one input and one output each."""
    graph = traced.graph
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    output = next(n for n in graph.nodes if n.op == "output")
    if not compute:
        raise ValueError("checkpoint_graph found no operation in the module's forward")
    bounds = [0] + [i + 1 for i in _cuts(graph)] + [len(compute)]
    source = next(n for n in graph.nodes if n.op == "placeholder")
    stages = []
    for a, b in zip(bounds, bounds[1:]):
        g = fx.Graph()
        env = {source: g.placeholder("x")}

        def lookup(node, env=env, g=g):
            if node not in env and node.op == "get_attr":
                env[node] = g.node_copy(node, lambda m: env[m])
            return env[node]

        for node in compute[a:b]:
            env[node] = g.node_copy(node, lookup)
        g.output(env[compute[b - 1]] if b < len(compute) else fx.node.map_arg(output.args[0], lookup))
        stages.append(fx.GraphModule(traced, g))
        source = compute[b - 1]
    return stages


def _measure(stages: list, x) -> tuple[list[int], list[float]]:
    """Each stage's input bytes (None where not one tensor) and forward seconds, on `x`."""
    sizes, seconds = [], []
    state = x
    rng = torch.get_rng_state()
    with torch.no_grad():
        for stage in stages:
            sizes.append(state.nbytes if isinstance(state, torch.Tensor) else None)
            started = time.perf_counter()
            state = stage(state)
            seconds.append(time.perf_counter() - started)
    torch.set_rng_state(rng)
    return sizes, seconds


def _merge_non_tensor_cuts(stages, sizes, seconds):
    """Stages whose input is not a single tensor joined to the stage before them."""
    kept, kept_sizes, kept_seconds = [stages[0]], [sizes[0]], [seconds[0]]
    if sizes[0] is None:
        raise ValueError("checkpoint_graph needs a tensor input")
    for stage, size, sec in zip(stages[1:], sizes[1:], seconds[1:]):
        if size is None:
            kept[-1] = _Chain(kept[-1], stage)
            kept_seconds[-1] += sec
        else:
            kept.append(stage)
            kept_sizes.append(size)
            kept_seconds.append(sec)
    return kept, kept_sizes, kept_seconds


class _Chain(torch.nn.Module):
    """Two stages run one after the other (a cut whose value is not one tensor)."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))
