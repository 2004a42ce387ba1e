"""split-backward: rewrite a stage's fx GraphModule so B computes input gradients and W weight gradients.

Consumes a torch.fx GraphModule (one pipeline stage, as `passes/codegen.py` cuts it); produces a new
GraphModule sharing the same parameters (same qualified names) whose linear ops run through
`SplitLinear`, plus the names of the parameters whose gradients move to W.

How: every linear op with a parameter weight (`nn.Linear` call_module, unless calling it is more
than its op: a parametrization, a weight set by a hook, any hook; `F.linear` / `aten.linear`, and
`mm` / `addmm` / `matmul` against `t(weight)`) becomes `split_linear(x, weight, bias)`, a custom
autograd Function. Its backward always returns the input gradient. When a `WeightGradStash` is
active (`runtime.stage.deferred_weight_grads`, which the engine opens around a B), it stashes
(input, grad_output) instead of computing the weight and bias gradients; `stash.run()` at W
computes them with the same matmuls autograd would use and accumulates them into `.grad`. Without an
active stash it computes everything at once, so a full backward is unchanged.

Only linear layers split. Other parameters (norm weights, embeddings, convolutions, MoE expert
tensors used through einsum) get their gradients in B; their weight-gradient work is small next to
the linear layers' in the models OctoPipe targets. Gradients are exactly those of one full backward
(the same matmuls; tolerance only for summation order where a weight is used twice, e.g. a tied
head). Cost: B + W does the same matmuls as a full backward plus one Python call per linear.
Under torch.autocast `SplitLinear` casts its operands as autocast casts a linear's (the matmuls in
autocast's dtype, the gradients cast back to the parameters' dtype), so B and W match autocast's
own backward.

With torch.compile (`compile_safe=True`), `split_linear` is excluded from compilation (a graph
break per linear): a compiled backward would bake in the stash check at trace time.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from octopipe.runtime.stage import accumulate_grad, active_weight_grad_stash

NAME = "split-backward"


def _weight_grads(weight: Tensor | None, bias: Tensor | None, inputs: Tensor, grad_output: Tensor) -> None:
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    if weight is not None:
        accumulate_grad(weight, grad_2d.t().mm(inputs.reshape(-1, inputs.shape[-1])))
    if bias is not None:
        accumulate_grad(bias, grad_2d.sum(0))


class SplitLinear(torch.autograd.Function):
    """y = x @ weight.T + bias whose weight/bias gradients can be deferred to W."""

    @staticmethod
    def forward(ctx: Any, inputs: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.weight, ctx.bias = weight, bias  # the parameters W accumulates into
        device = inputs.device.type
        if torch.is_autocast_enabled(device):  # as autocast runs a linear: operands cast, the matmul in its dtype
            dtype = torch.get_autocast_dtype(device)
            inputs, weight = _cast(inputs, dtype), _cast(weight, dtype)
            bias = _cast(bias, dtype) if bias is not None else None
            ctx.save_for_backward(inputs, weight)
            with torch.autocast(device, enabled=False):
                return F.linear(inputs, weight, bias)
        ctx.save_for_backward(inputs, weight)
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        # under autocast: the saved operands and grad_output are in its dtype, and so are the
        # gradients; autograd casts the returned ones to the inputs' dtypes, W's accumulate casts
        inputs, weight = ctx.saved_tensors
        bias = ctx.bias
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        need_weight = ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        if not (need_weight or need_bias):
            return grad_input, None, None
        stash = active_weight_grad_stash()
        if stash is not None and (not need_weight or ctx.weight.is_leaf) and (not need_bias or bias.is_leaf):
            stash.add(_weight_grads, ctx.weight if need_weight else None, bias if need_bias else None, inputs, grad_output)
            return grad_input, None, None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_2d.t().mm(inputs.reshape(-1, inputs.shape[-1])) if need_weight else None
        grad_bias = grad_2d.sum(0) if need_bias else None
        return grad_input, grad_weight, grad_bias


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def split_linear(inputs: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return SplitLinear.apply(inputs, weight, bias)


split_linear_uncompiled = torch.compiler.disable(split_linear)
"""`split_linear` for modules that torch.compile will compile (a graph break keeps the stash live)."""
split_linear_uncompiled.__name__ = split_linear_uncompiled.__qualname__ = "split_linear_uncompiled"  # pickled by name


class _Retracer(fx.Tracer):
    """What unpickling a stage's GraphModule traces its code with (`GraphModule.__reduce__` keeps
    the code, not the graph): the split linears stay calls, as in the graph pickled."""

    def __init__(self) -> None:
        super().__init__(autowrap_functions=(split_linear, split_linear_uncompiled))

_LINEAR_TARGETS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default}
_TRANSPOSES = {torch.ops.aten.t.default, torch.t, torch.Tensor.t}
_MM_TARGETS = {torch.ops.aten.mm.default, torch.mm, torch.matmul, operator.matmul}
_ADDMM_TARGETS = {torch.ops.aten.addmm.default, torch.addmm}


def _attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _plain_linear(module: nn.Linear) -> bool:
    """Whether calling `module` is just its linear op on its own parameters: no parametrization
    (`weight` computed from another parameter, as `parametrizations.spectral_norm` does: a split
    would accumulate into the computed tensor and skip the power iteration), no weight set by a
    hook (`utils.spectral_norm`, `weight_norm`) and no hook the split call would skip."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
             getattr(module, "_backward_pre_hooks", {}))
    return (not parametrize.is_parametrized(module) and isinstance(module._parameters.get("weight"), nn.Parameter)
            and not any(hooks))


def _parameter_node(module: nn.Module, node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr" and isinstance(_attr(module, str(node.target)), nn.Parameter)


def _transposed_parameter(module: nn.Module, node: Any) -> fx.Node | None:
    """The get_attr of W when node is `t(W)` (aten.t, torch.t, W.t()) or W.T, else None."""
    if not isinstance(node, fx.Node):
        return None
    transposes = (
        (node.op == "call_function" and node.target in _TRANSPOSES)
        or (node.op == "call_method" and node.target == "t")
        or (node.op == "call_function" and node.target is getattr and node.args[1] == "T")
    )
    weight = node.args[0] if transposes else None
    return weight if isinstance(weight, fx.Node) and _parameter_node(module, weight) else None


def split_operands(module: nn.Module, node: fx.Node) -> tuple[Any, Any, Any] | None:
    """(input, weight get_attr, bias get_attr or None) of `node` in `module`'s graph where it is a
    linear op `split_backward` splits, else None. A call_module node's weight and bias are given
    as their qualified names (`split_backward` adds their get_attr nodes)."""
    if node.op == "call_module":
        sub = module.get_submodule(str(node.target))
        if (type(sub).forward is nn.Linear.forward and isinstance(sub, nn.Linear) and not node.kwargs
                and len(node.args) == 1 and _plain_linear(sub)):
            return (node.args[0], f"{node.target}.weight", f"{node.target}.bias" if sub.bias is not None else None)
    elif node.op == "call_function" and node.target in _LINEAR_TARGETS:
        args = list(node.args) + [None] * (3 - len(node.args))
        inputs = node.kwargs.get("input", args[0])
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        if _parameter_node(module, weight) and (bias is None or _parameter_node(module, bias)):
            return (inputs, weight, bias)
    elif node.op == "call_function" and node.target in _MM_TARGETS and len(node.args) == 2 and not node.kwargs:
        transposed = _transposed_parameter(module, node.args[1])
        if transposed is not None:
            return (node.args[0], transposed, None)
    elif node.op == "call_function" and node.target in _ADDMM_TARGETS and len(node.args) == 3 and not node.kwargs:
        transposed = _transposed_parameter(module, node.args[2])
        addend = node.args[0]
        if (transposed is not None and isinstance(addend, fx.Node) and _parameter_node(module, addend)
                and _attr(module, str(addend.target)).dim() == 1):
            return (node.args[1], transposed, addend)
    return None


def split_backward(module: fx.GraphModule, compile_safe: bool = False) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A copy of `module` (same parameter objects and names) with its linear ops split; and the
    qualified names of the parameters whose gradients W computes (in graph order, unique)."""
    graph = copy.deepcopy(module.graph)
    function = split_linear_uncompiled if compile_safe else split_linear
    deferred: list[str] = []

    def get_attr(anchor: fx.Node, target: str) -> fx.Node:
        with graph.inserting_before(anchor):
            return graph.get_attr(target)

    for node in list(graph.nodes):
        replacement = split_operands(module, node)
        if replacement is not None and node.op == "call_module":
            inputs, weight, bias = replacement
            replacement = (inputs, get_attr(node, weight), get_attr(node, bias) if bias is not None else None)
        if replacement is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(function, replacement)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        dropped = [arg for arg in node.args if isinstance(arg, fx.Node)]
        graph.erase_node(node)
        erased: set[fx.Node] = set()
        while dropped:  # the transposes the old op alone read
            arg = dropped.pop()
            if arg in erased or arg.users or arg in replacement or arg.op not in ("get_attr", "call_function", "call_method"):
                continue
            dropped += [a for a in arg.args if isinstance(a, fx.Node)]
            graph.erase_node(arg)
            erased.add(arg)
        for param in replacement[1:]:
            if param is not None and str(param.target) not in deferred:
                deferred.append(str(param.target))
    graph.lint()
    result = fx.GraphModule(module, graph, class_name=type(module).__name__)
    result._tracer_cls = _Retracer  # unpickled (in a spawned process) with its split linears kept
    return result, tuple(deferred)
