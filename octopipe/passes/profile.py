"""profile: LayerGraph + one example batch -> CostTable measured on the model's device, the pass `profile`.

Consumes a traced LayerGraph and the batch it was traced with (plus the target when the graph
ends in a loss); produces a CostTable with measured `forward_ms`, `backward_ms` (input plus
weight gradient) and `backward_weight_ms` per layer, and byte counts from the real tensors.

How. The whole graph runs once (no autograd) to capture every tensor that crosses a layer
boundary. Each layer is then cut out as its own GraphModule (its nodes, placeholders for the
tensors it reads from other layers and model inputs, outputs for the tensors later layers read)
and run alone on the captured inputs, so layers are timed separately:
- F: the layer's forward with autograd recording (as in training);
- B+W: `torch.autograd.grad(outputs, layer inputs + parameters)`, the full backward;
- B and W as the runtime splits them: the layer rewritten by `passes/split_backward.py` runs its
  backward with weight gradients deferred (B: input gradients, and the gradients of parameters
  the rewrite does not split), then the deferred weight-gradient matmuls (W). W is the full
  backward's share in proportion, W = (B+W) * W_split / (B_split + W_split), which stays positive
  and below B+W however noisy the timer; a layer with nothing to defer (no linear weights) has
  W = 0, as its W op in the runtime does nothing.
- gradient accumulation: a step's microbatches after the first add their parameter gradients
  into `.grad` (read both, write one: memory-bound, and as long as a big layer's backward in
  bf16), which `autograd.grad` above does not do. The addition is timed on the layer's
  parameters (`accumulate_ms`, W's part `accumulate_weight_ms`), and with `num_microbatches` = M
  (M-1)/M of it joins B+W, the part of the parameters W defers joining W.
- selective recomputation: the bytes of the layer's heavy ops' outputs (`SELECTIVE_SAVED_OPS`,
  what PyTorch's selective checkpoint keeps), and its cost, the layer's forward and backward
  under the selective checkpoint less the plain ones.
Backward passes reuse one recorded forward (`retain_graph=True`) with random output gradients.
Each measurement is warmed up, then the median of `repeats` runs. Timers: `time.perf_counter` on
CPU; on CUDA `triton.testing.do_bench` when triton imports (median), else CUDA events, with a
synchronize around each run. Bytes: activation bytes are what autograd saves during the layer's
forward (saved-tensor hooks; parameters and duplicates not counted), output bytes the tensors
sent to later layers, parameter bytes the layer's parameters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from octopipe.errors import ExecutionError
from octopipe.ir.costs import CostTable, LayerCost
from octopipe.ir.graph import Layer, LayerGraph
from octopipe.passes.trace import selective_hazards
from octopipe.runtime import amp
from octopipe.runtime.stage import SELECTIVE_SAVED_OPS, selective_checkpoint

__all__ = ["LayerModule", "layer_modules", "profile_costs"]


def profile_costs(
    graph: LayerGraph,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    example_target: torch.Tensor | None = None,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | str | None = None,
    autocast: Any = None,
    num_microbatches: int = 1,
) -> CostTable:
    """Measure F, B and W of every layer of `graph` on one example batch (see the module docstring).
    `autocast` (None, "bf16" or "fp16"): every forward runs under torch.autocast, as the engine runs it.
    `num_microbatches`: the microbatches a step accumulates gradients over (the example batch is
    one of them); B and W carry their share of the accumulation."""
    if graph.module is None:
        raise ExecutionError(
            "profile_costs: this LayerGraph has no traced module (it was parsed from text); trace the model"
        )
    if repeats < 1 or warmup < 0:
        raise ExecutionError(
            f"profile_costs: repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}"
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ExecutionError(f"profile_costs: num_microbatches must be a positive integer, got {num_microbatches!r}")
    gm: fx.GraphModule = graph.module
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if example_target is not None:
        inputs = inputs + (example_target,)
    if len(inputs) != len(graph.inputs):
        raise ExecutionError(
            f"profile_costs: the graph takes {len(graph.inputs)} inputs {list(graph.inputs)}, got {len(inputs)}; "
            "pass the example batch it was traced with (and example_target when it was traced with a loss)"
        )
    target_device = _device_of(gm, inputs, device)
    dtype = amp.autocast_dtype(autocast, "profile_costs(autocast=...)")
    inputs = tuple(t.to(target_device) if isinstance(t, torch.Tensor) else t for t in inputs)
    timer = _Timer(target_device, repeats, warmup)

    def autocast_forward() -> Any:
        return amp.autocast(dtype, target_device)

    captured = _capture(gm, inputs, graph, autocast_forward)
    layers = []
    for layer, sub in zip(graph.layers, layer_modules(graph)):
        layers.append(_measure(layer, sub, captured, timer, frozenset(graph.inputs), autocast_forward,
                               (num_microbatches - 1) / num_microbatches))
    sizes = {edge.name: sum(t.numel() * t.element_size() for t in _flat_tensors(captured[edge.name]))
             for edge in graph.skip_edges if edge.name in captured}
    table = CostTable(tuple(layers), model=graph.model, tied=graph.tied_parameters(), skips=graph.skip_tensors(sizes),
                      num_microbatches=num_microbatches)
    return table.without_selective(selective_hazards(graph))  # layers selective recomputation cannot run


# ---------------------------------------------------------------------------- cutting the graph


@dataclass(frozen=True)
class LayerModule:
    """One layer as a runnable GraphModule: `module(*[captured[name] for name in inputs])`
    returns the values named `outputs` (tensors later layers read, and the model output)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def layer_modules(graph: LayerGraph) -> list[LayerModule]:
    """Cut `graph.module` into one GraphModule per layer (sharing the model's parameters)."""
    gm: fx.GraphModule = graph.module
    nodes = {node.name: node for node in gm.graph.nodes}
    layer_of = graph.layer_of_node()
    cut: list[LayerModule] = []
    for layer in graph.layers:
        members = [nodes[name] for name in layer.nodes]
        member_set = set(members)
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs: list[str] = []
        for node in members:
            for source in node.all_input_nodes:
                if source not in member_set and source not in env:
                    env[source] = sub.placeholder(source.name)
                    inputs.append(source.name)
        outputs: list[str] = []
        result: list[Any] = []
        for node in members:
            if node.op == "output":
                result.append(fx.map_arg(node.args[0], env.__getitem__))
                outputs.append("output")
                continue
            env[node] = sub.node_copy(node, env.__getitem__)
            if any(layer_of.get(user.name) != layer.index for user in node.users):
                outputs.append(node.name)
                result.append(env[node])
        sub.output(tuple(result))
        cut.append(
            LayerModule(fx.GraphModule(gm, sub, class_name=f"Layer{layer.index}"), tuple(inputs), tuple(outputs))
        )
    return cut


class _Capture(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = result
        return result


def _capture(gm: fx.GraphModule, inputs: tuple[Any, ...], graph: LayerGraph,
             autocast_forward: Callable[[], Any]) -> dict[str, Any]:
    keep = {edge.name for edge in graph.edges} | set(graph.inputs)
    capture = _Capture(gm, keep)
    try:
        with torch.no_grad(), autocast_forward():
            capture.run(*inputs)
    except Exception as exc:  # noqa: BLE001 - reported with the layer
        raise ExecutionError(
            f"profile_costs: the traced model failed on the example batch: {type(exc).__name__}: {exc}"
        ) from None
    return capture.values


def _device_of(gm: fx.GraphModule, inputs: tuple[Any, ...], device: torch.device | str | None) -> torch.device:
    tensors = [*gm.parameters(), *gm.buffers()]
    model_device = tensors[0].device if tensors else None
    if any(t.is_meta for t in tensors):
        raise ExecutionError(
            "profile_costs: the model is on the meta device (no data to run); profile a real model, "
            "or use analytic_costs for meta-device planning"
        )
    if device is not None:
        wanted = torch.device(device)
        if model_device is not None and model_device.type != wanted.type:
            raise ExecutionError(
                f"profile_costs: the model is on {model_device} but device={wanted} was asked for; move the model "
                f"(model.to({str(wanted)!r})) and trace again, or drop device="
            )
        return wanted
    if model_device is not None:
        return model_device
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")


# ---------------------------------------------------------------------------- timing


class _Timer:
    """Median milliseconds of a callable after warm-up, with the device's own clock."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device = device
        self.repeats = repeats
        self.warmup = warmup
        self.do_bench: Callable[..., float] | None = None
        if device.type == "cuda":  # only a CUDA device ever imports triton
            try:
                from triton.testing import do_bench
            except ImportError:
                do_bench = None
            self.do_bench = do_bench

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            for _ in range(self.warmup):
                fn()
            times = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        times = [self._cuda_once(fn) for _ in range(max(self.warmup, 1))]
        if self.do_bench is not None:
            # do_bench takes time budgets (ms), not counts: give it about warmup / repeats runs
            # (it also flushes the L2 cache between runs, as a real step would find it).
            once = max(times[-1], 1e-3)
            return float(self.do_bench(fn, warmup=once * self.warmup, rep=once * self.repeats, return_mode="median"))
        return statistics.median(self._cuda_once(fn) for _ in range(self.repeats))

    def _cuda_once(self, fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(self.device)
        return start.elapsed_time(end)


# ---------------------------------------------------------------------------- one layer


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _flat_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _flat_tensors(item)]
    return []


def _measure(
    layer: Layer, sub: LayerModule, captured: dict[str, Any], timer: _Timer, model_inputs: frozenset[str],
    autocast_forward: Callable[[], Any], accumulating: float = 0.0,
) -> LayerCost:
    """`accumulating`: the share of a step's microbatches that add their gradients into `.grad`."""
    params: list[torch.Tensor] = [p for p in sub.module.parameters() if p.requires_grad]
    param_storages = {p.untyped_storage().data_ptr() for p in sub.module.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in sub.module.parameters())

    def fresh_inputs() -> list[Any]:
        values = []
        for name in sub.inputs:
            value = captured[name]
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.is_floating_point() and name not in model_inputs:  # activations; model inputs need no grad
                    value = value.clone().requires_grad_(True)
            values.append(value)
        return values

    inputs = fresh_inputs()
    act_inputs = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]

    def forward() -> Any:
        with autocast_forward():
            return sub.module(*inputs)

    try:
        forward_ms = timer(forward)
        # what autograd saves, per storage (as the runtime's meter counts it: q, k and v cut from
        # one projection are one storage), parameters' and the batch's storages left out (the
        # step holds the batch whatever the schedule; a microbatch is a view of it)
        saved: dict[int, int] = {}
        batch = {value.untyped_storage().data_ptr() for name, value in zip(sub.inputs, inputs)
                 if name in model_inputs and isinstance(value, torch.Tensor)}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in param_storages and storage.data_ptr() not in batch:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs = forward()
        activation_bytes = sum(saved.values())
        # what the layer received and saved none of: held by the runtime where it starts a stage
        unsaved_input_bytes = sum(t.untyped_storage().nbytes() for t in act_inputs
                                  if t.untyped_storage().data_ptr() not in saved)
        out_tensors = [t for t in _flat_tensors(outputs) if t.requires_grad]
        output_bytes = sum(
            t.numel() * t.element_size()
            for name, value in zip(sub.outputs, outputs)
            if name != "output"
            for t in _flat_tensors(value)
        )
        backward_ms = input_only_ms = weight_only_ms = accumulate_ms = selective_ms = 0.0
        deferred_share = 0.0
        stash_bytes = 0
        selective_bytes = 0
        if out_tensors and (act_inputs or params):
            grads = [torch.randn_like(t) for t in out_tensors]

            def grad_of(wrt: list[torch.Tensor]) -> Callable[[], Any]:
                return lambda: torch.autograd.grad(out_tensors, wrt, grads, retain_graph=True, allow_unused=True)

            backward_ms = timer(grad_of(act_inputs + params))
            input_only_ms, weight_only_ms, deferred_share, stash_bytes = _split_times(
                sub, inputs, act_inputs, grads, timer, autocast_forward)
            if params:  # timed whatever the microbatch count: the table can be re-costed for another one
                accumulate_ms = _accumulate_time(params, timer)
            selective_bytes, selective_ms = _selective(sub, inputs, act_inputs + params, grads, timer, autocast_forward)
    except Exception as exc:  # noqa: BLE001 - one clear error naming the layer
        raise ExecutionError(
            f"profile_costs: layer {layer.index} ({layer.name!r}) failed: {type(exc).__name__}: {exc}"
        ) from None
    # the split backward does the same work plus a little bookkeeping: share the measured full
    # backward between B and W in the split's proportion.
    both = input_only_ms + weight_only_ms
    weight_ms = min(backward_ms, backward_ms * weight_only_ms / both) if both > 0 else 0.0
    accumulate_weight_ms = accumulate_ms * deferred_share
    weight_ms += accumulating * accumulate_weight_ms
    return LayerCost(
        name=layer.name,
        kind=layer.kind,
        forward_ms=forward_ms,
        backward_ms=backward_ms + accumulating * accumulate_ms,
        backward_weight_ms=weight_ms,
        accumulate_ms=accumulate_ms,
        accumulate_weight_ms=accumulate_weight_ms,
        activation_bytes=int(activation_bytes),
        output_bytes=int(output_bytes),
        param_bytes=int(param_bytes),
        selective_activation_bytes=int(selective_bytes),
        selective_recompute_ms=selective_ms,
        weight_stash_bytes=int(stash_bytes),
        unsaved_input_bytes=int(unsaved_input_bytes),
    )


class _KeptOutputs(TorchDispatchMode):
    """Sums the bytes of what selective recomputation keeps: the outputs of `SELECTIVE_SAVED_OPS`."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SELECTIVE_SAVED_OPS:
            self.bytes += sum(t.numel() * t.element_size() for t in _flat_tensors(out))
        return out


def _selective(sub: LayerModule, inputs: list[Any], wrt: list[torch.Tensor], grads: list[torch.Tensor],
               timer: _Timer, autocast_forward: Callable[[], Any]) -> tuple[int, float]:
    """Selective recomputation of one layer: the bytes its heavy ops' outputs take (what it keeps
    from F to B), and what recomputing the rest costs, as the forward and backward under the
    selective checkpoint less the plain forward and backward (each timed whole: a selective
    checkpoint's backward runs once per forward)."""
    with _KeptOutputs() as kept, torch.no_grad(), autocast_forward():
        sub.module(*inputs)

    def forward_backward(selective: bool) -> Callable[[], Any]:
        def run() -> Any:
            with autocast_forward():
                outputs = selective_checkpoint(sub.module, *inputs) if selective else sub.module(*inputs)
            tensors = [t for t in _flat_tensors(outputs) if t.requires_grad]
            return torch.autograd.grad(tensors, wrt, grads, allow_unused=True)
        return run

    plain_ms = timer(forward_backward(False))
    return kept.bytes, max(0.0, timer(forward_backward(True)) - plain_ms)


def _accumulate_time(params: list[torch.Tensor], timer: _Timer) -> float:
    """Median ms of adding a gradient into each of `params`' `.grad` (AccumulateGrad's in-place
    add, and W's), on stand-in tensors of their shapes and dtypes."""
    sums = [torch.zeros_like(p) for p in params]
    parts = [torch.ones_like(p) for p in params]

    def accumulate() -> None:
        for total, part in zip(sums, parts):
            total.add_(part)

    return timer(accumulate)


def _split_times(sub: LayerModule, inputs: list[Any], act_inputs: list[torch.Tensor], grads: list[torch.Tensor],
                 timer: _Timer, autocast_forward: Callable[[], Any]) -> tuple[float, float, float, int]:
    """Median ms of B and of W when the layer's backward is split the runtime's way, the share
    of the layer's trainable parameter bytes whose gradients W computes, and the bytes B leaves
    for W (the stash's tensors, per storage, parameters left out: the linear layers' inputs and
    output gradients, what the engine holds from B to W); (0, 0, 0, 0) when the rewrite finds no
    weight to defer."""
    from octopipe.passes.split_backward import split_backward
    from octopipe.runtime.meter import tensors_in
    from octopipe.runtime.stage import WeightGradStash, deferred_weight_grads

    split, deferred = split_backward(sub.module)
    if not deferred:
        return 0.0, 0.0, 0.0, 0
    deferred_params = [split.get_parameter(name) for name in deferred]
    deferred_ids = {id(p) for p in deferred_params}
    kept = [p for p in split.parameters() if p.requires_grad and id(p) not in deferred_ids]
    deferred_bytes = sum(p.numel() * p.element_size() for p in deferred_params if p.requires_grad)
    kept_bytes = sum(p.numel() * p.element_size() for p in kept)
    share = deferred_bytes / (deferred_bytes + kept_bytes) if deferred_bytes + kept_bytes else 0.0
    saved_grads = {id(p): p.grad for p in deferred_params}
    with autocast_forward():
        outputs = [t for t in _flat_tensors(split(*inputs)) if t.requires_grad]
    wrt = act_inputs + kept
    cuda = timer.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(timer.device)

    params = {p.untyped_storage().data_ptr() for p in split.parameters()}
    b_times, w_times = [], []
    stash_bytes = 0
    try:
        for run in range(timer.warmup + timer.repeats):
            stash = WeightGradStash()
            sync()
            start = time.perf_counter()
            with deferred_weight_grads(stash):
                if wrt:
                    torch.autograd.grad(outputs, wrt, grads, retain_graph=True, allow_unused=True)
                else:
                    torch.autograd.backward(outputs, grads, retain_graph=True)
            sync()
            middle = time.perf_counter()
            if run == 0:
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for _, args in stash.entries for t in tensors_in(args)}
                stash_bytes = sum(size for key, size in storages.items() if key not in params)
            stash.run()
            sync()
            end = time.perf_counter()
            if run >= timer.warmup:
                b_times.append((middle - start) * 1e3)
                w_times.append((end - middle) * 1e3)
    finally:
        for param in deferred_params:  # W accumulated into the model's own .grad: put it back
            param.grad = saved_grads[id(param)]
    return statistics.median(b_times), statistics.median(w_times), share, stash_bytes
