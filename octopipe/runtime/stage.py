"""The contract between codegen (`passes/codegen.py`) and the runtime: what a stage is.

Consumed by `runtime/engine.py`; produced by `passes/codegen.py` (or by hand in tests). Nothing here
imports from `passes/`.

Glossary: a *stage* is one fx GraphModule cut from the traced model; its *inputs* come from the
batch (model inputs and the target, present on every rank, never sent) or from outputs of earlier
stages; its *outputs* are the tensors later stages read, each with a per-microbatch shape and the
stages that consume it. The loss stage returns `(loss,)`: the microbatch's mean loss.

Message contents (what a send between two stages carries), defined once here so that sender and
receiver agree without talking:

- activations `p -> c`: the outputs `j` of stage p with `c in outputs[j].consumers`, in ascending j;
  the consumer reads exactly these as its inputs with `source.stage == p` (ascending index);
- gradients `c -> p`: the gradients of those same tensors that have `requires_grad`, same order.
  A gradient message with no tensors is a no-op on both sides.

Weight-gradient deferral (zero-bubble B/W split): a rewritten linear op (`passes/split_backward.py`)
asks `active_weight_grad_stash()` in its backward; when the engine runs a B (`backward_input`) it
activates a `WeightGradStash`, the op stashes what the weight gradient needs instead of computing
it, and the engine runs the stash at W (`backward_weight`). The active stash is a module global,
not a thread-local: on GPU, autograd runs backward functions on its own device threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

BATCH = -1
"""`TensorSource.stage` of a batch tensor (a model input or the target)."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor per microbatch: its shape, dtype, whether it carries a gradient, and readers."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    consumers: tuple[int, ...] = ()
    """Stages that read it (empty for the loss and for batch inputs)."""

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        grad = " grad" if self.requires_grad else ""
        readers = f" -> {','.join(map(str, self.consumers))}" if self.consumers else ""
        return f"{self.name}: {dims} {str(self.dtype).removeprefix('torch.')}{grad}{readers}"


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where a stage input comes from: batch position `index` (stage == BATCH) or output `index`
    of stage `stage`; `spec` is that tensor's spec (for batch inputs, consumers are empty)."""

    stage: int
    index: int
    spec: TensorSpec

    @property
    def is_batch(self) -> bool:
        return self.stage == BATCH

    def __str__(self) -> str:
        where = f"batch[{self.index}]" if self.is_batch else f"stage {self.stage} output {self.index}"
        return f"{where} ({self.spec})"


@dataclass(eq=False)
class StageModule:
    """One pipeline stage: `module(*inputs)` returns a tuple with one tensor per `outputs` entry
    (the loss stage: `(loss,)`, and `outputs` is then the single loss spec with `is_loss`)."""

    index: int
    module: nn.Module
    inputs: tuple[TensorSource, ...]
    outputs: tuple[TensorSpec, ...]
    is_loss: bool = False
    parameter_names: Mapping[str, str] = field(default_factory=dict)
    """Local qualified name (in `module`) -> the original model's name, for parameters and buffers
    whose names differ (a tied head weight maps to the embedding's name). Absent = unchanged."""
    owners: tuple[nn.Module, ...] = ()
    """The original model's modules that own this stage's parameters and buffers directly (an
    `nn.Linear` whose weight a rewritten stage reads by attribute is no submodule of `module`):
    where a rank that builds a meta-device model's stages runs its init (`runtime/materialize.py`)."""
    recompute: bool = False
    """Activation recomputation: the engine runs F without keeping the autograd graph (it keeps the
    inputs and the RNG state) and runs the forward again, with that RNG state, at the start of B."""
    selective: bool = False
    """Selective recomputation: the engine runs F under `selective_checkpoint`, which keeps the
    outputs of the compute-heavy ops (`SELECTIVE_SAVED_OPS`) and recomputes the rest in B."""
    compiled: bool = False
    """Run `module` under torch.compile (`compile(compile_stages=True)`). The compiled callable is
    made where the stage first runs and is not pickled (torch.compile's wrapper does not pickle),
    so a pipeline of compiled stages travels to spawned ranks as an eager one does."""
    _compiled_call: Any = field(default=None, init=False, repr=False, compare=False)

    def __call__(self, *args: Any) -> Any:
        """`module(*args)`, under torch.compile where the stage is `compiled`."""
        if not self.compiled:
            return self.module(*args)
        if self._compiled_call is None:
            self._compiled_call = torch.compile(self.module)
        return self._compiled_call(*args)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled_call"] = None  # made again where the stage runs
        return state

    def original_name(self, local_name: str) -> str:
        return self.parameter_names.get(local_name, local_name)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original name, parameter), each parameter once."""
        seen: set[int] = set()
        for local, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield self.original_name(local), param

    def producers(self) -> tuple[int, ...]:
        return tuple(sorted({src.stage for src in self.inputs if not src.is_batch}))

    def consumers(self) -> tuple[int, ...]:
        return tuple(sorted({c for spec in self.outputs for c in spec.consumers}))

    def outputs_to(self, consumer: int) -> tuple[int, ...]:
        """Output indices an activation message to `consumer` carries, in order."""
        return tuple(j for j, spec in enumerate(self.outputs) if consumer in spec.consumers)

    def inputs_from(self, producer: int) -> tuple[int, ...]:
        """Input positions an activation message from `producer` fills, in message order."""
        positions = [i for i, src in enumerate(self.inputs) if src.stage == producer]
        return tuple(sorted(positions, key=lambda i: self.inputs[i].index))

    def describe(self) -> str:
        how = " (recompute)" if self.recompute else " (selective recompute)" if self.selective else ""
        lines = [f"stage {self.index}{' (loss)' if self.is_loss else ''}{how}"]
        lines += [f"  in  {src}" for src in self.inputs]
        lines += [f"  out {spec}" for spec in self.outputs]
        return "\n".join(lines)


def _selective_saved_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


SELECTIVE_SAVED_OPS = _selective_saved_ops()
"""The ops whose outputs selective recomputation keeps (matmuls, attention, convolutions: the
compute-heavy ones); every other op of the stage's forward runs again in B (an embedding lookup
too: a gather, and its output is far larger than the indices it needs). `passes/costs.py` prices
it with the same split."""


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` under selective activation checkpointing (PyTorch's non-reentrant
    checkpoint with a policy): autograd keeps the inputs and the outputs of `SELECTIVE_SAVED_OPS`,
    and the backward runs the rest of the forward again first, with the RNG state and autocast
    of the call (so dropout masks and results are the same as without it)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy))


def stage_links(stages: Iterable[StageModule]) -> frozenset[tuple[int, int]]:
    """(producer stage, consumer stage) pairs that exchange tensors: the `links` of `lower()`."""
    return frozenset((src.stage, stage.index) for stage in stages for src in stage.inputs if not src.is_batch)


# -- weight-gradient deferral -----------------------------------------------------------------


class WeightGradStash:
    """Weight-gradient work deferred from a B to its W: `(function, args)` entries run in order."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def add(self, function: Callable[..., None], *args: Any) -> None:
        self.entries.append((function, args))

    def run(self) -> None:
        entries, self.entries = self.entries, []
        for function, args in entries:
            function(*args)

    def __len__(self) -> int:
        return len(self.entries)


_active_stash: WeightGradStash | None = None


def active_weight_grad_stash() -> WeightGradStash | None:
    """The stash a split op should defer its weight gradient into, or None (compute it now)."""
    return _active_stash


@contextmanager
def deferred_weight_grads(stash: WeightGradStash) -> Iterator[WeightGradStash]:
    """Within this block, split ops defer weight gradients into `stash`."""
    global _active_stash
    previous, _active_stash = _active_stash, stash
    try:
        yield stash
    finally:
        _active_stash = previous


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, as autograd's AccumulateGrad would (in the parameter's dtype: a
    gradient computed under autocast is cast, as autocast's own cast op passes it back)."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)
