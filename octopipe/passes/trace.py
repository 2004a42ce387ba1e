"""trace: nn.Module + one example batch -> LayerGraph (IR level 1), the pass `trace`.

Consumes a model, example inputs (one full batch) and optionally a loss; produces a LayerGraph
whose layers are the units a pipeline stage boundary may fall between, plus the traced
GraphModule (`LayerGraph.module`) whose nodes those layers own.

Glossary: a *unit* is a module that becomes one layer: each block of a block container (every
`nn.ModuleList`, and an `nn.Sequential` of two or more blocks of one non-torch class), and every
other module on the way down to them (embeddings, norms, heads, projectors, ...). Containers that
hold block containers (a `vision` encoder, Hugging Face's `model`) are not units: their children
are. A node's *owner* is the innermost module whose forward created it (fx and export record it
in `node.meta["nn_module_stack"]`; a `call_module` node is owned by its target).

How tracing works. The model is wrapped in a root module that shares the model's children,
parameters and buffers (so every qualified name is the model's own) and whose forward is
`model.forward(*inputs)`, reduced to its primary tensor (the tensor, `.logits`, or the first
element), then, when `loss_fn` is given, `loss_fn(output, target)` run inside a submodule named
`loss` (so the loss is a unit and `target` is the last graph input). `method="fx"` traces it with
`torch.fx` symbolic tracing (`leaf_modules` stay single `call_module` nodes); `method="export"`
uses `torch.export.export(strict=False)` with the batch and sequence dims dynamic and keeps the
unlifted module (`exported.module()`: parameters are read by `get_attr` nodes with the original
names); `method="auto"` tries fx, then export.

Node-to-layer rule (keeps every layer contiguous in one topological order):
1. A node owned by a module inside a unit belongs to that unit. A split point inside a unit cuts
   it: the unit's nodes from the split module's first node on form a new unit named after it.
2. A node with no owning unit (code between modules in a parent's forward: residual adds, masks,
   position ids, reshapes) joins the *latest* unit that produced one of its inputs, so work on a
   unit's output stays with it and nothing new crosses a boundary; a node that depends only on
   model inputs and constants joins the *earliest* unit that consumes it (computed where first
   needed, then sent on).
3. A `get_attr` node (a parameter, buffer or constant) is copied into every layer that reads it,
   so parameters never travel as activations; a parameter read by two layers (tied embedding and
   head) is a SharedParameter.
4. Units that depend on each other both ways (a module called twice around another, code
   interleaved across modules) cannot be separated without a backward edge: each such cycle is
   merged into one layer named `a+b` whose `modules` lists them all. Layers are the remaining
   units in topological order, ties broken by first execution, so every edge goes forward.
5. Placeholders are model inputs (edge producer -1) and belong to no layer; the output node
   belongs to the last layer. The graph is reordered so each layer's nodes are contiguous.

Edges carry shapes and dtypes from shape propagation on the example batch (real tensors, meta
tensors for models built on the meta device, or FakeTensors when they are mixed).
"""

from __future__ import annotations

import contextlib
import difflib
import heapq
import inspect
import io
import keyword
import linecache
import logging
import operator
import os
import sysconfig
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from octopipe.errors import TraceError
from octopipe.ir.graph import Layer, LayerGraph, SharedParameter, TensorEdge

__all__ = ["ValueInfo", "propagate_shapes", "trace"]

LOSS_MODULE = "loss"
"""Name of the loss unit (and of its module in the traced root)."""

_VISION_WORDS = ("vision", "visual", "image", "img", "vit", "siglip", "clip")
_HEAD_WORDS = ("head", "lm_head", "classifier", "output_layer", "logits")
_PROJECTOR_WORDS = ("projector", "mm_proj", "multi_modal_projector", "connector")


# ---------------------------------------------------------------------------- public entry point


def trace(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    split_points: Iterable[str] = (),
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    method: str = "auto",
) -> LayerGraph:
    """Trace `model` on one example batch into a LayerGraph (see the module docstring).

    example_inputs: the positional inputs of `model.forward` (a tensor or a tuple of tensors).
    loss_fn(output, target) -> scalar: when given (with `example_target`), the loss is the last
    layer and `target` the last graph input. split_points: module paths (`"layers.3"`,
    `"layers.3.mlp"`) before which a layer boundary is forced. leaf_modules: module paths or
    classes kept as one `call_module` node (fx only). method: "auto" | "fx" | "export".
    """
    with kept_buffers(model):
        return _trace(model, example_inputs, loss_fn, example_target, split_points, leaf_modules, method)


def _trace(model: nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None, example_target: torch.Tensor | None,
           split_points: Iterable[str], leaf_modules: Iterable[str | type[nn.Module]], method: str) -> LayerGraph:
    inputs = _check_inputs(model, example_inputs, loss_fn, example_target, method)
    root = _TraceRoot.build(model, len(inputs), loss_fn)
    leaf_paths, leaf_types = _leaf_spec(root, leaf_modules)
    if isinstance(split_points, str):
        raise TraceError(f"{method}: split_points is a list of module paths, got the string {split_points!r}; write "
                         f"[{split_points!r}]")
    split_points = tuple(split_points)
    _check_split_points(root, split_points)
    # _check_inputs: a target comes exactly with a loss_fn
    args = inputs + ((example_target,) if example_target is not None else ())

    gm: fx.GraphModule | None = None
    used = method
    fx_failure: _Failure | None = None
    if method in ("auto", "fx"):
        try:
            gm = _trace_fx(root, leaf_paths, leaf_types)
            used = "fx"
        except TraceError:
            raise  # the model's own output refused (_primary_output): no tracer does better
        except Exception as exc:  # noqa: BLE001 - every tracer failure becomes one TraceError
            fx_failure = _Failure.of(exc, root, "torch.fx")
            if method == "fx":
                raise _trace_error(model, [fx_failure], method, root) from None
    if gm is None:
        try:
            gm = _trace_export(root, args)
            used = "export"
        except Exception as exc:  # noqa: BLE001
            failures = [f for f in (fx_failure, _Failure.of(exc, root, "torch.export")) if f is not None]
            raise _trace_error(model, failures, method, root) from None
    return _build_graph(model, root, gm, args, used, split_points)


@contextlib.contextmanager
def kept_buffers(model: nn.Module) -> Any:
    """Undo what running `model` while compiling it (shape propagation, codegen's example run)
    does to its buffers: running statistics, step counters. The user's model comes back as it
    went in."""
    modules = model.modules() if isinstance(model, nn.Module) else ()  # (not a module: refused where it is used)
    saved = [(module, name, buffer, buffer.detach().clone())
             for module in modules for name, buffer in module._buffers.items() if buffer is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                module._buffers[name] = buffer
                buffer.copy_(value)


# ---------------------------------------------------------------------------- the traced root


def _primary_output(output: Any, reduced: list[str] | None = None) -> Any:
    """The tensor a loss reads: the output itself, `.logits` (a Hugging Face ModelOutput, or a
    dict's "logits"), or the only element of a one-element tuple, list or dict (`reduced` notes
    which). A pipeline's last stage passes on one tensor: any other output would be dropped
    silently, so a tuple, list or dict of several values without logits is refused."""
    if isinstance(output, (torch.Tensor, fx.Proxy)):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is not None:
        how = "its logits"
    elif isinstance(output, (tuple, list, dict)) and len(output) == 1:
        logits, how = next(iter(output.values())) if isinstance(output, dict) else output[0], "its only element"
    else:
        count = f" of {len(output)} values" if isinstance(output, (tuple, list, dict)) else ""
        raise TraceError(
            f"trace: the model returns a {type(output).__name__}{count}; a pipeline's last stage passes on one "
            "tensor, the one the loss reads, and the others (an auxiliary loss, hidden states) would be dropped. "
            "Wrap the model so its forward returns that tensor (or add what the loss needs to it), or return an "
            "object whose .logits is it")
    if reduced is not None:
        reduced.append(f"{type(output).__name__}: {how}")
    return _primary_output(logits, reduced)


class _LossModule(nn.Module):
    """Runs a plain loss function as a module, so its nodes are owned by the `loss` unit."""

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        result = self.fn(output, target)
        # fx makes an attribute read (`output.foo`) a node only where it is used, which for the
        # loss's result is after this call: make it here, so an error in it is the loss's
        # (found by fuzzing: it was reported in the model's last layer)
        fx.node.map_aggregate(result, lambda value: value.node if isinstance(value, fx.Proxy) else value)
        return result


class _TraceRoot(nn.Module):
    """The model as the tracers see it: the model's own children, parameters and buffers (shared
    dicts, so qualified names match `model.named_parameters()`), a forward with exactly the
    example inputs (plus `target`) that returns the primary output or the loss."""

    input_names: tuple[str, ...]
    loss_name: str | None
    _octopipe_reduced: list[str]

    @classmethod
    def build(cls, model: nn.Module, num_inputs: int, loss_fn: Callable[..., Any] | None) -> _TraceRoot:
        names = _input_names(model, num_inputs)
        loss_name = None
        if loss_fn is not None:
            loss_name = LOSS_MODULE if LOSS_MODULE not in model._modules else "octopipe_loss"
        target_name = "target" if "target" not in names else "loss_target"
        call_kwargs = {"use_cache": False} if _accepts(model.forward, "use_cache") else {}
        params = ", ".join(names)
        lines = [f"def forward(self, {params}{', ' + target_name if loss_name else ''}):"]
        lines.append(f"    output = _primary_output(self._octopipe_model.forward({params}, **self._octopipe_kwargs), "
                     "self._octopipe_reduced)")
        lines.append(f"    return self.{loss_name}(output, {target_name})" if loss_name else "    return output")
        namespace: dict[str, Any] = {"_primary_output": _primary_output}
        exec(compile("\n".join(lines), f"<octopipe trace root of {type(model).__name__}>", "exec"), namespace)  # noqa: S102
        subclass: type[_TraceRoot] = type(f"{type(model).__name__}TraceRoot", (cls,), {"forward": namespace["forward"]})
        root = subclass.__new__(subclass)
        nn.Module.__init__(root)
        root._modules = dict(model._modules)
        root._parameters = model._parameters
        root._buffers = model._buffers
        root._non_persistent_buffers_set = model._non_persistent_buffers_set
        root.training = model.training
        object.__setattr__(root, "_octopipe_model", model)
        object.__setattr__(root, "_octopipe_kwargs", call_kwargs)
        object.__setattr__(root, "_octopipe_reduced", [])  # what _primary_output took from a non-tensor output
        object.__setattr__(root, "input_names", names + ((target_name,) if loss_name else ()))
        object.__setattr__(root, "loss_name", loss_name)
        if loss_fn is not None:
            assert loss_name is not None
            root._modules[loss_name] = loss_fn if isinstance(loss_fn, nn.Module) else _LossModule(loss_fn)
        return root


def _input_names(model: nn.Module, count: int) -> tuple[str, ...]:
    names: list[str] = []
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    for parameter in parameters:
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    names = names[:count]
    while len(names) < count:
        names.append(f"input_{len(names)}")
    cleaned: list[str] = []
    for index, name in enumerate(names):
        if not name.isidentifier() or keyword.iskeyword(name) or name in ("self", "output") or name in cleaned:
            name = f"input_{index}"
        cleaned.append(name)
    return tuple(cleaned)


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_inputs(
    model: nn.Module, example_inputs: Any, loss_fn: Any, example_target: Any, method: str
) -> tuple[torch.Tensor, ...]:
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace expects an nn.Module, got {type(model).__name__}")
    if method not in ("auto", "fx", "export"):
        raise TraceError(f"trace: method must be 'auto', 'fx' or 'export', got {method!r}")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not inputs:
        raise TraceError("trace: example_inputs is empty; pass one example batch, e.g. example_inputs=(input_ids,)")
    for index, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise TraceError(
                f"trace: example_inputs[{index}] is a {type(value).__name__}; inputs must be tensors "
                "(wrap non-tensor options in the model or bind them with functools.partial)"
            )
    if loss_fn is not None and not isinstance(example_target, torch.Tensor):
        raise TraceError("trace: loss_fn needs example_target (a tensor shaped like one batch of targets)")
    if loss_fn is None and example_target is not None:
        raise TraceError("trace: example_target was given without loss_fn; pass loss_fn=fn(output, target)")
    return inputs


def _leaf_spec(
    root: nn.Module, leaf_modules: Iterable[str | type[nn.Module]]
) -> tuple[frozenset[str], tuple[type, ...]]:
    paths: set[str] = set()
    types: list[type] = []
    modules = dict(root.named_modules())
    for item in leaf_modules:
        if isinstance(item, str):
            if item not in modules:
                raise TraceError(
                    f"trace: leaf module {item!r} is not a module of the model{_did_you_mean(item, modules)}"
                )
            paths.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        else:
            raise TraceError(f"trace: leaf_modules entries must be module paths or nn.Module classes, got {item!r}")
    return frozenset(paths), tuple(types)


def _check_split_points(root: nn.Module, split_points: tuple[str, ...]) -> None:
    modules = dict(root.named_modules())
    for point in split_points:
        if not isinstance(point, str) or point not in modules or not point:
            raise TraceError(
                f"trace: split point {point!r} is not a module of the model{_did_you_mean(str(point), modules)}"
            )


def _did_you_mean(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, [n for n in names if n], n=3)
    return f"; did you mean {', '.join(map(repr, close))}?" if close else ""


# ---------------------------------------------------------------------------- the two tracers


class _Tracer(fx.Tracer):
    # a buffer is a graph value (get_attr), so what forward does to it (`self.steps.add_(1)`) is
    # recorded, not run once on the real buffer while tracing and then lost
    proxy_buffer_attributes = True

    def __init__(self, leaf_paths: frozenset[str], leaf_types: tuple[type, ...]) -> None:
        super().__init__()
        self.leaf_paths = leaf_paths
        self.leaf_types = leaf_types
        self.without_grad: list[fx.Node] = []
        """Ops forward ran with gradients off (torch.no_grad, set_grad_enabled(False),
        inference_mode): tracing runs forward's Python, so the mode is the model's own here, but
        the graph does not record it."""

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **options: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **options)
        if kind in ("call_function", "call_method", "call_module") and not torch.is_grad_enabled():
            self.without_grad.append(proxy.node)
        return proxy

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        if isinstance(m, _LossModule):
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _trace_fx(root: _TraceRoot, leaf_paths: frozenset[str], leaf_types: tuple[type, ...]) -> fx.GraphModule:
    tracer = _Tracer(leaf_paths, leaf_types)
    buffers = [(path, module, name, buffer) for path, module in root.named_modules()
               for name, buffer in module._buffers.items()]
    try:
        with torch.enable_grad():  # (a model's own no_grad blocks still switch it off: see below)
            graph = tracer.trace(root)
    finally:
        reassigned = _restore_buffers(buffers)
    _warn_if_mode_dependent(root, leaf_paths, leaf_types, graph, buffers)
    # an op forward ran with gradients off gives values no gradient flows through: the graph
    # detaches them, or the stages would backpropagate through the block (silently wrong
    # gradients for what it reads, and gradients for its own weights where eager gives none)
    for node in tracer.without_grad:
        with graph.inserting_after(node):
            cut = graph.call_function(without_grad, (node,))
        for user in [user for user in node.users if user is not cut]:
            user.replace_input_with(node, cut)
    # `self.steps += 1` or `self.avg = 0.9 * self.avg + ...` on a buffer assigns it a new value:
    # the graph writes it back into the buffer (copy_), as eager PyTorch's assignment would
    for qualified, value in reassigned:
        with graph.inserting_after(value.node):
            target = graph.get_attr(qualified)
        with graph.inserting_after(target):
            graph.call_method("copy_", (target, value.node))
    return fx.GraphModule(root, graph, class_name=type(root._octopipe_model).__name__)


def _warn_if_mode_dependent(root: _TraceRoot, leaf_paths: frozenset[str], leaf_types: tuple[type, ...],
                            graph: fx.Graph, buffers: list[tuple[str, nn.Module, str, torch.Tensor | None]]) -> None:
    """Warn where the forward traces to another graph in the other training mode (`if
    self.training:`, or `training=self.training` given to a function; found by fuzzing): the
    graph keeps the mode it was traced in, for training and for `evaluate` alike, where only its
    leaf modules (dropout, norms) follow the engine's mode. Traced once more in the other mode
    (the modules' own modes and the buffers put back after); a functional dropout of p=0 is no
    difference (Hugging Face attention's)."""
    import warnings

    from octopipe.errors import OctopipeWarning

    model: nn.Module = root._octopipe_model  # type: ignore[assignment]  # (the root shares its children, not the model)
    modules = {id(module): module for module in (*root.modules(), *model.modules())}.values()
    modes = [(module, module.training) for module in modules]
    flipped = not model.training
    try:
        for module in modules:
            module.training = flipped
        with torch.enable_grad():
            other = _Tracer(leaf_paths, leaf_types).trace(root)
    except Exception:  # noqa: BLE001 - the other mode does not trace: nothing to compare
        return
    finally:
        for module, mode in modes:
            module.training = mode
        _restore_buffers(buffers)
    if _same_graph(graph, other):
        return
    traced_in = "training" if model.training else "eval"
    warnings.warn(f"trace: {type(model).__name__}'s forward depends on its training mode beyond its "
                  f"leaf modules (`if self.training:`, or training=self.training given to a function): the pipeline "
                  f"runs the {traced_in}-mode forward it was traced in, in training and in evaluate alike (only dropout "
                  "and norm modules follow the engine's mode); compile the model in the mode it will run in",
                  OctopipeWarning, stacklevel=5)


def _same_graph(first: fx.Graph, second: fx.Graph) -> bool:
    """Whether two traces of one model made the same ops on the same constants."""
    a, b = list(first.nodes), list(second.nodes)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.op, str(x.target), str(x.args), str(x.kwargs)) == (y.op, str(y.target), str(y.args), str(y.kwargs)):
            continue
        if not (x.op == y.op == "call_function" and x.target is y.target and "dropout" in str(x.target)
                and _dropout_p(x) == _dropout_p(y) == 0):
            return False
    return True


def _dropout_p(node: fx.Node) -> Any:
    return node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)


def without_grad(value: Any) -> Any:
    """What an op run with gradients off gives: its tensors detached, as torch.no_grad leaves
    them (the same values, no gradient through them); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(without_grad(item) for item in value)
    return value


def selective_hazards(graph: LayerGraph) -> dict[int, str]:
    """Layer index -> why selective recomputation cannot run that layer (layers not named: it
    can). It keeps the matmul outputs of the forward (`runtime.stage.SELECTIVE_SAVED_OPS`), and
    an in-place op that changes one after (`x.relu_()`, `x += y`, `inplace=True`) fails the
    backward, or, inside a recurrent module's kernels (nn.GRU on CPU), goes unseen and gives
    wrong gradients."""
    if graph.module is None:
        return {}
    modules = dict(graph.module.named_modules())
    nodes = {node.name: node for node in graph.module.graph.nodes}

    def hazard(node: fx.Node) -> str | None:
        if node.op == "call_module":
            module = modules.get(str(node.target))
            if isinstance(module, nn.RNNBase):
                return f"runs a recurrent module ({type(module).__name__} {node.target})"
            if getattr(module, "inplace", False) is True:
                return f"runs {type(module).__name__}(inplace=True) ({node.target})"
        elif node.kwargs.get("inplace") is True or (_mutates(node) and node.target not in _NOT_IN_PLACE):
            return f"changes a tensor in place ({getattr(node.target, '__name__', node.target)})"
        return None

    found = {}
    for layer in graph.layers:
        reason = next((r for name in layer.nodes if name in nodes and (r := hazard(nodes[name])) is not None), None)
        if reason is not None:
            found[layer.index] = reason
    return found


_NOT_IN_PLACE = frozenset({operator.and_, operator.or_, operator.not_, operator.is_})
"""Named with a trailing underscore, but `&`, `|`, `not` and `is`: nothing changes in place."""


def _restore_buffers(buffers: list[tuple[str, nn.Module, str, torch.Tensor | None]]) -> list[tuple[str, fx.Proxy]]:
    """Put back buffers that tracing reassigned (to a Proxy), returning (qualified name, the
    value assigned) for each."""
    reassigned: list[tuple[str, fx.Proxy]] = []
    for path, module, name, buffer in buffers:
        value = module._buffers.get(name)
        if value is not buffer:
            module._buffers[name] = buffer
            if isinstance(value, fx.Proxy):
                reassigned.append((f"{path}.{name}" if path else name, value))
    return reassigned


def _trace_export(root: _TraceRoot, args: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    from torch.export import Dim

    def dims(value: torch.Tensor) -> dict[int, Any]:
        spec: dict[int, Any] = {0: Dim.AUTO} if value.dim() >= 1 else {}
        if value.dim() in (2, 3):
            spec[1] = Dim.AUTO  # [batch, seq] ids or [batch, seq, features]
        return spec

    # torch.export logs and prints partial graphs to stderr when it fails; the TraceError says it all.
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                exported = torch.export.export(root, args, dynamic_shapes=tuple(dims(a) for a in args), strict=False)
            except Exception:  # noqa: BLE001 - a model that cannot be dynamic may still export statically
                exported = torch.export.export(root, args, strict=False)
    finally:
        logging.disable(disabled)
    return exported.module(check_guards=False)


@dataclass(frozen=True)
class _Failure:
    tracer: str
    module: str
    module_type: str
    location: str
    code: str
    message: str
    exception: BaseException

    @classmethod
    def of(cls, exc: BaseException, root: nn.Module, tracer: str) -> _Failure:
        module_paths = {id(module): path for path, module in root.named_modules()}
        module, module_type, location, code = "", "", "", ""
        torch_dir = os.path.dirname(torch.__file__)
        stdlib = sysconfig.get_paths().get("stdlib", "//none")
        chain: list[BaseException] = []
        seen: BaseException | None = exc
        while seen is not None and seen not in chain and len(chain) < 8:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        for link in reversed(chain):
            for frame, lineno in traceback.walk_tb(link.__traceback__):
                owner = frame.f_locals.get("self")
                if isinstance(owner, nn.Module) and id(owner) in module_paths and module_paths[id(owner)]:
                    module, module_type = module_paths[id(owner)], type(owner).__name__
                filename = frame.f_code.co_filename
                if (
                    filename.startswith(torch_dir)
                    or filename == __file__
                    or filename.startswith(stdlib)
                    or filename.startswith("<")
                ):
                    continue
                location = f"{os.path.basename(filename)}:{lineno}"
                code = linecache.getline(filename, lineno).strip()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if len(message) > 240:
            message = message[:237] + "..."
        return cls(tracer, module, module_type, location, code, f"{type(exc).__name__}: {message}", exc)

    def describe(self) -> str:
        where = f"in module {self.module!r} ({self.module_type})" if self.module else "in the model's own forward"
        at = f" at {self.location}" + (f" `{self.code}`" if self.code else "") if self.location else ""
        return f"{self.tracer} failed {where}{at}: {self.message}"


def _loss_reads(root: _TraceRoot) -> str:
    """Why a loss_fn written for the model's whole output fails (see `_primary_output`)."""
    return (f"loss_fn(output, target) is given the tensor the model's output holds ({root._octopipe_reduced[0]}), "
            "not the whole output: write it for that tensor")


def _trace_error(model: nn.Module, failures: list[_Failure], method: str, root: _TraceRoot) -> TraceError:
    """One TraceError for the user; the tracers' own exceptions stay on `.causes` for debugging."""
    message = _failure_message(model, failures, method)
    if root.loss_name and root._octopipe_reduced and any(f.module == root.loss_name for f in failures):
        message += f"\nnote: {_loss_reads(root)}"
    error = TraceError(message)
    error.causes = tuple(failure.exception for failure in failures)
    return error


def _failure_message(model: nn.Module, failures: list[_Failure], method: str) -> str:
    name = type(model).__name__
    which = {
        "auto": "neither torch.fx nor torch.export could trace it",
        "fx": "torch.fx could not trace it",
        "export": "torch.export could not trace it",
    }[method]
    lines = [f"cannot trace {name}: {which}."]
    lines += [f"  {failure.describe()}" for failure in failures]
    module = next((f.module for f in failures if f.module), "")
    fixes = []
    if module:
        fixes.append(f"mark {module!r} a leaf module (trace(..., leaf_modules=({module!r},)), fx keeps it as one call)")
    fixes.append(
        "replace data-dependent Python control flow (`if tensor...:`, `.item()`, loops over tensor values) "
        "with tensor ops such as torch.where, or torch.cond"
    )
    if method == "auto":
        fixes.append("pass method='fx' or method='export' to see one tracer's error alone")
    elif method == "fx":
        fixes.append("pass method='export' (or 'auto') to trace with torch.export instead")
    else:
        fixes.append("pass method='fx' (or 'auto') to trace with torch.fx instead")
    lines.append("fix: " + "; or ".join(fixes))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- units and owners


def _is_block_container(module: nn.Module) -> bool:
    if isinstance(module, nn.ModuleList):
        return True
    if isinstance(module, nn.Sequential) and len(module) >= 2:
        kinds = {type(child) for child in module}
        only = next(iter(kinds))
        return len(kinds) == 1 and not only.__module__.startswith("torch.nn")
    return False


def _unit_paths(root: nn.Module, loss_name: str | None) -> list[str]:
    """Units in module-definition order (execution order is decided later from the graph)."""
    units: list[str] = []
    holds_blocks: dict[int, bool] = {}

    def has_blocks(module: nn.Module) -> bool:
        key = id(module)
        if key not in holds_blocks:
            holds_blocks[key] = any(_is_block_container(m) for m in module.modules())
        return holds_blocks[key]

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path == loss_name:
                units.append(path)
            elif _is_block_container(child):
                units.extend(f"{path}.{sub}" for sub, _ in child.named_children())
            elif has_blocks(child):
                visit(child, path + ".")
            else:
                units.append(path)

    visit(root, "")
    return units


def _owner_path(node: fx.Node, module_paths: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        if path in module_paths:
            return path
    return ""


def _find_unit(path: str, units: set[str]) -> str | None:
    while path:
        if path in units:
            return path
        path = path.rpartition(".")[0]
    return None


# ---------------------------------------------------------------------------- grouping


def _mutates(node: fx.Node) -> bool:
    """An in-place op (`buffer.add_(1)`, `x += 1` on a tensor, `copy_`): its result may go unused
    while its effect (a step counter, running statistics) is what counts."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS


_IN_PLACE_OPERATORS = frozenset(("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                                 "ixor", "ilshift", "irshift", "imatmul"))
"""operator.iadd and the like: what `x += y` on a traced tensor becomes."""


def _keeps_effects(node: fx.Node) -> bool:
    return node.is_impure() or _mutates(node)


def _build_graph(
    model: nn.Module,
    root: _TraceRoot,
    gm: fx.GraphModule,
    args: tuple[torch.Tensor, ...],
    method: str,
    split_points: tuple[str, ...],
) -> LayerGraph:
    graph = gm.graph
    graph.eliminate_dead_code(is_impure_node=_keeps_effects)
    module_paths = dict(root.named_modules())
    loss_name = root.loss_name
    unit_list = _unit_paths(root, loss_name)
    unit_set = set(unit_list)
    nodes = list(graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    skip_ops = ("placeholder", "get_attr", "output")
    owner = {node: _owner_path(node, module_paths) for node in nodes if node.op not in skip_ops}

    # 1. owned nodes -> units
    unit_of: dict[fx.Node, str] = {}
    for node, path in owner.items():
        unit = _find_unit(path, unit_set)
        if unit is not None:
            unit_of[node] = unit
    unit_names = list(dict.fromkeys(unit_of.values()))
    if not unit_names:  # no submodules at all: the whole model is one layer
        whole = type(model).__name__
        for node in owner:
            unit_of[node] = whole
        unit_names = [whole]
        module_paths = {**module_paths, whole: model}

    # split points inside a unit cut it at the split module's first node
    firsts: dict[str, int] = {}
    for point in split_points:
        first = _first_position(point, owner, position)
        if first is None:
            raise TraceError(
                f"trace: split point {point!r} runs no operations in the trace (it is never called, "
                "or it is inside a leaf module); pick a module that runs, or remove it from leaf_modules"
            )
        firsts[point] = first
    for point, first in sorted(firsts.items(), key=lambda item: item[1]):
        first_node = nodes[first]
        unit = unit_of.get(first_node)
        if unit is None or unit == point:
            continue
        unit_first = min(position[n] for n, u in unit_of.items() if u == unit)
        if unit_first < first:
            for node in list(unit_of):
                if unit_of[node] == unit and position[node] >= first:
                    unit_of[node] = point
            unit_names.append(point)

    first_pos: dict[str, int] = {}
    for node, unit in unit_of.items():
        first_pos[unit] = min(first_pos.get(unit, position[node]), position[node])

    # 2. nodes outside every unit: latest producing unit, else earliest consuming unit
    for node in nodes:
        if node.op in skip_ops or node in unit_of:
            continue
        producers = [unit_of[a] for a in node.all_input_nodes if a in unit_of]
        if producers:
            unit_of[node] = max(producers, key=first_pos.__getitem__)
    for node in reversed(nodes):
        if node.op in skip_ops or node in unit_of:
            continue
        consumers = [unit_of[u] for u in node.users if u in unit_of]
        if consumers:
            unit_of[node] = min(consumers, key=first_pos.__getitem__)
    ordered_units = sorted(first_pos, key=first_pos.__getitem__)
    for node in nodes:  # side-effect nodes (asserts) whose inputs were placed by the consumer rule
        if node.op in skip_ops or node in unit_of:
            continue
        producers = [unit_of[a] for a in node.all_input_nodes if a in unit_of]
        unit_of[node] = max(producers, key=first_pos.__getitem__) if producers else ordered_units[-1]

    # 3. merge units that depend on each other both ways, order the rest topologically
    successors: dict[str, set[str]] = defaultdict(set)
    for node, unit in unit_of.items():
        for source in node.all_input_nodes:
            other = unit_of.get(source)
            if other is not None and other != unit:
                successors[other].add(unit)
    components = _strongly_connected(ordered_units, successors)
    layer_units = _topological_components(components, successors, first_pos)
    layer_of_unit = {unit: index for index, group in enumerate(layer_units) for unit in group}
    layer_of: dict[fx.Node, int] = {node: layer_of_unit[unit] for node, unit in unit_of.items()}
    last_layer = len(layer_units) - 1
    for point, first in firsts.items():
        unit = unit_of[nodes[first]]
        group = layer_units[layer_of_unit[unit]]
        if group[0] != unit:
            raise TraceError(
                f"trace: cannot put a layer boundary before {point!r}: its first unit {unit!r} is merged with "
                f"{group[0]!r} into one layer ({'+'.join(group)}) because they exchange tensors both ways; "
                "split elsewhere, or restructure the model so data flows one way"
            )

    # 4. one get_attr per reading layer; output node in the last layer
    sort_key: dict[fx.Node, tuple[int, float]] = {}
    for node in nodes:
        if node.op == "placeholder":
            sort_key[node] = (-1, position[node])
        elif node.op == "output":
            layer_of[node] = last_layer
            sort_key[node] = (last_layer + 1, position[node])
        elif node.op != "get_attr" and not _is_input_size(node):
            sort_key[node] = (layer_of[node], position[node])
    for node in nodes:
        if node.op != "get_attr" and not _is_input_size(node):
            continue
        readers: dict[int, list[fx.Node]] = defaultdict(list)
        for user in node.users:
            readers[layer_of[user]].append(user)
        if not readers:
            layer_of[node] = 0
            sort_key[node] = (0, -1)
            continue
        for rank, layer in enumerate(sorted(readers)):
            users = readers[layer]
            first_user = min(users, key=position.__getitem__)
            copy = node
            if rank > 0:
                with graph.inserting_before(first_user):
                    copy = graph.node_copy(node)
                copy.meta = dict(node.meta)
                for user in users:
                    user.replace_input_with(node, copy)
            layer_of[copy] = layer
            sort_key[copy] = (layer, position[first_user] - 0.5)
    _reorder(graph, sorted(sort_key, key=sort_key.__getitem__))
    graph.lint()
    gm.recompile()

    # 5. shapes on the example batch
    try:
        recorder = _propagate(gm, args)
    except _NodeFailure as failure:
        failed_layer = layer_of.get(failure.node)
        layer_name = "+".join(layer_units[failed_layer]) if failed_layer is not None else "inputs"
        hint = "If this module branches on tensor values, mark it a leaf module and trace on real (not meta) tensors"
        if layer_name == loss_name and root._octopipe_reduced:
            hint = _loss_reads(root)
        elif layer_name == loss_name and args and hasattr(args[-1], "shape"):
            shapes = ", ".join(f"input {i} {tuple(t.shape)}" for i, t in enumerate(args[:-1]) if hasattr(t, "shape"))
            hint = (f"The loss got the model's output and the target {tuple(args[-1].shape)} ({shapes}): check "
                    "that example_target is the target of this example batch (the same rows) and that loss_fn "
                    "takes (output, target)")
        raise TraceError(
            f"trace: shape propagation failed at node {failure.node.name!r} ({failure.node.op} {_target_name(failure.node)}) "
            f"in layer {layer_name!r}: {failure.message}. {hint}"
        ) from None
    values = recorder.values
    for node in graph.nodes:
        node.meta["octopipe.value"] = values.get(node.name)
    if loss_name is not None:
        _check_scalar_loss(graph, values)
    for node, example in zip([n for n in graph.nodes if n.op == "placeholder"], args):
        node.meta["octopipe.example"] = example
    gm.meta["octopipe.modules"] = module_paths
    gm.meta["octopipe.loss"] = loss_name
    gm.meta["octopipe.layer_of"] = {node.name: layer for node, layer in layer_of.items()}
    gm.meta["octopipe.leaf_updates"] = recorder.leaf_updates

    return _assemble(model, root, gm, layer_units, layer_of, values, module_paths, method, loss_name)


def _check_scalar_loss(graph: fx.Graph, values: dict[str, Any]) -> None:
    """The traced loss must be one number: the pipeline sums microbatch losses and backpropagates
    from them (a per-sample loss would need a reduction the model does not say)."""
    output = next(node for node in graph.nodes if node.op == "output")
    loss = output.args[0]
    if isinstance(loss, (tuple, list)) and len(loss) == 1:  # torch.export returns a tuple of outputs
        loss = loss[0]
    value = values.get(loss.name) if isinstance(loss, fx.Node) else loss
    if not isinstance(value, ValueInfo) or not value.is_tensor or value.items or value.numel != 1:
        shape = value.shape if isinstance(value, ValueInfo) and value.is_tensor and not value.items else "not a tensor"
        raise TraceError(f"trace: loss_fn(output, target) must return a scalar (the batch's mean loss), got {shape}; "
                         "reduce it, e.g. F.cross_entropy(..., reduction='mean')")


def _is_input_size(node: fx.Node) -> bool:
    """A size read of a model input (`sym_size(input_ids, 1)`, `input_ids.size(1)`): copied into
    each layer that needs it, like a parameter, rather than sent between layers as an int."""
    if not node.all_input_nodes or any(a.op != "placeholder" for a in node.all_input_nodes):
        return False
    if node.op == "call_method":
        return node.target in ("size", "dim")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name in ("sym_size", "sym_size.int") or str(node.target) == "aten.sym_size.int"
    return False


def _first_position(point: str, owner: dict[fx.Node, str], position: dict[fx.Node, int]) -> int | None:
    prefix = point + "."
    found = [position[n] for n, path in owner.items() if path == point or path.startswith(prefix)]
    return min(found) if found else None


def _strongly_connected(units: list[str], successors: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in units:
        if start in index:
            continue
        work = [(start, iter(sorted(successors.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            unit, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[unit] = min(low[unit], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[unit])
            if low[unit] == index[unit]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == unit:
                        break
                components.append(component)
    return components


def _topological_components(
    components: list[list[str]], successors: dict[str, set[str]], first_pos: dict[str, int]
) -> list[list[str]]:
    """Kahn's algorithm over the merged units, earliest-executed first among the ready ones."""
    comp_of = {unit: i for i, comp in enumerate(components) for unit in comp}
    key = [min(first_pos[u] for u in comp) for comp in components]
    indegree = [0] * len(components)
    edges: dict[int, set[int]] = defaultdict(set)
    for unit, targets in successors.items():
        for target in targets:
            a, b = comp_of[unit], comp_of[target]
            if a != b and b not in edges[a]:
                edges[a].add(b)
                indegree[b] += 1
    ready = [(key[i], i) for i in range(len(components)) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[list[str]] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(sorted(components[i], key=first_pos.__getitem__))
        for j in edges[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, (key[j], j))
    return order


def _reorder(graph: fx.Graph, order: list[fx.Node]) -> None:
    current = list(graph.nodes)
    if current == order:
        return
    anchor = order[0]
    if current[0] is not anchor:
        current[0].prepend(anchor)
    for node in order[1:]:
        if anchor.next is not node:
            anchor.append(node)
        anchor = node


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


# ---------------------------------------------------------------------------- shape propagation


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """What shape propagation saw for one node: a tensor (shape, dtype), a Python scalar
    (shape (), dtype 'int'/'float'/'bool'), or a tuple of those (`items`)."""

    shape: tuple[int, ...]
    dtype: str
    is_tensor: bool = True
    items: tuple[ValueInfo | None, ...] = ()

    @property
    def numel(self) -> int:
        total = 1
        for dim in self.shape:
            total *= dim
        return total


def _describe(value: Any) -> ValueInfo | None:
    if isinstance(value, torch.Tensor):
        return ValueInfo(tuple(int(d) for d in value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        kind = {torch.SymInt: "int", torch.SymFloat: "float", torch.SymBool: "bool"}.get(
            type(value), type(value).__name__
        )
        return ValueInfo((), kind, is_tensor=False)
    if isinstance(value, (tuple, list)):
        return ValueInfo((), "tuple", is_tensor=False, items=tuple(_describe(v) for v in value))
    if isinstance(value, torch.Size):
        return ValueInfo((), "tuple", is_tensor=False)
    return None


class _NodeFailure(Exception):
    def __init__(self, node: fx.Node, exc: BaseException) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        super().__init__(f"{type(exc).__name__}: {first[:300]}")
        self.node = node
        self.message = f"{type(exc).__name__}: {first[:300]}"


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.values: dict[str, ValueInfo | None] = {}
        self.leaf_updates: dict[str, list[str]] = {}
        """Buffers a leaf module's call changed in place (its own code or its hooks: a spectral
        norm's power iteration), by the module's path: the graph shows only the call."""

    def run_node(self, n: fx.Node) -> Any:
        buffers = list(self.module.get_submodule(str(n.target)).named_buffers()) if n.op == "call_module" else []
        versions = [buffer._version for _, buffer in buffers]
        try:
            result = super().run_node(n)
        except _NodeFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - reported with the node that failed
            raise _NodeFailure(n, exc) from exc
        self.values[n.name] = _describe(result)
        changed = [name for (name, buffer), version in zip(buffers, versions) if buffer._version != version]
        if changed:
            self.leaf_updates[str(n.target)] = changed
        return result


def _tensors_of(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def propagate_shapes(gm: fx.GraphModule, args: Sequence[Any], *, mode: str = "auto") -> dict[str, ValueInfo | None]:
    """Run `gm` on `args` without keeping results, recording each node's output shape and dtype.

    mode "auto": meta tensors when the module or an input is on the meta device, real tensors
    (no autograd) when everything is real; "fake": FakeTensors (no memory, no compute, any size);
    "real" / "meta" force one. A failing node raises `_NodeFailure` naming it.
    """
    return _propagate(gm, args, mode).values


def _propagate(gm: fx.GraphModule, args: Sequence[Any], mode: str = "auto") -> _Recorder:
    """propagate_shapes, keeping its recorder (the values, and the buffers leaf modules changed)."""
    tensors = list(_tensors_of(gm))
    any_meta = any(t.is_meta for t in tensors) or any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    all_meta = all(t.is_meta for t in tensors)
    if mode == "auto":
        mode = ("meta" if all_meta else "fake") if any_meta else "real"
    recorder = _Recorder(gm)
    if mode == "meta":
        meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        with torch.no_grad():
            recorder.run(*meta_args)
    elif mode == "real":
        with torch.no_grad():
            recorder.run(*args)
    elif mode == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, torch.no_grad():
            fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            recorder.run(*fake_args)
    else:
        raise ValueError(f"propagate_shapes: unknown mode {mode!r}")
    return recorder


# ---------------------------------------------------------------------------- the LayerGraph


def _assemble(
    model: nn.Module,
    root: _TraceRoot,
    gm: fx.GraphModule,
    layer_units: list[list[str]],
    layer_of: dict[fx.Node, int],
    values: dict[str, ValueInfo | None],
    module_paths: dict[str, nn.Module],
    method: str,
    loss_name: str | None,
) -> LayerGraph:
    canonical: dict[int, str] = {}
    for name, parameter in root.named_parameters():
        canonical.setdefault(id(parameter), name)
    layer_nodes: dict[int, list[str]] = defaultdict(list)
    layer_params: dict[int, dict[str, int]] = defaultdict(dict)
    placeholders: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
            continue
        layer = layer_of[node]
        layer_nodes[layer].append(node.name)
        read: list[torch.Tensor] = []
        if node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            if isinstance(value, nn.Parameter):
                read.append(value)
        elif node.op == "call_module":
            read.extend(gm.get_submodule(str(node.target)).parameters())
        for tensor in read:
            qualified = canonical.get(id(tensor))
            if qualified is not None:
                layer_params[layer][qualified] = tensor.numel()

    edges: list[TensorEdge] = []
    for node in gm.graph.nodes:
        producer = -1 if node.op == "placeholder" else layer_of[node]
        consumers = sorted({layer_of[user] for user in node.users if layer_of[user] != producer})
        if node.op != "placeholder" and not consumers:
            continue
        info = values.get(node.name)
        shape = info.shape if info is not None and info.is_tensor else ()
        dtype = info.dtype if info is not None else ""
        edges.append(TensorEdge(node.name, producer, tuple(consumers), shape, dtype))

    layers: list[Layer] = []
    for index, units in enumerate(layer_units):
        kinds = [_unit_kind(unit, module_paths.get(unit), loss_name) for unit in units]
        kind = "loss" if "loss" in kinds else kinds[0]
        main = module_paths.get(units[0])
        if units[0] == loss_name and main is not None and isinstance(main, _LossModule):
            module_type = getattr(main.fn, "__name__", type(main.fn).__name__)
        else:
            module_type = type(main).__name__ if main is not None else ""
        params = layer_params[index]
        layers.append(
            Layer(
                index=index,
                name="+".join(units),
                kind=kind,
                module_type=module_type,
                modules=tuple(units),
                parameters=tuple(params),
                num_params=sum(params.values()),
                nodes=tuple(layer_nodes[index]),
            )
        )
    layers = _mark_head(layers, module_paths)
    readers: dict[str, list[int]] = defaultdict(list)
    for graph_layer in layers:
        for name in graph_layer.parameters:
            readers[name].append(graph_layer.index)
    shared = tuple(SharedParameter(name, tuple(idx)) for name, idx in readers.items() if len(idx) > 1)
    return LayerGraph(
        model=type(model).__name__,
        inputs=tuple(node.name for node in placeholders),
        layers=tuple(layers),
        edges=tuple(edges),
        shared=shared,
        method=method,
        module=gm,
    )


def _get_attr(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def _unit_kind(path: str, module: nn.Module | None, loss_name: str | None) -> str:
    if path == loss_name:
        return "loss"
    parts = path.lower().split(".")
    last = parts[-1]
    class_name = type(module).__name__ if module is not None else ""
    has_params = module is not None and any(True for _ in module.parameters())
    in_container = len(parts) >= 2 and parts[-1].isdigit()
    vision = any(part.startswith(_VISION_WORDS) for part in parts[:-1]) or "vision" in class_name.lower()
    if in_container:
        return "vision_block" if vision else "block"
    if isinstance(module, nn.Embedding) or (
        has_params and ("embed" in last or "Embed" in class_name or last in ("wte", "wpe"))
    ):
        return "embedding"
    if "Norm" in class_name or last.endswith("norm") or last.startswith(("ln_", "norm")):
        return "norm"
    if any(word in last for word in _PROJECTOR_WORDS):
        return "projector"
    if any(word in last for word in _HEAD_WORDS):
        return "head"
    return "other"


def _mark_head(layers: list[Layer], module_paths: dict[str, nn.Module]) -> list[Layer]:
    """When no layer is named like a head, the last Linear-like layer before the loss is it."""
    if any(layer.kind == "head" for layer in layers):
        return layers
    for layer in reversed(layers):
        if layer.kind == "loss":
            continue
        module = module_paths.get(layer.modules[0])
        weight = getattr(module, "weight", None)
        if layer.kind == "other" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            layers[layer.index] = Layer(
                layer.index,
                layer.name,
                "head",
                layer.module_type,
                layer.modules,
                layer.parameters,
                layer.num_params,
                layer.nodes,
            )
        break
    return layers
