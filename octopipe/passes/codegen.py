"""codegen: LayerGraph + plan partition -> one StageModule (fx GraphModule) per stage.

Consumes the traced LayerGraph (its `module` and each layer's fx node names), the plan's stage layer
ranges and one example batch; produces `runtime.stage.StageModule`s, the contract the runtime runs:

- placeholders for what the stage reads: batch tensors (model inputs, and the target when the graph
  ends in a loss; present on every rank, never sent) and outputs of earlier stages;
- the stage's nodes, copied in graph order; parameters and buffers keep their original qualified
  names (`fx.GraphModule(root, graph)` with the traced module as root: named_parameters() match
  the model, and stages in one process share the parameter objects);
- an output tuple of the tensors later stages read (the loss stage: `(loss,)`);
- the plan's per-stage `recompute` flag, which the engine acts on (codegen emits the same module).

Node placement: a node belongs to its layer's stage; `get_attr` nodes are copied into every stage
that reads them (never sent); other nodes in no layer go to the earliest stage that reads them.
Values that cross stages must be tensors; non-tensor values (shapes, sizes) are baked into the
reading stage as constants, valid because every microbatch has the same shape. Per-microbatch
shapes come from running one microbatch (the example batch cut along dim 0 into num_microbatches
equal parts) through the traced module.

Options: `split_backward` rewrites stages with `passes/split_backward.py` (None, the default: the
stages that have W ops in the plan; True: all; False: none); `compile=True` wraps each stage with torch.compile (Inductor:
Triton kernels on GPU, C++ on CPU, slow to compile there).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from octopipe.errors import ArgumentError, OctopipeWarning, PlanError, TraceError
from octopipe.ir.graph import LayerGraph
from octopipe.ir.plan import PipelinePlan
from octopipe.passes.split_backward import split_backward as split_backward_pass
from octopipe.runtime import amp
from octopipe.runtime.stage import BATCH, StageModule, TensorSource, TensorSpec, stage_links

NAME = "codegen"

_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout,
                   slice, type(Ellipsis))


def microbatch(batch: Sequence[Tensor], num_microbatches: int, index: int = 0) -> tuple[Tensor, ...]:
    """Microbatch `index` of a batch: each tensor cut along dim 0 into equal parts."""
    out = []
    for position, tensor in enumerate(batch):
        if not isinstance(tensor, Tensor) or tensor.dim() == 0:
            raise ArgumentError(f"batch tensor {position} is {_described(tensor)}: every input (and the target) is "
                                "one batch cut along dim 0 into microbatches; make a scalar or constant a buffer or "
                                "an attribute of the model instead")
        size = tensor.shape[0]
        if size % num_microbatches:
            raise ArgumentError(f"batch tensor {position} has {size} rows along dim 0, not divisible into "
                                f"{num_microbatches} equal microbatches; use a batch size that is a multiple of it")
        part = size // num_microbatches
        out.append(tensor.narrow(0, index * part, part))
    return tuple(out)


def _described(value: Any) -> str:
    return "a 0-d tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}, not a tensor"


def _as_constant(value: Any, where: str) -> Any:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_as_constant(v, where) for v in value)
    if isinstance(value, _CONSTANT_TYPES):
        return value
    raise PlanError(f"{where} crosses a stage boundary but is a {type(value).__name__}, neither a tensor nor a "
                    "constant; move the boundary so the value's producer and readers share a stage")


def _with_loss(graph: LayerGraph, loss_fn: Callable[..., Tensor]) -> tuple[fx.GraphModule, dict[str, int]]:
    """A copy of the traced module whose output is loss_fn(output, target); the loss node joins the
    last layer."""
    module = graph.module
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output_value: Any = None
    last_placeholder = None
    for node in module.graph.nodes:
        if node.op == "output":
            output_value = fx.map_arg(node.args[0], lambda n: env[n])
            continue
        env[node] = new_graph.node_copy(node, lambda n: env[n])
        if node.op == "placeholder":
            last_placeholder = env[node]
    assert last_placeholder is not None
    with new_graph.inserting_after(last_placeholder):
        target = new_graph.placeholder("target")
    loss = new_graph.call_function(loss_fn, (output_value, target))
    new_graph.output(loss)
    layer_of = graph.layer_of_node()
    layer_of[loss.name] = len(graph.layers) - 1
    return fx.GraphModule(module, new_graph), layer_of


def _canonical_names(root: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, tensor in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def _owners(root: nn.Module) -> dict[int, nn.Module]:
    """id(tensor) -> the first module of `root` that holds it directly."""
    owners: dict[int, nn.Module] = {}
    for module in root.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                owners.setdefault(id(tensor), module)
    return owners


def _fake_device(kind: str) -> tuple[Any, torch.device]:
    """A FakeTensorMode and the device its tensors claim: `kind`, or the CPU where this machine has
    no such device (autocast would switch itself off on it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if kind == "cuda" and not torch.cuda.is_available():
        kind = "cpu"
    return FakeTensorMode(), torch.device(kind)


def _fake_run(module: fx.GraphModule, inputs: Sequence[Any], mode: Any, device: torch.device,
              run: Callable[..., Any]) -> Any:
    """`run(module, *inputs)` with every parameter, buffer and input tensor replaced by a fake
    tensor on `device` (same shape, dtype and requires_grad; no data), in `mode`."""

    class Runner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *args: Any) -> Any:
            return run(self.inner, *args)

    def fake(tensor: Tensor) -> Tensor:
        copy = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
        return copy.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else copy

    with mode:
        state = {f"inner.{name}": fake(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        args = [fake(t) if isinstance(t, Tensor) else t for t in inputs]
        return torch.func.functional_call(Runner(), state, tuple(args))


def codegen(
    graph: LayerGraph,
    plan: PipelinePlan,
    example_inputs: Sequence[Tensor],
    example_target: Tensor | None = None,
    *,
    num_microbatches: int | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    model: nn.Module | None = None,
    split_backward: bool | None = None,
    compile: bool = False,
    autocast: torch.dtype | None = None,
    run_device: str | None = None,
) -> tuple[StageModule, ...]:
    """One StageModule per plan stage. `example_inputs` (+ `example_target` when the graph ends in
    a loss) is one full batch; `loss_fn` appends a loss when the graph has none; `model` (the
    original nn.Module) names tied parameters as the model does (default: the traced module).
    `autocast` (torch.bfloat16 or None): the example microbatch runs under torch.autocast, so the
    cross-stage tensors' specs have the dtypes the engines' autocast forwards will send; autocast
    casts by device type, so where the engines run on another one (`run_device`: "cuda" for an
    NCCL cluster) or the model is on the meta device, that run is on fake tensors of the engines'
    device type (`_fake_run`; CPU where this machine has no such device)."""
    if graph.module is None:
        raise TraceError("codegen needs LayerGraph.module (the traced GraphModule); a parsed graph has none")
    num_microbatches = num_microbatches or plan.num_microbatches
    if plan.num_layers != len(graph.layers):
        raise PlanError(f"plan covers {plan.num_layers} layers but the graph has {len(graph.layers)}")
    module: fx.GraphModule = graph.module
    layer_of = graph.layer_of_node()
    has_loss = bool(graph.layers) and graph.layers[-1].kind == "loss"
    if loss_fn is not None and not has_loss:
        module, layer_of = _with_loss(graph, loss_fn)
        has_loss = True
    batch = tuple(example_inputs) + ((example_target,) if has_loss and example_target is not None else ())
    nodes = list(module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(batch):
        raise TraceError(f"the traced graph takes {len(placeholders)} inputs ({[n.name for n in placeholders]}) but "
                         f"{len(batch)} example tensors were given (inputs, plus the target when there is a loss)")

    # -- values of one microbatch ------------------------------------------------------------------
    values: dict[fx.Node, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            result = super().run_node(node)
            values[node] = result
            return result

    first = microbatch(batch, num_microbatches)
    device = next((t.device for t in [*module.parameters(), *first] if isinstance(t, Tensor)), torch.device("cpu"))
    fake_mode = None
    if autocast is not None and (device.type == "meta" or (run_device or device.type) != device.type):
        fake_mode, device = _fake_device(run_device or "cpu")
    with torch.enable_grad(), amp.autocast(autocast, device):
        try:
            if fake_mode is None:
                _Recorder(module).run(*first)
            else:
                _fake_run(module, first, fake_mode, device, lambda gm, *args: _Recorder(gm).run(*args))
        except Exception as exc:  # noqa: BLE001 - the model's own ops on one microbatch: say why they may fail
            raise TraceError(
                f"running one microbatch (every input cut along dim 0 into {num_microbatches}) failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0]}. Every input must carry the batch in dim 0 (an input "
                "without one, like a [features] mask, would be cut too: fold it into the model as a buffer), and "
                "loss_fn must not hold batch-sized tensors of its own (pass them as inputs or in the target)"
            ) from exc

    # -- node -> stage ------------------------------------------------------------------------------
    stage_of_layer: dict[int, int] = {}
    for plan_stage in plan.stages:
        for layer in range(plan_stage.layer_start, plan_stage.layer_end):
            stage_of_layer[layer] = plan_stage.index
    stage_of: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.name in layer_of:
            stage_of[node] = stage_of_layer[layer_of[node.name]]
        else:
            readers = [stage_of[u] for u in node.users if u in stage_of]
            if readers:
                stage_of[node] = min(readers)
            elif any(u.op == "output" for u in node.users):
                stage_of[node] = plan.num_stages - 1
    output_node = nodes[-1]
    final = output_node.args[0]
    if isinstance(final, (tuple, list)) and len(final) == 1:
        final = final[0]
    if not isinstance(final, fx.Node) or not isinstance(values.get(final), Tensor):
        raise TraceError("the traced graph must return one tensor (the loss); pass loss_fn to codegen or trace")
    last_stage = plan.num_stages - 1
    if stage_of.get(final) != last_stage:
        raise PlanError(f"the graph's output {final.name} is computed in stage {stage_of.get(final)}, not the last stage")
    for node, stage in stage_of.items():
        for arg in node.all_input_nodes:
            if arg in stage_of and stage_of[arg] > stage:
                raise PlanError(f"node {node.name} (stage {stage}) reads {arg.name} from a later stage {stage_of[arg]}; "
                                "layers must be in topological order")

    # -- cross-stage tensors: outputs (producer side) -----------------------------------------------
    consumers: dict[fx.Node, set[int]] = {}
    for node, stage in stage_of.items():
        for arg in node.all_input_nodes:
            if arg in stage_of and stage_of[arg] < stage and isinstance(values.get(arg), Tensor):
                consumers.setdefault(arg, set()).add(stage)
    outputs_of: dict[int, list[fx.Node]] = {s: [] for s in range(plan.num_stages)}
    for node in nodes:
        if node in consumers:
            outputs_of[stage_of[node]].append(node)

    # a crossing tensor carries a gradient only if the loss reaches it through differentiable ops
    # (one that a later stage only reads detached gets none, as in plain backward: its producer's
    # parameters keep grad None, not a zero gradient)
    crossing = [n for n in consumers if values[n].requires_grad]
    no_gradient: set[fx.Node] = set()
    if crossing and values[final].requires_grad:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            grads = torch.autograd.grad(values[final], [values[n] for n in crossing], allow_unused=True)
        no_gradient = {n for n, g in zip(crossing, grads) if g is None}

    def spec(node: fx.Node, readers: tuple[int, ...] = ()) -> TensorSpec:
        value = values[node]
        return TensorSpec(node.name, tuple(value.shape), value.dtype, bool(value.requires_grad) and node not in no_gradient,
                          readers)

    output_specs = {s: tuple(spec(n, tuple(sorted(consumers[n]))) for n in outputs_of[s]) for s in outputs_of}
    output_index = {n: j for s in outputs_of for j, n in enumerate(outputs_of[s])}
    canonical = _canonical_names(model if model is not None else module)
    owner_of = _owners(model if model is not None else module)
    persistent = set((model if model is not None else module).state_dict(keep_vars=True))
    split_stages = {s for s, _ in plan.split_backward()} if split_backward is None else (
        set(range(plan.num_stages)) if split_backward else set())

    stages: list[StageModule] = []
    for stage in range(plan.num_stages):
        own = [n for n in nodes if stage_of.get(n) == stage]
        new_graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        sources: dict[fx.Node, TensorSource] = {}
        for node in own:
            for arg in node.all_input_nodes:
                if arg.op == "placeholder":
                    sources.setdefault(arg, TensorSource(BATCH, placeholders.index(arg), spec(arg)))
                elif arg in stage_of and stage_of[arg] != stage and isinstance(values.get(arg), Tensor):
                    producer = stage_of[arg]
                    sources.setdefault(arg, TensorSource(producer, output_index[arg], output_specs[producer][output_index[arg]]))
        ordered = sorted(sources.items(), key=lambda item: (item[1].stage, item[1].index))
        for node, _ in ordered:
            env[node] = new_graph.placeholder(node.name)

        def transform(arg: fx.Node, stage: int = stage, env: dict[fx.Node, Any] = env, new_graph: fx.Graph = new_graph) -> Any:
            if arg in env:
                return env[arg]
            if arg.op == "get_attr":
                env[arg] = new_graph.get_attr(str(arg.target))
                return env[arg]
            return _as_constant(values[arg], f"value {arg.name} of stage {stage_of.get(arg)} read by stage {stage}")

        for node in own:
            env[node] = new_graph.node_copy(node, transform)
        if stage == last_stage:
            new_graph.output((env[final],))
            outputs: tuple[TensorSpec, ...] = (spec(final),)
        else:
            new_graph.output(tuple(env[n] for n in outputs_of[stage]))
            outputs = output_specs[stage]
        graph_module = fx.GraphModule(module, new_graph, class_name=f"Stage{stage}")
        stage_module: nn.Module = graph_module
        if stage in split_stages:
            stage_module, _ = split_backward_pass(graph_module, compile_safe=compile)
        names = {}
        for local, tensor in [*stage_module.named_parameters(remove_duplicate=False),
                              *stage_module.named_buffers(remove_duplicate=False)]:
            original = canonical.get(id(tensor), local)
            if original != local:
                names[local] = original
        for local, tensor in stage_module.named_buffers(remove_duplicate=False):
            if canonical.get(id(tensor), local) not in persistent:
                # GraphModule registers copied buffers as persistent; keep the model's choice
                owner, _, attr = local.rpartition(".")
                (stage_module.get_submodule(owner) if owner else stage_module)._non_persistent_buffers_set.add(attr)
        owners = {id(owner_of[id(t)]): owner_of[id(t)] for t in [*stage_module.parameters(), *stage_module.buffers()]
                  if id(t) in owner_of}
        stages.append(StageModule(stage, stage_module, tuple(src for _, src in ordered), outputs,
                                  is_loss=stage == last_stage, parameter_names=names, owners=tuple(owners.values()),
                                  recompute=plan.stages[stage].recompute, selective=plan.stages[stage].selective,
                                  compiled=compile))
    if model is not None:
        _hold_unused(stages, model, persistent, owner_of)
    return tuple(stages)


UNUSED = "_octopipe_unused"
"""The submodule of stage 0's module that holds the model's tensors its forward never reads."""


def _hold_unused(stages: list[StageModule], model: nn.Module, persistent: set[str],
                 owner_of: dict[int, nn.Module]) -> None:
    """Give the first stage the parameters and persistent buffers of `model` that no stage reads
    (a submodule the forward never calls): held nowhere, they would be missing from every rank's
    state dict, so a checkpoint would lose them and an `init` checkpoint could not fill them. The
    first stage's rank holds them (the same objects, named as the model names them); the forward
    never reads them, so they get no gradient, as in the plain model. Warns, naming them."""
    held = {id(t) for stage in stages for t in [*stage.module.parameters(), *stage.module.buffers()]}
    parameters = [(name, p) for name, p in model.named_parameters() if id(p) not in held]
    buffers = [(name, b) for name, b in model.named_buffers() if id(b) not in held and name in persistent]
    if not parameters and not buffers:
        return
    first = stages[0]
    holder = nn.Module()
    names = dict(first.parameter_names)
    owners = {id(owner): owner for owner in first.owners}
    for index, (name, parameter) in enumerate(parameters):  # (numbered: no two names can meet)
        holder.register_parameter(f"p{index}", parameter)
        names[f"{UNUSED}.p{index}"] = name
    for index, (name, buffer) in enumerate(buffers):
        holder.register_buffer(f"b{index}", buffer)
        names[f"{UNUSED}.b{index}"] = name
    unused = [*parameters, *buffers]
    for _, tensor in unused:
        owner = owner_of.get(id(tensor))
        if owner is not None:
            owners.setdefault(id(owner), owner)
    first.module.add_module(UNUSED, holder)
    first.parameter_names = names
    first.owners = tuple(owners.values())
    size = sum(tensor.numel() * tensor.element_size() for _, tensor in unused)
    shown = ", ".join(name for name, _ in unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    warnings.warn(
        f"codegen: the forward never reads {len(unused)} of the model's tensors ({shown}; {size / 2**20:.2f} MiB): "
        "stage 0's rank holds them so that checkpoints keep them; they get no gradient, as in the plain model. "
        "Delete the submodules the forward does not call to free that memory", OctopipeWarning, stacklevel=3)


def tied_parameters(stages: Sequence[StageModule], plan: PipelinePlan) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Parameters (original names) held by stages on two or more ranks, with those ranks: the
    `tied` argument of `lower()`."""
    ranks: dict[str, set[int]] = {}
    for stage in stages:
        for name, _ in stage.named_parameters():
            ranks.setdefault(name, set()).add(plan.stages[stage.index].device)
    return tuple((name, tuple(sorted(r))) for name, r in sorted(ranks.items()) if len(r) > 1)


def links_of(stages: Sequence[StageModule]) -> frozenset[tuple[int, int]]:
    """The `links` argument of `lower()`: which stages exchange tensors."""
    return stage_links(stages)


def stages_on(stages: Sequence[StageModule], plan: PipelinePlan, rank: int) -> list[StageModule]:
    """The stages a rank runs (the `stages` argument of the runtime Engine)."""
    return [stage for stage in stages if plan.stages[stage.index].device == rank]
