"""Test helpers shared by tests/passes and tests/runtime: plans of every schedule family, random
valid plans (hypothesis), and a LayerGraph for a model when `octopipe.passes.trace` is absent.

Plans come from `octopipe.schedules.build` when it exists; until then (and for placements it does
not offer) `greedy_plan` makes a valid order for any placement with a family's policy: a unit-time
list scheduler where each device picks, among its ready ops, backward before forward (1F1B-style,
with at most `max_in_flight` forwards waiting for their backward) or all forwards first (GPipe),
and W last (zero-bubble families defer W into idle slots).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from hypothesis import strategies as st

from octopipe.ir.plan import Op, OpKind, PipelinePlan
from octopipe.passes.lower import op_dependencies

# -- plans ----------------------------------------------------------------------------------------


def greedy_plan(
    num_devices: int,
    placement: Sequence[int],
    num_microbatches: int,
    *,
    split: bool = False,
    gpipe: bool = False,
    max_in_flight: int | None = None,
    links: set[tuple[int, int]] | None = None,
    layers_per_stage: Sequence[int] | None = None,
) -> PipelinePlan:
    num_stages = len(placement)
    links = links if links is not None else {(s, s + 1) for s in range(num_stages - 1)}
    producers = {s: sorted(p for p, c in links if c == s) for s in range(num_stages)}
    consumers = {s: sorted(c for p, c in links if p == s) for s in range(num_stages)}
    todo = [[] for _ in range(num_devices)]
    for m in range(num_microbatches):
        for s in range(num_stages):
            todo[placement[s]].append(Op(s, OpKind.F, m))
            todo[placement[s]].append(Op(s, OpKind.B, m))
            if split:
                todo[placement[s]].append(Op(s, OpKind.W, m))
    done: dict[Op, int] = {}
    free = [0] * num_devices
    orders: list[list[Op]] = [[] for _ in range(num_devices)]
    # microbatches started on a device (some F ran) whose backwards there are not all done
    started: list[dict[int, int]] = [{} for _ in range(num_devices)]
    stages_on = [sum(1 for p in placement if p == d) for d in range(num_devices)]
    limit = max_in_flight if max_in_flight is not None else 10**9
    time = 0
    idle_rounds = 0
    while any(todo):
        progressed = False
        for device in range(num_devices):
            if free[device] > time or not todo[device]:
                continue
            ready = [op for op in todo[device]
                     if all(dep in done and done[dep] <= time for dep in op_dependencies(op, producers, consumers))]
            if idle_rounds < 4 * (num_stages + 2):  # relax the in-flight limit only if stuck
                ready = [op for op in ready if op.kind is not OpKind.F or op.microbatch in started[device]
                         or sum(1 for left in started[device].values() if left) < limit]
            if not ready:
                continue

            def priority(op: Op) -> tuple[int, int, int]:
                if gpipe:
                    kind_rank = 0 if op.kind is OpKind.F else 1 if op.kind is OpKind.B else 2
                else:
                    kind_rank = {OpKind.B: 0, OpKind.F: 1, OpKind.W: 2}[op.kind]
                # earlier microbatches first; B drains later stages first
                return (kind_rank, op.microbatch, -op.stage if op.kind is not OpKind.F else op.stage)

            op = min(ready, key=priority)
            todo[device].remove(op)
            duration = 1 if op.kind is not OpKind.B or split else 2
            done[op] = free[device] = time + duration
            orders[device].append(op)
            progressed = True
            if op.kind is OpKind.F:
                started[device].setdefault(op.microbatch, stages_on[device])
            elif op.kind is OpKind.B:
                started[device][op.microbatch] -= 1
        idle_rounds = 0 if progressed else idle_rounds + 1
        time += 1
    sizes = layers_per_stage or [1] * num_stages
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    plan = PipelinePlan.build(num_microbatches, bounds, list(placement), orders, num_devices=num_devices)
    plan.validate()
    return plan


def v_placement(num_devices: int) -> list[int]:
    return [*range(num_devices), *reversed(range(num_devices))]


def family_plan(name: str, num_devices: int, num_microbatches: int, layers_per_stage: Sequence[int] | None = None) -> PipelinePlan:
    """A plan of schedule family `name` (hand-rolled with greedy_plan: placement and policy)."""
    d = num_devices
    if name == "gpipe":
        return greedy_plan(d, list(range(d)), num_microbatches, gpipe=True, layers_per_stage=layers_per_stage)
    if name == "1f1b":
        return greedy_plan(d, list(range(d)), num_microbatches, max_in_flight=d, layers_per_stage=layers_per_stage)
    if name == "interleaved-1f1b":
        return greedy_plan(d, [s % d for s in range(2 * d)], num_microbatches, max_in_flight=2 * d,
                           layers_per_stage=layers_per_stage)
    if name == "zb-h1":
        return greedy_plan(d, list(range(d)), num_microbatches, split=True, max_in_flight=d,
                           layers_per_stage=layers_per_stage)
    if name in ("zb-v", "dualpipe-v"):
        return greedy_plan(d, v_placement(d), num_microbatches, split=True,
                           max_in_flight=2 * d if name == "zb-v" else 2 * d + 1, layers_per_stage=layers_per_stage)
    if name == "irregular":
        # uneven stages per device, more stages than devices, a device with three stages
        placement = [0, 1, 1, *range(2, d), 0, 1]
        return greedy_plan(d, placement, num_microbatches, split=True, max_in_flight=3,
                           layers_per_stage=layers_per_stage)
    raise ValueError(name)


def schedule_plan(name: str, num_devices: int, num_microbatches: int, num_layers: int) -> PipelinePlan:
    """octopipe.schedules.build's plan when that module is present, else family_plan."""
    try:
        from octopipe import schedules  # noqa: F401
    except ImportError:
        schedules = None
    if schedules is not None and name != "irregular":
        from octopipe.cluster import ClusterSpec
        from octopipe.ir.costs import CostTable, LayerCost

        costs = CostTable([LayerCost(name=f"l{i}", kind="block", forward_ms=1.0, backward_ms=2.0, backward_weight_ms=1.0)
                           for i in range(num_layers)])
        cluster = ClusterSpec(num_devices=num_devices, backend="gloo")
        return schedules.build(name, costs, cluster, num_microbatches)
    stages = {"interleaved-1f1b": 2 * num_devices, "zb-v": 2 * num_devices, "dualpipe-v": 2 * num_devices}.get(name)
    if name == "irregular":
        stages = num_devices + 3
    stages = stages or num_devices
    sizes = [num_layers // stages + (1 if i < num_layers % stages else 0) for i in range(stages)]
    if min(sizes) < 1:
        raise ValueError(f"{num_layers} layers cannot make {stages} stages")
    return family_plan(name, num_devices, num_microbatches, layers_per_stage=sizes)


FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "irregular")


def random_plan(rng: random.Random, num_devices: int, num_stages: int, num_microbatches: int,
                skip_links: int = 0, num_layers: int | None = None) -> tuple[PipelinePlan, set[tuple[int, int]]]:
    """A random valid plan: random placement (every device gets a stage when it can), random W
    split, random extra skip links, and a random topological order of the plan DAG projected onto
    the devices (so the per-device orders are feasible)."""
    placement = [rng.randrange(num_devices) for _ in range(num_stages)]
    for device in range(min(num_devices, num_stages)):
        if device not in placement:
            placement[rng.randrange(num_stages)] = device
    used = sorted(set(placement))
    renumber = {d: i for i, d in enumerate(used)}
    placement = [renumber[d] for d in placement]
    num_devices = len(used)
    links = {(s, s + 1) for s in range(num_stages - 1)}
    for _ in range(skip_links):
        if num_stages >= 3:
            p = rng.randrange(num_stages - 2)
            links.add((p, rng.randrange(p + 2, num_stages)))
    producers = {s: sorted(p for p, c in links if c == s) for s in range(num_stages)}
    consumers = {s: sorted(c for p, c in links if p == s) for s in range(num_stages)}
    split = frozenset((s, m) for s in range(num_stages) for m in range(num_microbatches) if rng.random() < 0.5)
    ops = [Op(s, k, m) for s in range(num_stages) for m in range(num_microbatches) for k in (OpKind.F, OpKind.B)]
    ops += [Op(s, OpKind.W, m) for s, m in split]
    remaining = set(ops)
    done: set[Op] = set()
    orders: list[list[Op]] = [[] for _ in range(num_devices)]
    while remaining:
        ready = sorted(op for op in remaining if all(d in done for d in op_dependencies(op, producers, consumers)))
        op = rng.choice(ready)
        remaining.discard(op)
        done.add(op)
        orders[placement[op.stage]].append(op)
    bounds = list(range(num_stages + 1))
    if num_layers is not None:  # random contiguous partition of num_layers >= num_stages layers
        bounds = [0, *sorted(rng.sample(range(1, num_layers), num_stages - 1)), num_layers]
    plan = PipelinePlan.build(num_microbatches, bounds, placement, orders, num_devices=num_devices)
    plan.validate()
    return plan, links


@st.composite
def random_plans(draw: Callable, max_devices: int = 4, max_stages: int = 7, max_microbatches: int = 4):
    seed = draw(st.integers(0, 2**32 - 1))
    num_devices = draw(st.integers(1, max_devices))
    num_stages = draw(st.integers(1, max_stages))
    num_microbatches = draw(st.integers(1, max_microbatches))
    skips = draw(st.integers(0, 2))
    return random_plan(random.Random(seed), num_devices, num_stages, num_microbatches, skips)


# -- layer graphs ---------------------------------------------------------------------------------


def layer_graph(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None = None,
                example_target: torch.Tensor | None = None):
    """`octopipe.passes.trace.trace` when present, else `fallback_layer_graph`."""
    try:
        from octopipe.passes.trace import trace
    except ImportError:
        return fallback_layer_graph(model, loss_fn)
    return trace(model, example_inputs, loss_fn=loss_fn, example_target=example_target)


def fallback_layer_graph(model: torch.nn.Module, loss_fn: Callable | None = None):
    import torch.fx as fx

    from octopipe.ir.graph import Layer, LayerGraph

    graph_module = fx.symbolic_trace(model)
    graph = graph_module.graph
    if loss_fn is not None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_after(placeholders[-1]):
            target = graph.placeholder("target")
        with graph.inserting_before(output):
            loss = graph.call_function(loss_fn, (output.args[0], target))
        output.args = (loss,)
        graph_module.recompile()
    module_lists = {name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}

    def layer_key(path: str) -> str:
        parts = path.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in module_lists:
                return ".".join(parts[: i + 1])
        return parts[0]

    keys: list[str] = []
    nodes_of: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if loss_fn is not None and node.op == "call_function" and node.target is loss_fn:
            key = "loss"
        elif node.op in ("call_module", "get_attr"):
            key = layer_key(str(node.target))
        else:
            stack = node.meta.get("nn_module_stack") or {}
            paths = [path for path, _ in stack.values()] if stack else []
            if not paths:
                continue  # unassigned: codegen puts it with its first reader
            key = layer_key(paths[-1]) if paths[-1] else layer_key(paths[0])
        if key not in nodes_of:
            keys.append(key)
            nodes_of[key] = []
        nodes_of[key].append(node.name)
    layers = tuple(Layer(i, key, "loss" if key == "loss" else "block", nodes=tuple(nodes_of[key]))
                   for i, key in enumerate(keys))
    inputs = tuple(n.name for n in graph.nodes if n.op == "placeholder")
    return LayerGraph(type(model).__name__, inputs, layers, module=graph_module)


# -- pipelines for runtime tests ------------------------------------------------------------------


class Case:
    """Everything one rank needs to run a model under a plan, and what the reference needs."""

    def __init__(self, model, inputs, target, graph, plan, stages, programs, links, tied):
        self.model, self.inputs, self.target, self.graph = model, inputs, target, graph
        self.plan, self.stages, self.programs, self.links, self.tied = plan, stages, programs, links, tied

    def engine(self, rank: int, **kwargs):
        from octopipe.passes.codegen import stages_on
        from octopipe.runtime import Engine

        return Engine(rank, self.plan.num_devices, stages_on(self.stages, self.plan, rank), self.programs[rank],
                      self.plan.num_microbatches, **kwargs)


def build_model(name: str, seed: int = 0, batch_size: int = 4, **overrides):
    from octopipe import models

    torch.manual_seed(seed)
    if name == "skipnet":
        model = SkipNet(**overrides)
        generator = torch.Generator().manual_seed(1)
        inputs = (torch.randn(batch_size, 6, model.width, generator=generator),)
        target = torch.randn(batch_size, 6, model.width, generator=generator)
        return model, inputs, target, mse_loss
    model = models.build(name, **overrides)
    return (model, models.example_inputs(name, batch_size=batch_size, **overrides),
            models.example_target(name, batch_size=batch_size, **overrides), models.lm_loss)


def replica_token_batches(replicas: int, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Tokens and targets (ids < 64, the tiny models' vocabularies hold them) for `replicas`
    data-parallel replicas, 4 sequences of 8 each: (tokens per replica, targets per replica)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (replicas * 4, 8), generator=generator)
    target = torch.randint(0, 64, (replicas * 4, 8), generator=generator)
    return tokens.chunk(replicas), target.chunk(replicas)


_TRACED: dict = {}


def make_case(name: str, plan_or_family, num_devices: int, num_microbatches: int, *, batch_size: int = 4,
              seed: int = 0, compile: bool = False, cache: bool = False, **overrides) -> Case:
    """Model, trace, plan, codegen, lower, verify. `cache=True` reuses this process's traced model
    (gradients cleared): for workers that only measure gradients, never for training."""
    from octopipe.passes.codegen import codegen, links_of, tied_parameters
    from octopipe.passes.lower import lower
    from octopipe.passes.verify import verify

    key = (name, seed, batch_size, tuple(sorted(overrides.items())))
    if cache and key in _TRACED:
        model, inputs, target, loss_fn, graph = _TRACED[key]
        model.zero_grad(set_to_none=True)
    else:
        model, inputs, target, loss_fn = build_model(name, seed, batch_size, **overrides)
        graph = layer_graph(model, inputs, loss_fn, target)
        if cache:
            _TRACED[key] = (model, inputs, target, loss_fn, graph)
    if isinstance(plan_or_family, PipelinePlan):
        plan = plan_or_family
    elif callable(plan_or_family):
        plan = plan_or_family(graph, model, inputs, target)
    else:
        plan = schedule_plan(plan_or_family, num_devices, num_microbatches, len(graph.layers))
    stages = codegen(graph, plan, inputs, target, model=model, compile=compile)
    links = links_of(stages)
    tied = tied_parameters(stages, plan)
    programs = lower(plan, links, tied)
    verify(programs, plan, links)
    return Case(model, inputs, target, graph, plan, stages, programs, links, tied)


def reference(name: str, seed: int = 0, batch_size: int = 4, steps: int = 1, lr: float = 1e-2, **overrides):
    """Single-process training of the same model on the same batch: (losses, grads of the last
    step, parameters after `steps` AdamW steps if steps > 1)."""
    model, inputs, target, loss_fn = build_model(name, seed, batch_size, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for _ in range(steps):
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if steps > 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def assert_grads_close(actual: dict, expected: dict, what: str = "") -> None:
    """Every parameter gradient within 1e-5 of the largest gradient (fp32 summation order only)."""
    scale = max(g.abs().max().item() for g in expected.values())
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


class SkipNet(torch.nn.Module):
    """A chain of small blocks where every third block also reads the output two blocks back (skip
    tensors that cross stages) and the first and last layers share a weight (tied)."""

    def __init__(self, num_blocks: int = 6, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.Tanh(), torch.nn.Linear(2 * width, width))
            for _ in range(num_blocks))
        self.head = torch.nn.Linear(width, width, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        history = [hidden]
        for index, block in enumerate(self.blocks):
            hidden = block(hidden)
            if index % 3 == 2:
                hidden = hidden + history[-2]
            history.append(hidden)
        return self.head(hidden)
