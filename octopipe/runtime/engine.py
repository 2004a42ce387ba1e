"""Engine: runs one rank's RankProgram over its StageModules, one training iteration per `step`.

Consumes the rank's `StageModule`s (runtime/stage.py) and its `RankProgram` (ir/program.py);
produces the loss (on every rank) and the gradients in `.grad` of this rank's parameters.
Nothing here imports from passes/: the program and the stages are all it needs.

Semantics per instruction (the ones `passes/verify.py` proves deadlock-free):
- `recv_*` posts a non-blocking receive into fresh buffers (shapes from the stage specs);
- `send_*` starts a non-blocking send of data that exists (kept alive until `step`);
- `forward` / `backward*` wait only for their own received inputs, then compute; transfers run
  beside compute (gloo's threads on CPU, a communication stream on GPU);
- same-rank stage hand-offs are local: the consumer gets a detached leaf of the producer's output;
- every stage's inputs are leaves, so each stage's backward is separate: B (`backward` or
  `backward_input`) backpropagates its outputs' gradients (the loss stage: the microbatch's
  weight, 1 / num_microbatches or its share of `loss_weight`, see `Engine`) into parameters and
  input leaves, whose gradients go to the producers; `backward_input` opens a
  `WeightGradStash` so split linear layers defer weight gradients, and `backward_weight` runs it;
  a microbatch's activations are dropped as soon as its last backward op on the stage ran;
- with `autocast` (bf16 or fp16; `runtime/amp.py`) every forward, a recomputing stage's second
  one included, runs under torch.autocast on the engine's device; backward runs outside it; fp16
  scales the loss stage's backward by the `LossScaler`'s scale and `step` unscales and checks
  every gradient (all ranks agree: an inf or nan anywhere drops every gradient, see amp.py);
- a `recompute` stage runs F under no_grad, keeping its inputs, the RNG state (CPU, and the
  engine's CUDA device) and a copy of its buffers, and its B first runs the forward again with
  grad on those inputs, that RNG state (the same dropout masks; the RNG stream outside is left as
  it was, as `torch.utils.checkpoint` does) and those buffers (`_BuffersAtForward`; the stage's
  own are left as they are), then backpropagates as above; its sent outputs are F's values;
- a `selective` stage runs F under `selective_checkpoint`: autograd keeps its inputs and the
  outputs of its matmuls and attention, and its B's backward first runs the
  other ops of the forward again (same RNG state and autocast, and the buffers as F found them:
  the same values);
- `reduce_tied` starts a sum all-reduce of a tied parameter's gradient among the ranks holding
  it (a process group per tied rank set, created collectively in the constructor); a frozen one
  (`requires_grad=False`) keeps no gradient;
- `step` waits for outstanding sends and reductions and all-reduces the loss: every rank returns
  the microbatch losses' weighted sum (their mean, without `loss_weight`).

Data parallelism (`data_parallel` = D, `Replicas`): the world's ranks are D copies of the
pipeline, rank = pipeline rank x D + replica; messages go to the peer's rank in the same replica,
tied groups and the clipping norm stay within a replica, every microbatch weighs 1/D of its share
(a `loss_weight` count is summed over the replicas), and `step` sums this step's gradients over the
D copies of each pipeline rank before adding back what earlier steps accumulated: a bucket per
stage, started (asynchronously, a flat all-reduce per dtype) as soon as the stage's last backward
instruction on the rank has run, so it overlaps the rest of the backward; the parameters tied
across ranks after their tied all-reduce, at `step`. The engine starts by broadcasting replica 0's parameters and
buffers to the others, as DDP does.

Sharded optimizer state (`shard_optimizer=True`, ZeRO stage 1, with the gradient reduction of
Megatron's distributed optimizer): the D copies of a pipeline rank split its parameters between
them evenly at row boundaries (`shard_rows`: each bucket cut into D equal runs of elements, as
Megatron cuts each bucket's buffer; a row, a slice along dim 0, goes to the replica whose run
holds its middle element), each builds its optimizer over its own rows only
(`optimizer_parameters`: a parameter cut between replicas comes as a parameter viewing its rows
of the weight), so it holds 1/D of the optimizer's state to within a row at each cut, and every
`optimizer.step()` ends (a post-step hook) by broadcasting each replica's updated rows to the
other copies. The optimizer must be element-wise (`ELEMENTWISE_OPTIMIZERS`): an update of some
rows alone must be that of the whole parameter. Each bucket's gradients are summed onto the
replica stepping each row only (a flat reduce per replica and dtype: a reduce-scatter's bytes,
half an all-reduce's, as Megatron's distributed optimizer moves them), so after `step` a copy
holds the summed gradients of its rows and None for a parameter with none of them;
`clip_grad_norm_` gathers the rows' terms of the norm, totals each parameter's and then them in
the unsharded order. With 2 replicas (a sum of two is the same in any order) the updates, and the
whole run, are those of the unsharded optimizer bit for bit (the norm, where a parameter is cut,
to float64 rounding); with more, to the rounding of the summation order. A checkpoint's state
for a cut parameter is joined from the replicas' rows (`merge_state_dicts`) and cut again to
the rows of whoever loads it (`saved_rows`). Every copy must step its optimizer each time (the broadcast is collective over
the D copies). With `overlap_param_gather=True` (Megatron's `--overlap-param-gather`) the step
only starts the broadcasts, one per stage, owner and dtype, and each stage's first forward of the
next `step` (or `evaluate`) waits for its own, so they run beside the forwards before it; reading,
saving or loading the state waits for all of them, and `finish_param_sync()` does so for a caller
that reads the parameters in between. The values, and the run, are those without it bit for bit.

Master weights (`master_weights=True`, Megatron's `--bf16` with its fp32 main parameters): for a
model whose weights are bf16, the optimizer steps an fp32 copy of each bf16 weight that trains
(`optimizer_parameters()` gives the copies, built when the optimizer is attached; with
`shard_optimizer` only of this replica's rows of each). Forwards, backwards, the gradients and
their reductions stay bf16, as the weights; before the optimizer's step each copy's gradient is
its weight's cast up (after clipping), and after it each weight is rounded from its copy, before
a sharded state sends it on. The copies are checkpointed in the optimizer's state (`MASTER_KEY`
beside each entry) and restored by `load_state_dict`; where a checkpoint has none the copies take
the loaded weights. Memory: the bf16 weight and gradient plus the fp32 copy and the optimizer's
fp32 state (`MemoryModel.for_optimizer(..., master_weights=True)`; mixed-adam is this with Adam).
With `fp32_grads` (the default with master weights since stop 46, as Megatron's
`--accumulate-allreduce-grads-in-fp32` is under `--bf16`; `fp32_grads=False` is its
`--grad-reduce-in-bf16`), every backward instruction adds what it left in the bf16 weights' `.grad` into an fp32
gradient and clears `.grad` (as Megatron's hook adds it to `main_grad`): the microbatches' sum, the
tied and data-parallel reductions, clipping and the copies' step all take the fp32 gradients
(`main_grads()`), 4 bytes a weight (`MemoryModel.for_optimizer(..., fp32_grads=True)`).

`evaluate(inputs, target)` (validation) runs the same program without its backward half (receives,
forwards, sends, the loss all-reduce) with every stage module in eval mode and no autograd graph.

Gradients accumulate into `.grad` like `loss.backward()` (with `fp32_grads`, into `main_grads()`
for the bf16 weights); call `zero_grad()` (or
`optimizer_step()`, which steps the attached optimizer and zeroes) between iterations.

State and checkpoints, keyed by the original model's parameter names so they move across plans,
rank counts and the plain model: `state_dict()` is this rank's shard {"model": {name: tensor},
"optimizer": {"state": {name: ...}, "param_groups": [{..., "params": [names]}]}};
`merge_state_dicts(shards)` unions shards; `gather_state_dict()` does that on rank 0 (collective);
`load_state_dict(full_or_shard)` takes what this rank holds; `save_checkpoint(path)` gathers to
rank 0 and writes atomically (temporary file, fsync, os.replace), `save_checkpoint(path,
sharded=True)` has every rank write its own shard into directory `path` and rank 0 an index
(`SHARDED_INDEX`), `load_checkpoint(path)` reads either on every rank (memory-mapped, a
directory's shards merged); `load_into_model` / `load_optimizer_state` put a merged state into a
plain model.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn

from octopipe.errors import ArgumentError, ExecutionError, OctopipeWarning
from octopipe.ir.program import InstrKind, Instruction, RankProgram
from octopipe.runtime import amp
from octopipe.runtime.comm import KIND_ACT, KIND_GRAD, Pending, Transport, tag
from octopipe.runtime.materialize import Init, checkpoint_state, is_checkpoint, load_named, materialize
from octopipe.runtime.meter import ActivationMeter, tensors_in
from octopipe.runtime.stage import StageModule, WeightGradStash, deferred_weight_grads, selective_checkpoint
from octopipe.runtime.writer import ShardWriter, map_leaves


def microbatch_counts(loss_weight: Callable[[Tensor], Any], target: Tensor, count: int, where: str) -> list[float]:
    """`loss_weight` of each target microbatch, checked to be a finite count >= 0 (nan for a
    one-element meta tensor: a meta-device example target holds no values). `where` starts the
    error messages."""
    counts = []
    for m, chunk in enumerate(target.chunk(count)):
        try:
            value = loss_weight(chunk)
        except Exception as exc:  # noqa: BLE001 - the user's function: say where it failed
            raise ArgumentError(f"{where}: loss_weight failed on microbatch {m}'s target: "
                                f"{type(exc).__name__}: {exc}") from exc
        if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_complex:
            if value.is_meta:
                counts.append(float("nan"))
                continue
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgumentError(f"{where}: loss_weight must return a number (or a one-element tensor) for a target "
                                f"microbatch, got {type(value).__name__} for microbatch {m}; return e.g. "
                                "(target != ignore_index).sum()")
        if not 0 <= value < float("inf"):
            raise ArgumentError(f"{where}: loss_weight returned {value} for microbatch {m}; weights are counts, "
                                "finite and >= 0")
        counts.append(float(value))
    return counts


def microbatch_weights(loss_weight: Callable[[Tensor], Any], target: Tensor, count: int, where: str,
                       total_of: Callable[[float], float] | None = None) -> list[float]:
    """Each microbatch's weight in the step's loss: its `loss_weight` count over the batch's. A
    token-mean loss weighted so is the token mean over the whole batch (each microbatch's mean
    times its share of the tokens). `total_of(this batch's count)`: the count to divide by
    instead (data parallelism: the sum over every replica's batch). A batch whose count is 0
    everywhere gets weights of 0 (`Engine` then reports a nan loss, as a mean over nothing is,
    and zero gradients)."""
    counts = microbatch_counts(loss_weight, target, count, where)
    total = sum(counts) if total_of is None else total_of(sum(counts))
    if total <= 0:
        return [0.0] * len(counts)
    return [value / total for value in counts]


class Replicas:
    """Where a rank sits among `size` data-parallel replicas of a pipeline of `pipeline_size`
    ranks (world = pipeline_size x size), in Megatron's order: rank = stage_rank x size + replica,
    so the copies of one pipeline rank, which sum their gradients every step, are neighbours (in
    one node where `size` divides the node's devices)."""

    def __init__(self, rank: int, world_size: int, size: int) -> None:
        self.size = size
        self.pipeline_size = world_size // size
        self.stage_rank, self.replica = divmod(rank, size)

    def global_rank(self, stage_rank: int) -> int:
        """The rank of pipeline rank `stage_rank` in this rank's replica."""
        return stage_rank * self.size + self.replica

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [stage * self.size + replica for stage in range(self.pipeline_size)]

    def data_ranks(self, stage_rank: int) -> list[int]:
        return [stage_rank * self.size + replica for replica in range(self.size)]


class _Slot:
    """One (stage, microbatch) in flight: inputs (leaves), outputs, gradients; a recompute stage's
    RNG state and buffers at F."""

    __slots__ = ("inputs", "outputs", "output_grads", "input_grads", "stash", "rng_state", "buffers", "held",
                 "held_outputs", "held_for_w", "reads_left", "released")

    def __init__(self, num_outputs: int) -> None:
        self.inputs: list[Tensor] | None = None
        self.outputs: tuple[Tensor, ...] | None = None
        self.output_grads: list[Tensor | None] = [None] * num_outputs
        self.input_grads: list[Tensor | None] | None = None
        self.stash: WeightGradStash | None = None
        self.rng_state: tuple[Tensor, Tensor | None] | None = None
        self.buffers: _BuffersAtForward | None = None
        self.held: list[Any] = []
        """With an activation meter: its holds on the inputs kept from F to B."""
        self.held_outputs: list[Any] = []
        """With an activation meter: its hold on each output (None once released)."""
        self.reads_left = 0
        """The consumer stages that have not yet taken F's outputs (a send, or a local F)."""
        self.released: list[tuple[int, torch.Size, torch.dtype]] = []
        """Outputs whose data was released once every consumer had them: (index, shape, dtype)."""
        self.held_for_w: list[Any] = []
        """With an activation meter: its holds on what B left for W."""


def _releasable_outputs(stage: StageModule) -> tuple[int, ...]:
    """The outputs of a stage whose data its B does not read: computed by an op of the stage's
    graph whose only user is the graph's output (not an input passed through, a parameter, or a
    value other ops of the stage read, which autograd may have saved: releasing its data would
    change what their backward reads). None for a loss stage or a module that is not an fx graph."""
    if stage.is_loss or not isinstance(stage.module, fx.GraphModule):
        return ()
    output = next((node for node in stage.module.graph.nodes if node.op == "output"), None)
    if output is None:
        return ()
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    if len(values) != len(stage.outputs):
        return ()
    return tuple(j for j, node in enumerate(values)
                 if isinstance(node, fx.Node) and node.op in ("call_function", "call_method", "call_module")
                 and set(node.users) == {output} and values.count(node) == 1
                 and not _may_return_its_input(node, stage.module))


_RETURNS_SELF = frozenset({"contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda",
                           "detach", "requires_grad_"})
"""Tensor methods that may return the very tensor they were called on (a no-op conversion)."""

_AUGMENTED = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior",
                        "ixor", "ilshift", "irshift"})
"""In-place operators (`x += y` traces to operator.iadd, or `__iadd__`): they return their left operand."""


def _may_return_its_input(node: fx.Node, module: nn.Module) -> bool:
    """Whether the op may return one of its inputs itself (a no-op conversion, an in-place op,
    an identity): then the output is another node's value too, which autograd may have saved."""
    if node.op == "call_module":
        called = module.get_submodule(str(node.target))
        return isinstance(called, (nn.Identity, nn.Dropout)) or bool(getattr(called, "inplace", False))
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name.removeprefix("__").removesuffix("__") in _AUGMENTED
    return name in _RETURNS_SELF or in_place or bool(node.kwargs.get("inplace"))


class _BuffersAtForward:
    """A recomputing stage's buffers as its F found them. The forward that B runs again sees these
    values and leaves the stage's buffers as they are: a running statistic, a counter or a spectral
    norm's power iteration that F (or a later stage's forward) updated is not updated twice, and B
    differentiates the forward that made F's outputs, as in plain training. A copy of every buffer
    of the stage per microbatch in flight: buffers are small next to its activations."""

    __slots__ = ("entries", "ran")

    def __init__(self, slots: Sequence[tuple[nn.Module, str]]) -> None:
        self.ran = False
        """Whether F has run (a selective stage's checkpoint calls the same function at F and B)."""
        copies: dict[int, Tensor] = {}
        self.entries: list[tuple[nn.Module, str, Tensor]] = []
        for owner, attr in slots:
            buffer = owner._buffers.get(attr)
            if buffer is None:
                continue
            copy = copies.get(id(buffer))
            if copy is None:  # one copy of a buffer registered under several names
                copy = copies[id(buffer)] = buffer.detach().clone()
            self.entries.append((owner, attr, copy))

    @staticmethod
    def slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
        """(owning module, attribute) of every buffer of `module`, each name of a shared one."""
        return [(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                for name, _ in module.named_buffers(remove_duplicate=False)]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        current = [(owner, attr, owner._buffers.get(attr)) for owner, attr, _ in self.entries]
        for owner, attr, copy in self.entries:
            owner._buffers[attr] = copy
        try:
            yield
        finally:
            for owner, attr, tensor in current:
                owner._buffers[attr] = tensor


class Engine:
    """One rank of a pipeline: `step(inputs, target)` runs the program once and returns the loss."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        stages: Sequence[StageModule],
        program: RankProgram,
        num_microbatches: int,
        *,
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
        optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        init: Init | None = None,
        loss_weight: Callable[[Tensor], Any] | None = None,
        autocast: torch.dtype | str | None = None,
        data_parallel: int = 1,
        loss_scaler: amp.LossScaler | None = None,
        batch_specs: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None,
        shard_optimizer: bool = False,
        overlap_param_gather: bool = False,
        master_weights: bool = False,
        fp32_grads: bool | None = None,
        release_outputs: bool = True,
    ) -> None:
        """`device`: where this rank runs (default: see `_engine_device`: the process's GPU under NCCL, else the
        CPU); its stage modules are moved there (in place: build one engine per process). A model built on the
        meta device is created there instead, from `init` (a checkpoint path or state dict by the model's names,
        a function run on each submodule, or "reset"; see `runtime/materialize.py`); `init` on a real model
        loads or re-initializes it the same way. `loss_weight(target microbatch) -> count`: each microbatch's
        loss weighs its count's share of the batch's (a token loss's real tokens, say), so that the step
        computes a token mean over the whole batch; default: every microbatch weighs the same (see
        `microbatch_weights`). `autocast`: None, "bf16" or "fp16" (with loss scaling): run every forward under
        torch.autocast (see `runtime/amp.py`); the stages' cross-stage specs must come from a compile with the
        same autocast. `data_parallel` = D: `world_size` ranks are D replicas of the pipeline (see `Replicas`);
        `rank` is the process' own (global) rank and `program` that of its pipeline rank, rank // D.
        `loss_scaler`: fp16 autocast's dynamic loss scale (default `amp.LossScaler()`, GradScaler's
        defaults); refused without fp16. `batch_specs`: the (shape, dtype) of each tensor of the
        example batch, the model's inputs then the target (`Pipeline.engine` gives them): then
        every rank refuses a `step` or `evaluate` whose batch differs (another count of inputs, no
        target, another shape or dtype), not only the ranks that read the tensor that differs.
        `shard_optimizer`: split the optimizer's state over the D replicas (ZeRO-1; see the module
        docstring); the optimizer must then be a factory, or one built over `optimizer_parameters()`.
        `overlap_param_gather` (with `shard_optimizer`, Megatron's `--overlap-param-gather`): the
        shares' broadcast after the step is left running, and each stage's parameters are waited
        for only before its first forward of the next `step` or `evaluate` (see the module
        docstring). `master_weights` (Megatron's `--bf16`): the optimizer steps an fp32 copy of
        each bf16 parameter (of this replica's share, with `shard_optimizer`), given the bf16
        gradients cast up, and the bf16 weights are set from it after each step (see the module
        docstring). `fp32_grads` (with `master_weights`, and by default there: Megatron's
        `--accumulate-allreduce-grads-in-fp32`): the bf16 parameters' gradients are accumulated
        over the microbatches, summed across ranks and clipped in fp32 (`main_grads()`), and the
        master copies step them as they are. `release_outputs` (default): once every consumer has a
        stage's outputs of a microbatch, their data is released, not held until its B (Megatron's
        deallocate_output_tensor; see `_taken`); False holds them, to measure what that saves."""
        if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1 \
                or world_size % data_parallel:
            raise ArgumentError(f"rank {rank}: Engine(data_parallel={data_parallel!r}): must be a positive integer that "
                                f"divides the world size {world_size}")
        if not isinstance(shard_optimizer, bool):
            raise ArgumentError(f"rank {rank}: Engine(shard_optimizer={shard_optimizer!r}): must be True or False")
        if not isinstance(overlap_param_gather, bool):
            raise ArgumentError(f"rank {rank}: Engine(overlap_param_gather={overlap_param_gather!r}): must be True or "
                                "False")
        if not isinstance(master_weights, bool):
            raise ArgumentError(f"rank {rank}: Engine(master_weights={master_weights!r}): must be True or False")
        if fp32_grads is None:  # (Megatron's default: fp32 gradients wherever there are master copies)
            fp32_grads = master_weights
        if not isinstance(fp32_grads, bool):
            raise ArgumentError(f"rank {rank}: Engine(fp32_grads={fp32_grads!r}): must be True, False or None (default: "
                                "master_weights)")
        if fp32_grads and not master_weights:
            raise ArgumentError(f"rank {rank}: Engine(fp32_grads=True) accumulates the bf16 weights' gradients in "
                                "fp32 for their fp32 master copies, but master_weights is False (the optimizer "
                                "steps the weights in their own dtype); pass master_weights=True too, or leave "
                                "fp32_grads off")
        if overlap_param_gather and not shard_optimizer:
            raise ArgumentError(f"rank {rank}: Engine(overlap_param_gather=True) overlaps the broadcast of a sharded "
                                "optimizer's updated shares with the next step, but shard_optimizer is False (every "
                                "replica steps every parameter: nothing is broadcast); pass shard_optimizer=True too, "
                                "or leave overlap_param_gather off")
        self.replicas = Replicas(rank, world_size, data_parallel)
        self.shard_optimizer = shard_optimizer
        if program.rank != self.replicas.stage_rank or program.num_ranks != self.replicas.pipeline_size:
            raise ExecutionError(f"rank {rank}: program is for pipeline rank {program.rank} of {program.num_ranks}, "
                                 f"engine is pipeline rank {self.replicas.stage_rank} of {self.replicas.pipeline_size}"
                                 + (f" (rank {rank} of {world_size} in {data_parallel} replicas)" if data_parallel > 1
                                    else ""))
        self.batch_specs = tuple((tuple(shape), dtype) for shape, dtype in batch_specs) if batch_specs else None
        self.rank = rank
        self.world_size = world_size
        self.program = program
        self.num_microbatches = num_microbatches
        if loss_weight is not None and not callable(loss_weight):
            raise ArgumentError(f"rank {rank}: Engine(loss_weight=...) must be a function of the target microbatch, "
                                f"got {type(loss_weight).__name__}")
        self.loss_weight = loss_weight
        self.autocast = amp.autocast_dtype(autocast, f"rank {rank}: Engine(autocast=...)")
        if loss_scaler is not None and self.autocast is not torch.float16 and not master_weights:
            raise ArgumentError(f"rank {rank}: Engine(loss_scaler=...) is for fp16 autocast or fp16 weights with "
                                f"master copies (bf16 and fp32 need no loss scaling), but autocast is {self.autocast}")
        self.loss_scaler = (loss_scaler or amp.LossScaler()) if self.autocast is torch.float16 else None
        self.skipped_step = False
        """fp16: whether the last `step` found an inf or nan gradient and dropped the gradients."""
        self.stages = {stage.index: stage for stage in stages}
        for instruction in program.instructions:
            if instruction.stage is not None and instruction.stage not in self.stages:
                raise ExecutionError(f"rank {rank}: program runs stage {instruction.stage} but this rank was given "
                                     f"stages {sorted(self.stages)}")
        first = next((p for s in stages for p in s.module.parameters()), None)
        self.device = _engine_device(device, first, rank)
        # with master_weights a checkpoint is read once, for the weights here and the copies below
        loaded = (checkpoint_state(init, rank)
                  if master_weights and init is not None and is_checkpoint(init) else None)
        materialize(stages, self.device, init if loaded is None else loaded, rank)
        self._random = {index: _stage_stream(index, self.device) for index in self.stages}
        """Per stage: its own random state (CPU, and the GPU's on a GPU), from torch.initial_seed()
        and the stage index, that its forwards draw from (dropout). One process-wide stream,
        seeded alike on every rank, gave every rank's stages the same masks; these do not depend
        on which rank holds a stage either."""
        self._buffer_slots = {index: _BuffersAtForward.slots(stage.module) for index, stage in self.stages.items()
                              if stage.recompute or stage.selective}
        """Per stage that runs its forward again at B: where its buffers live (found once)."""
        self.transport = Transport(rank, world_size, self.device, timeout_s)
        self._params = self._tie_local_parameters()
        self.overlap_param_gather = overlap_param_gather and self.replicas.size > 1
        self._gather_stage = self._first_forward_stages() if self.overlap_param_gather else {}
        """With `overlap_param_gather`: parameter (original name) -> the stage of this rank whose
        forward runs first among those holding it, whose first forward waits for its broadcast."""
        self._gathering: dict[int, list[tuple[Pending, list[Tensor], Tensor, int]]] = {}
        """With `overlap_param_gather`: per stage, its shares' broadcasts still running since the step."""
        self.master_weights = master_weights
        # with master_weights: this rank's fp16 weights that train (then every rank scales the loss)
        half = sorted(name for name, param in self._params.items()
                      if param.requires_grad and param.dtype is torch.float16) if master_weights else []
        if master_weights:
            low = sorted(name for name, param in self._params.items()
                         if param.is_floating_point() and param.dtype not in (torch.float32, torch.float64, *HALF_DTYPES))
            if low:
                raise ArgumentError(f"rank {rank}: Engine(master_weights=True) keeps fp32 copies of bf16 or fp16 "
                                    f"weights, but {low[0]!r} is {self._params[low[0]].dtype}; cast the model to "
                                    "torch.bfloat16 (or torch.float16)")
            if half and not fp32_grads:
                raise ArgumentError(f"rank {rank}: Engine(master_weights=True) with fp16 weights ({half[0]!r}, ...) "
                                    "needs fp32_grads=True: their loss-scaled gradients are accumulated and unscaled "
                                    "in fp32, as Megatron's --fp16 does (fp16 would flush the small ones to zero; "
                                    "torch's GradScaler refuses fp16 gradients); pass fp32_grads=True too")
        self._masters: dict[str, nn.Parameter] = {}
        """With `master_weights`: original name -> the fp32 copy the optimizer steps, for each bf16
        parameter that trains (of this replica's rows of it, with `shard_optimizer`; built by
        `optimizer_parameters`)."""
        self._init_masters: dict[str, Tensor] = {}
        """With `master_weights` and a checkpoint `init` that holds fp32 copies (`MASTER_KEY`):
        their values, which the copies start from instead of the weights' bf16 rounding."""
        self.fp32_grads = fp32_grads
        self._main_grads: dict[str, Tensor] = {}
        """With `fp32_grads`: original name -> the fp32 gradient of a bf16 parameter that trains
        (its `.grad` stays None: each backward instruction folds what it added there in)."""
        self._folded: dict[int, list[tuple[str, nn.Parameter]]] = {}
        """With `fp32_grads`: per stage, the (name, parameter) pairs whose gradients it folds."""
        if fp32_grads:
            for index, stage in self.stages.items():  # (a stage's parameters are this rank's shared ones)
                self._folded[index] = [(name, param) for name, param in stage.named_parameters()
                                       if param.requires_grad and param.dtype in HALF_DTYPES]
        self._fp32_names = frozenset(name for pairs in self._folded.values() for name, _ in pairs)
        self._optimizer_hooks: list[Any] = []
        self._saving: tuple[ShardWriter, str, str, str, list[BaseException]] | None = None
        """A background sharded save still writing: (its writer, directory, token, file, errors)."""
        self._writer: ShardWriter | None = None
        """The process writing background saves (`octopipe.runtime.writer`), started by the first."""
        self._plan_inputs()
        self._tied_ranks: dict[str, tuple[int, ...]] = {
            i.param: tuple(i.ranks) for i in program.instructions if i.kind is InstrKind.REDUCE_TIED}  # type: ignore[misc]
        """Tied parameter (original name) -> the ranks holding it, from the program's reductions."""
        self._buckets = self._plan_buckets() if self.replicas.size > 1 else {}
        """With replicas: instruction position -> the gradients to all-reduce once it has run."""
        self.shard_rows = self._shard_rows() if shard_optimizer else {}
        """With `shard_optimizer`: parameter (original name) -> its pieces, (replica, first row, end
        row) each: the rows of it (slices along dim 0) whose optimizer state each replica holds
        and whose update it computes (`shard_rows`)."""
        self._mine: dict[str, tuple[int, int]] = {
            name: (first, end) for name, pieces in self.shard_rows.items() for replica, first, end in pieces
            if replica == self.replicas.replica} if shard_optimizer else {
            name: (0, _num_rows(param)) for name, param in self._params.items()}
        """The rows (first, end) of each parameter whose update this replica computes: all of
        every one's unless the state is sharded, where a parameter missing here is others' alone."""
        self._split = {name: (*rows, _num_rows(self._params[name])) for name, rows in self._mine.items()
                       if rows != (0, _num_rows(self._params[name]))}
        """The parameters of which this replica steps some rows but not all: name -> (first, end,
        rows of the whole)."""
        self._pieces: dict[str, nn.Parameter] = {}
        """With `shard_optimizer`, for each parameter in `_split` that has no master copy: what
        the optimizer steps, its rows as a parameter that views the weight's storage (so the step
        updates them in place), built by `optimizer_parameters`."""
        if loaded is not None:
            for name, param in self._params.items():
                if name not in self._mine or not param.requires_grad:
                    continue  # (another replica's copy, or none)
                saved = saved_master(loaded, name)
                if saved is not None and param.dtype in HALF_DTYPES and saved.shape == param.shape:
                    self._init_masters[name] = _rows_of(saved.detach(), self._mine[name]).to(self.device, torch.float32)
        try:  # collectives every rank joins: a rank that failed above (its init, say) leaves them
            self._tied_groups = self._make_tied_groups()
            self._data_group, self._pipeline_group = self._make_replica_groups()
            if init is not None and not is_checkpoint(init):
                self._broadcast_tied()  # each rank drew its own values: the copies of a tied parameter must agree
            if self.replicas.size > 1:
                self._broadcast_from_first_replica()  # as DDP does: the replicas start equal, whatever each drew
            if master_weights:  # fp16 weights anywhere: every rank scales, unscales and checks (collectively)
                anywhere = torch.tensor(float(bool(half)), device=self.device)
                if world_size > 1 and dist.is_initialized():
                    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
                if anywhere > 0 and self.loss_scaler is None:
                    self.loss_scaler = loss_scaler or amp.LossScaler()
        except RuntimeError as exc:
            raise self.transport.error("setting up the engine (collectives every rank joins)", -1, exc) from exc
        if loss_scaler is not None and self.loss_scaler is None:
            raise ArgumentError(f"rank {rank}: Engine(loss_scaler=...) is for fp16 autocast or fp16 weights with "
                                "master copies, but the model's weights are bf16 or fp32 and autocast is "
                                f"{self.autocast} (no loss scaling needed); leave loss_scaler out")
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_load: OptimizerLoad | None = None
        """After `load_state_dict` / `load_checkpoint` with optimizer state: what differed between the
        saved optimizer and this one (`load_optimizer_state`)."""
        self.timeline: list[tuple[Instruction, float, float]] | None = None
        """Set to a list to record (instruction, start s, end s) of every instruction of each step
        (perf_counter seconds): the measured timeline, for calibration and diagnosis. A compute
        instruction's start is when its received inputs were there: waiting for a message is not
        counted as its work."""
        self._inputs_ready = 0.0
        self._meter: ActivationMeter | None = None
        self.release_outputs = release_outputs
        self._evaluating = False
        self._eval_program: tuple[Instruction, ...] | None = None
        if optimizer is not None:
            self.attach_optimizer(optimizer)
        self._handlers = {
            InstrKind.RECV_ACT: self._recv_act, InstrKind.RECV_GRAD: self._recv_grad,
            InstrKind.SEND_ACT: self._send_act, InstrKind.SEND_GRAD: self._send_grad,
            InstrKind.FORWARD: self._forward, InstrKind.BACKWARD: self._backward,
            InstrKind.BACKWARD_INPUT: self._backward_input, InstrKind.BACKWARD_WEIGHT: self._backward_weight,
            InstrKind.REDUCE_TIED: self._reduce_tied, InstrKind.STEP: self._step,
        }

    # -- setup --------------------------------------------------------------------------------------
    def _tie_local_parameters(self) -> dict[str, nn.Parameter]:
        """Original name -> parameter; stages on this rank that hold the same original parameter are
        made to share one object (so its gradient accumulates once, as in the plain model)."""
        params: dict[str, nn.Parameter] = {}
        for index in sorted(self.stages):
            stage = self.stages[index]
            for local, param in list(stage.module.named_parameters(remove_duplicate=False)):
                name = stage.original_name(local)
                if name not in params:
                    params[name] = param
                elif params[name] is not param:
                    owner, _, attr = local.rpartition(".")
                    setattr(stage.module.get_submodule(owner) if owner else stage.module, attr, params[name])
        return params

    def _plan_inputs(self) -> None:
        """Per stage: where each input comes from, and the message layouts to/from peers."""
        self._fetch: dict[int, list[tuple[str, int, int]]] = {}
        self._recv_layout: dict[tuple[int, int], list[int]] = {}  # (producer, consumer) -> consumer input positions
        for index, stage in self.stages.items():
            fetch = []
            for src in stage.inputs:
                if src.is_batch:
                    fetch.append(("batch", src.index, 0))
                elif src.stage in self.stages:
                    fetch.append(("local", src.stage, src.index))
                else:
                    fetch.append(("remote", src.stage, src.index))
            self._fetch[index] = fetch
            for producer in stage.producers():
                self._recv_layout[(producer, index)] = list(stage.inputs_from(producer))
        self._releasable = {index: _releasable_outputs(stage) for index, stage in self.stages.items()}
        self._consumer_counts = {index: len(stage.consumers()) for index, stage in self.stages.items()}

    def _check_example_batch(self, batch: tuple[Any, ...], num_inputs: int, call: str) -> None:
        """Every tensor of the batch is a tensor and, with `batch_specs`, is shaped like the example
        batch's, with a target: on every rank, so that none waits for a rank that refused it."""
        specs = self.batch_specs
        if specs is not None and (num_inputs != len(specs) - 1 or len(batch) == num_inputs):
            raise ArgumentError(f"rank {self.rank}: {call} got {num_inputs} input tensor(s) and "
                                f"{'a' if len(batch) > num_inputs else 'no'} target, but the pipeline was compiled for "
                                f"{len(specs) - 1} input(s) and its loss needs the target: call "
                                f"{call[:-2]}(inputs, target) with the model's {len(specs) - 1} input(s)")
        for position, tensor in enumerate(batch):
            what = "the target" if position == num_inputs else f"input {position}"
            if not isinstance(tensor, Tensor):
                raise ArgumentError(f"rank {self.rank}: {call}: {what} must be a torch.Tensor, got "
                                    f"{type(tensor).__name__}")
            if specs is not None and (tuple(tensor.shape), tensor.dtype) != specs[position]:
                shape, dtype = specs[position]
                raise ArgumentError(
                    f"rank {self.rank}: {call}: {what} is {tuple(tensor.shape)} {tensor.dtype}, but the pipeline "
                    f"was compiled for {shape} {dtype}; every step takes a batch shaped like the example batch: "
                    "compile again with one like this")

    def _check_batch(self, batch: tuple[Any, ...], num_inputs: int, count: int, call: str) -> None:
        """Every batch tensor this rank's stages read is there, with the shape and dtype the
        pipeline was compiled for (its receive buffers and messages are sized by them)."""
        for index, stage in sorted(self.stages.items()):
            for src in stage.inputs:
                if not src.is_batch:
                    continue
                what = "the target" if src.index >= num_inputs else f"input {src.index}"
                if src.index >= len(batch):
                    raise ArgumentError(
                        f"rank {self.rank}: stage {index} reads batch tensor {src.index} but {call} got {num_inputs} "
                        f"input(s) and {'a target' if len(batch) > num_inputs else 'no target'}; the pipeline computes "
                        f"the loss on its last stage: call {call[:-2]}(inputs, target)")
                tensor = batch[src.index]
                if not isinstance(tensor, Tensor):
                    raise ArgumentError(f"rank {self.rank}: {call}: {what} must be a tensor, got {type(tensor).__name__}")
                spec = src.spec
                expected = (spec.shape[0] * count, *spec.shape[1:]) if spec.shape else ()
                if tuple(tensor.shape) != expected or tensor.dtype != spec.dtype:
                    raise ArgumentError(
                        f"rank {self.rank}: {call}: {what} is {tuple(tensor.shape)} {tensor.dtype}, but the pipeline "
                        f"was compiled for {expected} {spec.dtype} ({count} microbatches of {tuple(spec.shape)}); "
                        "every step takes a batch shaped like the example batch: compile again with one like this")

    def _make_tied_groups(self) -> dict[tuple[int, ...], Any]:
        mine = sorted({i.ranks for i in self.program.instructions if i.kind is InstrKind.REDUCE_TIED})
        if self.world_size == 1 or not dist.is_initialized():
            return {}
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        groups = {}
        replicas = self.replicas
        for ranks in sorted({tuple(r) for ranks_list in everyone for r in ranks_list}):
            for replica in range(replicas.size):  # every rank calls new_group, in the same order
                group = dist.new_group([stage * replicas.size + replica for stage in ranks])
                if replica == replicas.replica and replicas.stage_rank in ranks:
                    groups[tuple(ranks)] = group
        return groups

    def _make_replica_groups(self) -> tuple[Any, Any]:
        """(this rank's data-parallel group: the copies of its pipeline rank; its replica's
        pipeline group), both None without replicas. Collective: every rank creates every group."""
        replicas = self.replicas
        if replicas.size == 1 or not dist.is_initialized():
            return None, None
        data = pipeline = None
        for stage in range(replicas.pipeline_size):
            group = dist.new_group(replicas.data_ranks(stage))
            data = group if stage == replicas.stage_rank else data
        for replica in range(replicas.size):
            group = dist.new_group(replicas.pipeline_ranks(replica))
            pipeline = group if replica == replicas.replica else pipeline
        return data, pipeline

    def _broadcast_tied(self) -> None:
        """Collective over each tie group: its lowest rank's value of every tied parameter."""
        for name in sorted(self._tied_ranks):  # the same order on every rank
            ranks = self._tied_ranks[name]
            group = self._tied_groups.get(ranks)
            if group is not None:
                dist.broadcast(self._params[name].data, src=self.replicas.global_rank(min(ranks)), group=group)

    # -- parameters and optimizer ------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(original qualified name, parameter) for what this rank holds; a tied one once."""
        return iter(self._params.items())

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params.values())

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        """(original name, buffer) of this rank's persistent buffers (those a state dict holds)."""
        seen: set[str] = set()
        for stage in self.stages.values():
            for local, buffer in stage.module.named_buffers():
                owner, _, attr = local.rpartition(".")
                if attr in (stage.module.get_submodule(owner) if owner else stage.module)._non_persistent_buffers_set:
                    continue
                name = stage.original_name(local)
                if name not in seen:
                    seen.add(name)
                    yield name, buffer

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank's optimizer steps: `parameters()`, or with `shard_optimizer`
        this replica's rows of them (`shard_rows`: a parameter cut between replicas is given as
        a parameter over its rows here, which views the weight); with `master_weights`, a bf16
        one's fp32 copy (of those rows) in its place (`master_parameters`)."""
        names = [name for name in self._params if name in self._mine]
        for name in names:
            param, rows = self._params[name], self._mine[name]
            if self.master_weights and param.requires_grad and param.dtype in HALF_DTYPES:
                if name not in self._masters:
                    start = self._init_masters.pop(name, None)
                    piece = _rows_of(param.detach(), rows)
                    if start is None or not torch.equal(start.to(param.dtype), piece):
                        start = piece.float()  # (no saved copy, or the weight has changed since)
                    self._masters[name] = nn.Parameter(start.clone())
            elif name in self._split and name not in self._pieces:
                self._pieces[name] = nn.Parameter(_rows_of(param.detach(), rows), requires_grad=param.requires_grad)
        self._init_masters.clear()  # (only the first copies start from the checkpoint's)
        return [self._stepped(name) for name in names]

    def _stepped(self, name: str) -> nn.Parameter:
        """What the optimizer steps for parameter `name`: its master copy, else its rows'
        parameter (`_pieces`), else the parameter itself."""
        stepped = self._masters.get(name)
        if stepped is None:
            stepped = self._pieces.get(name, self._params[name])
        return stepped

    def measure_activations(self) -> ActivationMeter:
        """From the next `step` on, measure the activation bytes this rank holds for its backward
        passes (see `runtime/meter.py`): `activation_peak_bytes` is then the most held during the
        last step, the measured counterpart of the simulator's `peak_activation_bytes` for this
        rank's device. It costs a Python call per tensor autograd saves."""
        if self._meter is None:
            self._meter = ActivationMeter(self.parameters())
        return self._meter

    @property
    def activation_peak_bytes(self) -> int | None:
        """The most activation bytes held during the last `step` (None unless `measure_activations`)."""
        return self._meter.peak if self._meter is not None else None

    def master_parameters(self) -> dict[str, nn.Parameter]:
        """With `master_weights`: original name -> the fp32 copy the optimizer steps, for this
        replica's bf16 parameters that train (with `shard_optimizer`, of its rows of each:
        `shard_rows`; empty before an optimizer is attached)."""
        return dict(self._masters)

    def main_grads(self) -> dict[str, Tensor]:
        """With `fp32_grads`: original name -> the fp32 gradient of each bf16 parameter that
        trains on this rank and has one (after `step`: summed over the microbatches and, with
        replicas, over them: with `shard_optimizer` only this replica's rows, `shard_rows`), as Megatron keeps
        it in `param.main_grad`; the parameters' `.grad` stay None. Empty without `fp32_grads`."""
        return dict(self._main_grads)

    def _grad(self, name: str) -> Tensor | None:
        """Parameter `name`'s gradient: its fp32 one with `fp32_grads`, else its `.grad`."""
        return self._main_grads.get(name) if name in self._fp32_names else self._params[name].grad

    def _set_grad(self, name: str, grad: Tensor | None) -> None:
        if name not in self._fp32_names:
            self._params[name].grad = grad
        elif grad is None:
            self._main_grads.pop(name, None)
        else:
            self._main_grads[name] = grad

    def _fold_grads(self, index: int) -> None:
        """With `fp32_grads`, after a backward instruction of stage `index`: what it added to its
        bf16 parameters' `.grad` goes into their fp32 gradients (as Megatron's hook adds it to
        `main_grad`), so the microbatches' sum is taken in fp32."""
        for name, param in self._folded.get(index, ()):
            grad = param.grad
            if grad is not None:
                main = self._main_grads.get(name)
                if main is None:
                    self._main_grads[name] = grad.float()
                else:
                    main.add_(grad)
                param.grad = None

    def _optimizer_named(self) -> dict[str, nn.Parameter]:
        """Original name -> what the optimizer steps for it (`_stepped`)."""
        return {name: self._stepped(name) for name in self._params}

    def _grads_to_stepped(self) -> None:
        """Before the optimizer's step: each master copy's gradient, its bf16 parameter's (rows)
        cast up (with `fp32_grads`, its fp32 gradient itself); each rows' parameter's, a view of
        its parameter's gradient."""
        for name, master in self._masters.items():
            grad = self._grad(name)
            master.grad = None if grad is None else _rows_of(grad.detach(), self._mine[name]).float()
        for name, piece in self._pieces.items():
            grad = self._grad(name)
            piece.grad = None if grad is None else _rows_of(grad.detach(), self._mine[name])

    def _stepped_to_params(self) -> None:
        """After the optimizer's step: each bf16 parameter (its rows) rounded from its updated
        master copy, and the gradients given to the copies and the rows' parameters dropped (set
        again from the next step's)."""
        with torch.no_grad():
            for name, master in self._masters.items():
                _rows_of(self._params[name], self._mine[name]).copy_(master)
                master.grad = None
        for piece in self._pieces.values():
            piece.grad = None

    def _named_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state by original name, each master copy's values beside its entry
        (`MASTER_KEY`), so a checkpoint keeps the fp32 weights, not only their bf16 rounding."""
        named = named_optimizer_state(self.optimizer, self._optimizer_named())  # type: ignore[arg-type]
        for name, master in self._masters.items():
            named["state"][name] = {**named["state"].get(name, {}), MASTER_KEY: master.detach()}
        for name, rows in self._split.items():  # rows of a parameter: which (merge_state_dicts joins them)
            if name in named["state"]:
                named["state"][name][ROWS_KEY] = rows
        return named

    def _shard_rows(self) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """Each parameter's pieces (`shard_rows`), the same on every copy of this pipeline rank
        (they hold the same names, shapes and buckets): the parameters that train, bucket by
        bucket (each reduced as one, `_plan_buckets`), cut evenly at row boundaries, as
        Megatron's distributed optimizer cuts each bucket; one tied across ranks on its own, so
        every rank holding it cuts it alike; a frozen one whole to replica 0 (it has no state)."""
        trains = {name for name, param in self._params.items() if param.requires_grad}
        units = [[name for name in names if name in trains] for _, names in sorted(self._buckets.items())]
        held = {name for unit in units for name in unit}
        units += [[name] for name in sorted(trains & set(self._tied_ranks))]
        units.append(sorted(trains - held - set(self._tied_ranks)))
        rows = shard_rows([[(name, tuple(self._params[name].shape)) for name in unit] for unit in units],
                          self.replicas.size)
        for name, param in self._params.items():
            if name not in trains:
                rows[name] = ((0, 0, _num_rows(param)),)
        return rows

    def _first_forward_stages(self) -> dict[str, int]:
        """Parameter (original name) -> the stage of this rank whose forward comes first in the
        program among those holding it (`_gather_stage`)."""
        first: dict[int, int] = {}
        for position, instruction in enumerate(self.program.instructions):
            if instruction.kind is InstrKind.FORWARD and instruction.stage is not None:
                first.setdefault(instruction.stage, position)
        order = sorted(self.stages, key=lambda index: (first.get(index, len(self.program.instructions)), index))
        stage_of: dict[str, int] = {}
        for index in order:
            stage = self.stages[index]
            for local, _ in stage.module.named_parameters(remove_duplicate=False):
                stage_of.setdefault(stage.original_name(local), index)
        return stage_of

    def _broadcast_shards(self) -> None:
        """After the sharded optimizer's step: each replica's updated parameters from it to the
        other copies of this pipeline rank (a flat broadcast per owner and dtype; with
        `overlap_param_gather` per stage, owner and dtype, left running until the stage's next
        forward or `finish_param_sync`)."""
        if self.replicas.size == 1 or not dist.is_initialized():
            return
        self.finish_param_sync()  # (a second optimizer step before a forward: the first's land first)
        groups: dict[tuple[int, int, torch.dtype], list[Tensor]] = {}
        for name, param in self._params.items():
            if param.requires_grad:  # a frozen one never changes
                stage = self._gather_stage[name] if self.overlap_param_gather else -1
                for replica, first, end in self.shard_rows[name]:
                    groups.setdefault((stage, replica, param.dtype), []).append(_rows_of(param, (first, end)))
        me = self.replicas.replica
        for stage, replica, dtype in sorted(groups, key=lambda key: (key[0], key[1], str(key[2]))):
            params = groups[stage, replica, dtype]  # (rows of parameters, views)
            flat = (torch.cat([p.detach().reshape(-1) for p in params]) if replica == me else
                    torch.empty(sum(p.numel() for p in params), dtype=dtype, device=self.device))
            src = self.replicas.data_ranks(self.replicas.stage_rank)[replica]
            what = (f"rank {self.rank}: optimizer step: the parameters replica {replica} updated"
                    + (f" on stage {stage} (shard_optimizer, overlap_param_gather)" if stage >= 0 else
                       " (shard_optimizer)"))
            pending = self.transport.broadcast(flat, src, what, self._data_group)
            self._gathering.setdefault(stage, []).append((pending, params, flat, replica))
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self, stage: int | None = None) -> None:
        """Wait for the updated shares broadcast after the last optimizer step (of stage `stage`
        only, or all) and copy them into this copy's parameters. With `overlap_param_gather` the
        engine calls it before each stage's first forward and before it reads, saves or loads
        the parameters; call it yourself before reading their values outside the engine between
        `optimizer.step()` and the next `step` (until then, the shares of the other replicas
        hold the values before the step). Without it, the optimizer step has already waited."""
        stages = [stage] if stage is not None else sorted(self._gathering)
        me = self.replicas.replica
        for index in stages:
            for pending, params, flat, replica in self._gathering.pop(index, ()):
                self.transport.finish(pending)
                if replica != me:
                    offset = 0
                    with torch.no_grad():
                        for param in params:
                            param.copy_(flat[offset:offset + param.numel()].view_as(param))
                            offset += param.numel()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """An optimizer over `optimizer_parameters()` (all of `parameters()` unless the state is
        sharded), or a factory called with them. A rank (or a replica's share) that holds no
        parameter that trains (a plan may give one only parameterless layers, the loss say, or
        only frozen ones) calls the factory with them and one empty 2-D stand-in parameter, since
        torch refuses an optimizer over none: it never gets a gradient, so stepping changes
        nothing, and no state dict names it. It has the shape of a weight, so the usual filters
        (`p.requires_grad`, `p.ndim > 1` for decay) keep it; a factory whose filter keeps none of
        a rank's parameters (only 1-D ones there) is called again with it beside them."""
        own = {id(p) for p in self.optimizer_parameters()}
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ArgumentError(f"rank {self.rank}: attach_optimizer takes a torch.optim.Optimizer or a function "
                                    f"of the parameters returning one, got {type(optimizer).__name__}")
            params = self.optimizer_parameters()
            factory = optimizer
            # with no parameter that trains, the stand-in from the start; where the factory's
            # filter keeps none of this rank's (only 1-D ones under `p.ndim > 1`), with it again
            for attempt in (0, 1) if any(p.requires_grad for p in params) else (1,):
                if attempt:
                    stand_in = nn.Parameter(torch.zeros(0, 0, device=self.device))
                    setattr(stand_in, _STAND_IN, True)
                    own.add(id(stand_in))
                    params = [*params, stand_in]
                try:
                    optimizer = factory(params)
                    break
                except ValueError as exc:
                    if "empty parameter list" not in str(exc):
                        raise
                    if attempt:
                        raise ArgumentError(
                            f"rank {self.rank}: the optimizer factory selected none of this rank's parameters, nor "
                            f"the empty stand-in it gets beside them (torch: {exc}); a plan may give a rank only "
                            "frozen, 1-D or no parameters: make the factory keep at least one, e.g. fall back to "
                            "all it is given (`[p for p in params if ...] or params`)") from exc
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ArgumentError(f"rank {self.rank}: the optimizer factory returned {type(optimizer).__name__}, not "
                                    "a torch.optim.Optimizer; return the optimizer it builds over the parameters it "
                                    "is given (e.g. `lambda params: torch.optim.AdamW(params, lr=1e-3)`)")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in own:
                    if self._masters and any(param is p for p in self._params.values()):
                        raise ExecutionError(
                            f"rank {self.rank}: the optimizer steps a bf16 weight itself, but master_weights keeps "
                            "an fp32 copy of each for the optimizer; build it over engine.optimizer_parameters() "
                            "(the copies), or pass a factory (lambda params: torch.optim.AdamW(params, ...)), which "
                            "gets them")
                    if self.shard_optimizer and any(param is p for p in self._params.values()):
                        raise ExecutionError(
                            f"rank {self.rank}: the optimizer holds a parameter another replica's optimizer steps "
                            f"(shard_optimizer: replica {self.replicas.replica} steps its share only); build it over "
                            "engine.optimizer_parameters(), or pass a factory (lambda params: "
                            "torch.optim.AdamW(params, ...)), which gets them")
                    raise ExecutionError(f"rank {self.rank}: the optimizer holds a parameter this rank does not "
                                         "(build it over engine.optimizer_parameters())")
        cut = next((name for name, pieces in self.shard_rows.items() if len(pieces) > 1), None)
        if cut is not None and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            pieces = ", ".join(f"rows {first}-{end} on replica {replica}" for replica, first, end in self.shard_rows[cut])
            raise ArgumentError(
                f"rank {self.rank}: shard_optimizer cuts parameters between the replicas at row boundaries "
                f"({cut!r}: {pieces}), so each replica's optimizer steps some rows of them, which only an "
                f"element-wise optimizer can ({', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}); "
                f"{type(optimizer).__name__}'s update reads a whole parameter: use one of those, or run without "
                "shard_optimizer")
        for hook in self._optimizer_hooks:  # an optimizer attached before: its hooks go with it
            hook.remove()
        self._optimizer_hooks = []
        if self._masters or self._pieces:  # (in this order: the bf16 weights are set before a sharded state sends them)
            self._optimizer_hooks += [optimizer.register_step_pre_hook(lambda *_: self._grads_to_stepped()),
                                      optimizer.register_step_post_hook(lambda *_: self._stepped_to_params())]
        if self.shard_optimizer and self.replicas.size > 1:
            self.finish_param_sync()
            self._optimizer_hooks.append(optimizer.register_step_post_hook(lambda *_: self._broadcast_shards()))
        self.optimizer = optimizer
        return optimizer

    def zero_grad(self) -> None:
        for param in (*self._params.values(), *self._masters.values(), *self._pieces.values()):
            param.grad = None
        self._main_grads.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Collective (every rank calls it, after `step`, before the optimizer): scale this rank's
        gradients so that the norm of the whole model's gradient, every parameter counted once
        across all ranks (a tied one by the lowest rank holding it), is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` does on the plain model. Returns that norm before
        clipping. A norm taken on one rank alone would clip each rank by a different factor. After
        an fp16 step that overflowed (`skipped_step`: its gradients are dropped on every rank) the
        norm is inf, as torch's is of overflowed gradients."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ArgumentError(f"rank {self.rank}: clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}")
        if self.skipped_step:  # every rank agreed on it: no collective to keep in step
            return float("inf")
        norm_type = float(norm_type)
        me = self.replicas.stage_rank
        infinite = norm_type == float("inf")
        # each parameter's term (|g|_inf, or |g|_p ** p), in parameter order; a tied one counted
        # on the lowest rank holding it
        grads = [self._grad(name) for name in self._params]
        # (sharded: the rows this replica steps, the only ones summed over the replicas here)
        terms: list[Tensor | None] = [
            None if grad is None or name not in self._mine or me != min(self._tied_ranks.get(name, (me,))) else
            _rows_of(grad.detach(), self._mine[name]).abs().max().double() if infinite else
            torch.linalg.vector_norm(_rows_of(grad.detach(), self._mine[name]).double(), norm_type) ** norm_type
            for name, grad in zip(self._params, grads)]
        if self.shard_optimizer and self.replicas.size > 1 and dist.is_initialized():
            # each gradient's rows are summed on their own replica only: gather the terms over
            # the copies, a column each (zeros where a replica has none), and total each row
            # first, then the parameters in the same order as an unsharded engine, so that where
            # a parameter is one replica's alone (x + 0 is x) the norm is its norm bit for bit
            gathered = torch.zeros(len(terms), self.replicas.size, dtype=torch.float64, device=self.device)
            for index, term in enumerate(terms):
                if term is not None:
                    gathered[index, self.replicas.replica] = term
            self.transport.finish(self.transport.all_reduce(
                gathered, f"rank {self.rank}: clip_grad_norm_: the norm's terms over the replicas (shard_optimizer)",
                self._data_group))
            terms = list((gathered.amax(dim=1) if infinite else gathered.sum(dim=1)).unbind())
        if infinite:
            local = max((term.clone() for term in terms if term is not None), default=None)
            total = torch.zeros((), dtype=torch.float64, device=self.device) if local is None else local
            reduce_op = dist.ReduceOp.MAX
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for term in terms:
                if term is not None:
                    total += term
            reduce_op = dist.ReduceOp.SUM
        if self.world_size > 1 and dist.is_initialized():  # over this replica's ranks (the others hold the same)
            dist.all_reduce(total, op=reduce_op, group=self._pipeline_group)
        norm = float(total) if infinite else float(total) ** (1.0 / norm_type)
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for grad in grads:
                if grad is not None:
                    grad.mul_(scale)
        return norm

    def optimizer_step(self) -> None:
        """Step the attached optimizer with the gradients of the last `step`, then zero them."""
        if self.optimizer is None:
            raise ExecutionError(f"rank {self.rank}: optimizer_step without an optimizer; call attach_optimizer first")
        self.optimizer.step()
        self.zero_grad()

    # -- one iteration ---------------------------------------------------------------------------------
    def step(self, inputs: Sequence[Tensor], target: Tensor | None = None) -> float:
        """Run the program on one full batch (cut along dim 0 into microbatches): the loss, the mean
        of the microbatches' (weighted by `loss_weight` where given)."""
        return self._run_program(self.program.instructions, inputs, target, "step()")

    def evaluate(self, inputs: Sequence[Tensor], target: Tensor | None = None) -> float:
        """The loss of one full batch with forwards only, as a validation pass computes it: every
        stage module in eval mode (dropout off, BatchNorm on its running statistics), no autograd
        graph, the microbatches' mean (weighted by `loss_weight`) on every rank, as `step` returns
        it. Nothing else changes: no gradient is touched, the stages' random streams do not
        advance, and each module's training flag is restored. A collective, like `step`: every
        rank calls it. The program is this rank's training program without its backward half (its
        forwards and their messages keep their order, so it runs wherever the training program
        does); a recomputing stage just runs its forward."""
        if self._eval_program is None:
            kept = (InstrKind.RECV_ACT, InstrKind.SEND_ACT, InstrKind.FORWARD, InstrKind.STEP)
            self._eval_program = tuple(i for i in self.program.instructions if i.kind in kept)
        modes = {module: module.training for stage in self.stages.values() for module in stage.module.modules()}
        self._evaluating = True
        try:
            for module in modes:
                module.training = False
            with torch.no_grad():
                return self._run_program(self._eval_program, inputs, target, "evaluate()")
        finally:
            self._evaluating = False
            for module, training in modes.items():
                module.training = training

    def _run_program(self, instructions: Sequence[Instruction], inputs: Sequence[Tensor], target: Tensor | None,
                     call: str) -> float:
        if isinstance(inputs, Tensor):
            inputs = (inputs,)  # one input tensor, as compile's example_inputs takes it
        if not isinstance(inputs, (tuple, list)):
            raise ArgumentError(f"rank {self.rank}: {call}: inputs must be a tensor or a tuple of tensors (one batch), "
                                f"got {type(inputs).__name__}")
        batch = (*inputs, target) if target is not None else tuple(inputs)
        self._check_example_batch(batch, len(inputs), call)
        count = self.num_microbatches
        self._micro: list[tuple[Tensor, ...]] = []
        if any(kind == "batch" for fetch in self._fetch.values() for kind, _, _ in fetch):
            if self.batch_specs is None:  # (with them, every tensor was checked above)
                self._check_batch(batch, len(inputs), count, call)
            chunks = [t.to(self.device, non_blocking=True).chunk(count) for t in batch]
            self._micro = [tuple(chunk[m] for chunk in chunks) for m in range(count)]
        self._slots: dict[tuple[int, int], _Slot] = {}
        if self._meter is not None and not self._evaluating:
            self._meter.exclude(self._masters.values())  # (fp32 copies: static memory, as the weights)
            self._meter.start_step(t for micro in self._micro for t in micro)
        self._inbox: dict[tuple[int, int, int, int], Pending] = {}
        self._outgoing: list[Pending] = []
        self._reductions: list[Pending] = []
        self._loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._loss: float = float("nan")
        replicas = self.replicas.size  # each replica's microbatches weigh 1/replicas of the step: gradients sum
        self._weights = [1.0 / (count * replicas)] * count
        if self.loss_weight is not None and any(stage.is_loss for stage in self.stages.values()):
            if target is None:
                raise ArgumentError(f"rank {self.rank}: {call}: this engine weighs microbatches by loss_weight(target) "
                                    f"but got no target: call {call[:-2]}(inputs, target)")
            totals: list[float] = []

            def total_of(local: float) -> float:  # (every replica's count, where there are several)
                totals.append(self._total_over_replicas(local) if replicas > 1 else local)
                return totals[-1]

            self._weights = microbatch_weights(self.loss_weight, target, count, f"rank {self.rank}: {call}", total_of)
            if totals and totals[0] <= 0:  # no target counts in the whole batch: the loss is nan, as a mean of none
                self._loss_sum += float("nan")
        # a tied gradient is all-reduced (every gradient, with replicas; and with fp16 every one is
        # unscaled): set aside what earlier steps accumulated, so only this step's contributions
        # are summed across ranks and unscaled (added back at `step`)
        self._tied_earlier = {}
        every = self.replicas.size > 1 or self.loss_scaler is not None
        for name in (sorted(self._params) if every else sorted(self._tied_ranks)) if not self._evaluating else ():
            if name in self._params:
                self._tied_earlier[name] = self._grad(name)
                self._set_grad(name, None)
        handlers = self._handlers
        timeline = self.timeline
        clock = time.perf_counter
        buckets = self._buckets if not self._evaluating else {}
        self._bucket_work: list[tuple[Pending, list[tuple[str, tuple[int, int]]], Tensor, bool]] = []
        for position, instruction in enumerate(instructions):
            self._position = position
            try:
                if timeline is None:
                    handlers[instruction.kind](instruction)
                else:
                    start = clock()
                    self._inputs_ready = 0.0
                    handlers[instruction.kind](instruction)
                    timeline.append((instruction, max(start, self._inputs_ready), clock()))
                if position in buckets:  # these gradients are final: sum them over the replicas beside the rest
                    self._reduce_bucket(buckets[position], self._where(instruction))
            except ExecutionError:
                raise
            except Exception as exc:
                raise ExecutionError(f"rank {self.rank}: step {position} ({instruction}): {type(exc).__name__}: {exc}") from exc
        self.finish_param_sync()  # (every stage has forwards: nothing is left, unless a stage never ran one)
        return self._loss

    def _where(self, instruction: Instruction) -> str:
        return f"step {self._position} ({instruction})"

    def _lazy_where(self, instruction: Instruction) -> Callable[[], str]:
        position = self._position
        return lambda: f"step {position} ({instruction})"

    def _slot(self, stage: int, microbatch: int) -> _Slot:
        slot = self._slots.get((stage, microbatch))
        if slot is None:
            slot = self._slots[(stage, microbatch)] = _Slot(len(self.stages[stage].outputs))
        return slot

    # communication
    def _recv_act(self, i: Instruction) -> None:
        consumer, producer, m = i.stage, i.peer_stage, i.microbatch
        specs = [self.stages[consumer].inputs[k].spec for k in self._recv_layout[(producer, consumer)]]
        tags = [tag(KIND_ACT, producer, consumer, m, j) for j in range(len(specs))]
        self._inbox[(KIND_ACT, producer, consumer, m)] = self.transport.irecv(
            [(s.shape, s.dtype) for s in specs], self.replicas.global_rank(i.peer), tags, self._lazy_where(i))

    def _recv_grad(self, i: Instruction) -> None:
        producer, consumer, m = i.stage, i.peer_stage, i.microbatch
        stage = self.stages[producer]
        specs = [stage.outputs[j] for j in stage.outputs_to(consumer) if stage.outputs[j].requires_grad]
        if not specs:
            return
        tags = [tag(KIND_GRAD, producer, consumer, m, j) for j in range(len(specs))]
        self._inbox[(KIND_GRAD, producer, consumer, m)] = self.transport.irecv(
            [(s.shape, s.dtype) for s in specs], self.replicas.global_rank(i.peer), tags, self._lazy_where(i))

    def _send(self, tensors: list[Tensor], i: Instruction, kind: int, producer: int, consumer: int) -> None:
        # drop finished sends first: a sent tensor is not kept alive until the end of the iteration
        if self._outgoing:
            still = []
            for pending in self._outgoing:
                if all(work.is_completed() for work in pending.works):
                    self.transport.wait(pending, self._lazy_where(i))  # returns at once, or raises its error
                else:
                    still.append(pending)
            self._outgoing = still
        tags = [tag(kind, producer, consumer, i.microbatch, j) for j in range(len(tensors))]  # type: ignore[arg-type]
        peer = self.replicas.global_rank(i.peer)  # type: ignore[arg-type]
        self._outgoing.append(self.transport.isend(tensors, peer, tags, self._lazy_where(i)))  # type: ignore[arg-type]

    def _send_act(self, i: Instruction) -> None:
        producer, consumer, m = i.stage, i.peer_stage, i.microbatch
        slot = self._slots[(producer, m)]
        assert slot.outputs is not None
        stage = self.stages[producer]
        tensors = [slot.outputs[j].detach().contiguous() for j in stage.outputs_to(consumer)]
        for j, tensor in zip(stage.outputs_to(consumer), tensors):
            spec = stage.outputs[j]
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ExecutionError(
                    f"rank {self.rank}: {self._where(i)}: output {spec.name} is {tuple(tensor.shape)} {tensor.dtype}, but "
                    f"the pipeline was compiled for {spec.shape} {spec.dtype} (what stage {consumer} receives); compile "
                    "with the autocast the engine runs (and the model on the device type it runs on)")
        self._send(tensors, i, KIND_ACT, producer, consumer)
        self._taken(producer, slot)

    def _taken(self, index: int, slot: _Slot) -> None:
        """One more consumer has stage `index`'s outputs of this microbatch. Once all have, the
        data of the outputs its B needs only for their autograd graph (Megatron's
        deallocate_output_tensor) is released: a stage's outputs, a head's logits, are not held
        from F to B (the simulator counts only what autograd saves). A message still being sent
        keeps its own reference until it is."""
        slot.reads_left -= 1
        releasable = self._releasable[index]
        if slot.reads_left > 0 or slot.outputs is None or not releasable or not self.release_outputs:
            return
        recompute = self.stages[index].recompute
        # (a recomputing stage's outputs have no graph; one may share an input B runs again on)
        inputs = {t.untyped_storage().data_ptr() for t in slot.inputs or ()} if recompute else set()
        for j in releasable:
            tensor = slot.outputs[j]
            if (tensor._base is not None or tensor.untyped_storage().data_ptr() in inputs
                    or not (recompute or tensor.grad_fn is not None)):
                continue  # (a view shares its base's storage; without a graph it is not an activation)
            slot.released.append((j, tensor.shape, tensor.dtype))
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            if slot.held_outputs:
                slot.held_outputs[j] = None

    def _send_grad(self, i: Instruction) -> None:
        consumer, producer, m = i.stage, i.peer_stage, i.microbatch
        slot = self._slots[(consumer, m)]
        stage = self.stages[consumer]
        assert slot.input_grads is not None
        tensors = []
        for k in self._recv_layout[(producer, consumer)]:
            if stage.inputs[k].spec.requires_grad:
                grad = slot.input_grads[k]
                tensors.append(grad.contiguous() if grad is not None else torch.zeros(stage.inputs[k].spec.shape,
                               dtype=stage.inputs[k].spec.dtype, device=self.device))
                slot.input_grads[k] = None
        if tensors:
            self._send(tensors, i, KIND_GRAD, producer, consumer)

    # compute
    def _forward(self, i: Instruction) -> None:
        index, m = i.stage, i.microbatch
        if self._gathering:  # overlap_param_gather: this stage's updated shares, before its first forward
            self.finish_param_sync(index)
        stage = self.stages[index]
        args: list[Tensor] = []
        received: dict[int, list[Tensor]] = {}
        local: set[int] = set()
        for (kind, a, b), src in zip(self._fetch[index], stage.inputs):
            if kind == "batch":
                args.append(self._micro[m][a])
                continue
            if kind == "local":
                value = self._slots[(a, m)].outputs[b].detach()  # type: ignore[index]
                local.add(a)
            else:
                if a not in received:
                    pending = self._inbox.pop((KIND_ACT, a, index, m), None)
                    if pending is None:
                        raise ExecutionError(f"rank {self.rank}: {self._where(i)}: activations from stage {a} were never "
                                             "received (no recv_act before this forward)")
                    received[a] = self.transport.wait(pending, self._lazy_where(i))
                    if self.timeline is not None:
                        self._inputs_ready = time.perf_counter()
                position = self._recv_layout[(a, index)].index(len(args))
                value = received[a][position]
            args.append(value.requires_grad_(src.spec.requires_grad) if src.spec.requires_grad else value)
        for producer in local:
            self._taken(producer, self._slots[(producer, m)])
        slot = self._slot(index, m)
        slot.reads_left = self._consumer_counts[index]
        if self._evaluating:  # no graph to keep and no random stream to advance (dropout is off)
            with amp.autocast(self.autocast, self.device):
                slot.outputs = self._run(stage, args)
            if stage.is_loss and self._weights[m]:
                self._loss_sum += slot.outputs[0].float() * self._weights[m]
            return
        slot.inputs = args
        slots = self._buffer_slots.get(index)
        buffers = _BuffersAtForward(slots) if slots is not None else None
        if stage.recompute and slots:
            slot.buffers = buffers
        with self._stage_random(index), self._metered():
            if stage.recompute:  # keep no autograd graph: the inputs, and the RNG state for B's second forward
                slot.rng_state = (torch.get_rng_state(),
                                  torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
            with torch.set_grad_enabled(not stage.recompute), amp.autocast(self.autocast, self.device):
                if stage.selective:  # autograd keeps the heavy ops' outputs; B recomputes the rest
                    slot.outputs = selective_checkpoint(functools.partial(self._run_again_at_b, stage, buffers), args)
                else:
                    slot.outputs = self._run(stage, args)
        if self._meter is not None:
            slot.held = self._meter.holds(args)
            slot.held_outputs = [self._meter.hold(t) for t in slot.outputs]
        if stage.is_loss and self._weights[m]:  # a weightless microbatch's loss may be nan (no real token)
            self._loss_sum += slot.outputs[0].detach().float() * self._weights[m]

    def _metered(self) -> contextlib.AbstractContextManager[None]:
        """Where a forward runs: with an activation meter, what autograd saves is counted."""
        return self._meter.saving() if self._meter is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _stage_random(self, index: int) -> Iterator[None]:
        """Run with stage `index`'s random state as the global one (kept for its next forward);
        the process' own state is left as it was."""
        cpu_state, cuda_state = self._random[index]
        with torch.random.fork_rng(devices=[self.device] if cuda_state is not None else [], device_type="cuda"):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)
            try:
                yield
            finally:
                self._random[index] = (torch.get_rng_state(),
                                       torch.cuda.get_rng_state(self.device) if cuda_state is not None else None)

    @staticmethod
    def _run(stage: StageModule, args: Sequence[Tensor]) -> tuple[Tensor, ...]:
        outputs = stage(*args)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    def _run_again_at_b(self, stage: StageModule, buffers: _BuffersAtForward,
                        args: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """A selective stage's forward: as it is at F, and at B (the checkpoint runs it again, after
        F has kept `buffers`) on the buffers as F found them."""
        if not buffers.ran:
            buffers.ran = True
            return self._run(stage, args)
        with buffers.restored():
            return self._run(stage, args)

    def _recompute(self, stage: StageModule, slot: _Slot) -> None:
        """The forward again, with grad, on F's inputs and RNG state. F's input leaves are reused:
        nothing was recorded on them under no_grad."""
        assert slot.inputs is not None and slot.rng_state is not None
        cpu_state, cuda_state = slot.rng_state
        buffers = slot.buffers.restored() if slot.buffers is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[self.device] if cuda_state is not None else [], device_type="cuda"):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)
            with torch.enable_grad(), amp.autocast(self.autocast, self.device), buffers, self._metered():
                slot.outputs = self._run(stage, slot.inputs)
            slot.released = []  # (outputs of their own now)
            if self._meter is not None:
                slot.held_outputs = [self._meter.hold(t) for t in slot.outputs]
        slot.rng_state = None
        slot.buffers = None

    def _backward_input(self, i: Instruction) -> None:
        """B: input gradients; split linears stash their weight gradients for W."""
        index, m = i.stage, i.microbatch
        stage = self.stages[index]
        slot = self._slots[(index, m)]
        assert slot.outputs is not None and slot.inputs is not None
        if not stage.is_loss:
            for consumer in stage.consumers():
                if consumer in self.stages:
                    continue
                pending = self._inbox.pop((KIND_GRAD, index, consumer, m), None)
                if pending is None:
                    continue  # a message with no gradient tensors
                layout = [j for j in stage.outputs_to(consumer) if stage.outputs[j].requires_grad]
                for j, grad in zip(layout, self.transport.wait(pending, self._lazy_where(i))):
                    current = slot.output_grads[j]
                    slot.output_grads[j] = grad if current is None else current + grad
                if self.timeline is not None:
                    self._inputs_ready = time.perf_counter()
        if stage.recompute:
            # after the gradients arrived: B's measured time (from its inputs' arrival) includes it
            self._recompute(stage, slot)
        for j, shape, dtype in slot.released:  # (backward checks each gradient's shape against its output's)
            slot.outputs[j].data = torch.empty(shape, dtype=dtype, device=self.device)
        tensors: list[Tensor] = []
        grads: list[Tensor] = []
        if stage.is_loss:
            tensors.append(slot.outputs[0])
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            grads.append(torch.full_like(slot.outputs[0], self._weights[m] * scale))
        else:
            for j, spec in enumerate(stage.outputs):
                grad = slot.output_grads[j]
                if spec.requires_grad and grad is not None and slot.outputs[j].requires_grad:
                    tensors.append(slot.outputs[j])
                    grads.append(grad)
        if tensors:
            slot.stash = WeightGradStash()
            with deferred_weight_grads(slot.stash):
                torch.autograd.backward(tensors, grads)
            if self._meter is not None:
                slot.held_for_w = self._meter.holds(t for _, args in slot.stash.entries for t in tensors_in(args))
        input_grads: list[Tensor | None] = [None] * len(stage.inputs)
        for k, ((kind, a, b), src) in enumerate(zip(self._fetch[index], stage.inputs)):
            if kind == "batch" or not src.spec.requires_grad:
                continue
            grad = slot.inputs[k].grad
            if kind == "local":
                if grad is not None:
                    producer = self._slots[(a, m)]
                    current = producer.output_grads[b]
                    producer.output_grads[b] = grad if current is None else current + grad
            else:
                input_grads[k] = grad
        if self._folded:
            self._fold_grads(index)
        # drop the microbatch's activations now; what remains is sent (input_grads) or run at W (stash)
        slot.input_grads = input_grads
        slot.inputs = None
        slot.outputs = None
        slot.output_grads = []
        slot.held = []
        slot.held_outputs = []
        slot.released = []

    def _backward(self, i: Instruction) -> None:
        # a full backward is B then W at once: measured on CPU, deferring the split linears'
        # weight gradients to the end of the backward runs faster than computing them inline
        # (and makes a full backward cost exactly B + W, as the simulator assumes)
        self._backward_input(i)
        self._backward_weight(i)

    def _backward_weight(self, i: Instruction) -> None:
        slot = self._slots[(i.stage, i.microbatch)]  # type: ignore[index]
        if slot.stash is not None:
            slot.stash.run()
            slot.stash = None
        slot.held_for_w = []
        if self._folded:
            self._fold_grads(i.stage)  # type: ignore[arg-type]

    # iteration end
    def _reduce_tied(self, i: Instruction) -> None:
        group = self._tied_groups.get(tuple(i.ranks))
        param = self._params.get(i.param)  # type: ignore[arg-type]
        if param is None:
            raise ExecutionError(f"rank {self.rank}: {self._where(i)}: this rank holds no parameter {i.param!r}")
        if not param.requires_grad:
            return  # frozen (on every rank: compile copies the model's flags): no gradient, as in the plain model
        name: str = i.param  # type: ignore[assignment]
        grad = self._grad(name)
        if grad is None:
            grad = torch.zeros_like(param, dtype=torch.float32 if name in self._fp32_names else param.dtype)
            self._set_grad(name, grad)
        if group is None and self.world_size > 1:
            raise ExecutionError(f"rank {self.rank}: {self._where(i)}: no process group for ranks {i.ranks}")
        if group is not None:
            self._reductions.append(self.transport.all_reduce(grad, self._where(i), group))

    def _step(self, i: Instruction) -> None:
        for pending in self._outgoing:
            self.transport.wait(pending, self._lazy_where(i))
        self._outgoing = []
        for pending in self._reductions:
            self.transport.finish(pending)
        self._reductions = []
        if self.replicas.size > 1 and not self._evaluating:
            self._reduce_over_replicas(i)
        if self.loss_scaler is not None and not self._evaluating:
            self._unscale(i)
        for name, earlier in self._tied_earlier.items():
            if earlier is not None and name in self._mine:  # (sharded: another replica's alone, dropped)
                grad = self._grad(name)
                self._set_grad(name, earlier if grad is None else earlier.add_(grad))
        self._tied_earlier = {}
        if self._inbox:
            raise ExecutionError(f"rank {self.rank}: {self._where(i)}: {len(self._inbox)} received messages were never "
                                 f"used: {sorted(self._inbox)}")
        loss = self._loss_sum
        if self.world_size > 1 and dist.is_initialized():
            self.transport.finish(self.transport.all_reduce(loss, self._where(i)))
        self._loss = float(loss)
        self._slots.clear()
        self._micro = []

    def _unscale(self, i: Instruction) -> None:
        """fp16: divide this step's gradients by the loss scale and agree with every rank whether
        any is inf or nan; if one is, drop all gradients (earlier steps' too) and skip the step."""
        scaler = self.loss_scaler
        assert scaler is not None
        inverse = 1.0 / scaler.scale
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        for name in self._params:
            grad = self._grad(name)
            if grad is not None:
                grad.mul_(inverse)
                found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
        if self.world_size > 1 and dist.is_initialized():
            self.transport.finish(self.transport.all_reduce(found, f"{self._where(i)}: the inf/nan check of fp16"))
        self.skipped_step = bool(found > 0)
        if self.skipped_step:
            for param in self._params.values():
                param.grad = None
            self._main_grads.clear()
            self._tied_earlier = {}
        scaler.update(self.skipped_step)

    def _broadcast_from_first_replica(self) -> None:
        """Collective over each data-parallel group: replica 0's parameters and buffers, flat per
        dtype, in name order."""
        if self._data_group is None:
            return
        tensors = [t for _, t in sorted(self._params.items())] + [b for _, b in sorted(self.named_buffers())]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        source = self.replicas.data_ranks(self.replicas.stage_rank)[0]
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=source, group=self._data_group)
                offset = 0
                for tensor in group:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def _total_over_replicas(self, total: float) -> float:
        """The loss_weight count summed over this pipeline rank's replicas (the loss stage's ranks)."""
        value = torch.tensor(total, dtype=torch.float64, device=self.device)
        self.transport.finish(self.transport.all_reduce(value, f"rank {self.rank}: the batch's loss_weight count",
                                                        self._data_group))
        return float(value)

    def _plan_buckets(self) -> dict[int, tuple[str, ...]]:
        """Instruction position -> the parameters whose gradients are final once it has run: a
        stage's after its last backward instruction on this rank (one that two of the rank's
        stages share goes with the later). Parameters tied across ranks are left to `step`, after
        their tied all-reduce, and so is any other the buckets miss."""
        last: dict[int, int] = {}
        for position, instruction in enumerate(self.program.instructions):
            if instruction.kind in (InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT):
                last[instruction.stage] = position  # type: ignore[index]
        ready: dict[str, int] = {}
        for index, stage in self.stages.items():
            for name, _ in stage.named_parameters():
                if index in last and name not in self._tied_ranks:
                    ready[name] = max(ready.get(name, -1), last[index])
        buckets: dict[int, list[str]] = {}
        for name in sorted(ready):
            buckets.setdefault(ready[name], []).append(name)
        return {position: tuple(names) for position, names in buckets.items()}

    def _reduce_bucket(self, names: Sequence[str], where: str) -> None:
        """Start summing these parameters' gradients over this pipeline rank's replicas (each
        microbatch already weighs 1/replicas): one flat all-reduce per gradient dtype, in name
        order; with `shard_optimizer`, one flat reduce per replica and dtype of the rows it steps
        (`shard_rows`) onto that replica alone (the bytes of a reduce-scatter). `step` waits for
        them and copies the sums back (sharded: into this replica's rows; the gradient of a
        parameter of which it steps no rows is dropped)."""
        groups: dict[tuple[int, torch.dtype], list[tuple[str, tuple[int, int]]]] = {}
        for name in names:
            grad = self._grad(name)
            if grad is not None:
                pieces = self.shard_rows[name] if self.shard_optimizer else ((-1, 0, _num_rows(grad)),)
                for owner, first, end in pieces:
                    groups.setdefault((owner, grad.dtype), []).append((name, (first, end)))
        ranks = self.replicas.data_ranks(self.replicas.stage_rank)
        for (owner, _), group in groups.items():
            flat = torch.cat([_rows_of(self._grad(name), rows).reshape(-1) for name, rows in group])  # type: ignore[arg-type]
            if owner < 0:
                pending = self.transport.all_reduce(flat, where, self._data_group)
            else:
                pending = self.transport.reduce(flat, ranks[owner], f"{where}: the gradients replica {owner} steps "
                                                "(shard_optimizer)", self._data_group)
            self._bucket_work.append((pending, group, flat, owner in (-1, self.replicas.replica)))

    def _reduce_over_replicas(self, i: Instruction) -> None:
        """Finish the step's sums over the replicas: the buckets started beside the backward,
        then the gradients none of them held (the parameters tied across ranks)."""
        bucketed = {name for names in self._buckets.values() for name in names}
        self._reduce_bucket([name for name in sorted(self._params) if name not in bucketed], self._where(i))
        reduced = set()
        for pending, pieces, flat, mine in self._bucket_work:
            self.transport.finish(pending)
            offset = 0
            for name, rows in pieces:
                piece = _rows_of(self._grad(name), rows)  # type: ignore[arg-type]
                if mine:
                    piece.copy_(flat[offset:offset + piece.numel()].view_as(piece))
                offset += piece.numel()
                reduced.add(name)
        for name in reduced - self._mine.keys():  # others' alone: only partly summed here, and they step it
            self._set_grad(name, None)
        self._bucket_work = []

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard, keyed by original names (see the module docstring)."""
        self.finish_param_sync()
        model = {name: p.detach() for name, p in self._params.items()}
        model.update({name: b.detach() for name, b in self.named_buffers()})
        state: dict[str, Any] = {"model": model}
        if self.optimizer is not None:
            state["optimizer"] = self._named_optimizer_state()
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        state["random"] = self._streams()
        return state

    def _streams(self) -> dict[str, Any]:
        """This rank's stages' dropout streams, by `_stream_key`."""
        return {self._stream_key(index): self._random[index] for index in self.stages}

    def _stream_key(self, index: int, replica: int | None = None) -> str:
        """What names stage `index`'s dropout stream in a checkpoint: its index and a digest of its
        parameters' names and its traced code (which tells apart stages without parameters), so a
        resume restores it only into the same stage of the same plan (a stage of another plan
        draws from its own stream); and the replica, after the first (default: this rank's), whose
        ranks may have drawn other streams (seeded apart)."""
        import hashlib

        stage = self.stages[index]
        parts = sorted(name for name, _ in stage.named_parameters())
        # a stage split for torch.compile calls the same split linear by its other name
        # (passes/split_backward.py): one stage, one stream, compiled or not
        parts.append(str(getattr(stage.module, "code", "")).replace("split_linear_uncompiled", "split_linear"))
        key = f"stage {index} {hashlib.sha1(chr(0).join(parts).encode()).hexdigest()[:16]}"
        replica = self.replicas.replica if replica is None else replica
        return f"{key} replica {replica}" if replica else key

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load the entries this rank holds from a full (merged) state or a shard."""
        if not isinstance(state, Mapping) or not isinstance(state.get("model"), Mapping):
            keys = sorted(map(str, state))[:8] if isinstance(state, Mapping) else type(state).__name__
            raise ArgumentError(f"rank {self.rank}: load_state_dict takes {{'model': {{name: tensor}}, 'optimizer': "
                                f"..., }} as state_dict / gather_state_dict give it, got {keys}; a plain model's "
                                "state dict goes in as {'model': model.state_dict()}")
        self.finish_param_sync()  # a broadcast still running would overwrite what is loaded
        load_named([*((name, param, strict) for name, param in self._params.items()),
                    *((name, buffer, False) for name, buffer in self.named_buffers())], state["model"], self.rank, "state")
        where = f"rank {self.rank}: load_state_dict"
        with torch.no_grad():  # the master copies: the saved fp32 values, else the loaded weights
            for name, master in self._masters.items():
                value = saved_master(state, name)
                rows = self._split.get(name)
                if value is None:
                    value = _rows_of(self._params[name], self._mine[name])
                elif rows is not None:
                    value = saved_rows(value, state["optimizer"]["state"][name], rows, f"{where}: {name!r}")
                master.copy_(value)
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer_load = load_optimizer_state(self.optimizer, self._optimizer_named(), state["optimizer"],
                                                       where, self._split)
        elif "optimizer" in state and self._params:
            warnings.warn(f"rank {self.rank}: load_state_dict: the state holds optimizer state but this engine has no "
                          "optimizer, so it is not loaded; attach the optimizer first (pipe.engine(rank, "
                          "optimizer=...) or engine.attach_optimizer), then load", OctopipeWarning, stacklevel=2)
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        streams = state.get("random")
        if isinstance(streams, Mapping):
            for index in self.stages:
                # a replica's own stream, else the first replica's (a checkpoint of fewer replicas)
                saved = streams.get(self._stream_key(index), streams.get(self._stream_key(index, 0)))
                if saved is not None:
                    cpu_state, cuda_state = saved
                    keep_cuda = self._random[index][1]
                    self._random[index] = (cpu_state.cpu(), cuda_state.cpu() if cuda_state is not None and
                                           keep_cuda is not None else keep_cuda)

    def _own_shard(self) -> dict[str, Any]:
        """What this rank adds to the merged state: with replicas, replica 0's ranks their whole
        state; the others their dropout streams, and with `shard_optimizer` their rows of the
        optimizer's state (the rest they hold equal to replica 0's)."""
        self.finish_param_sync()
        if self.replicas.replica == 0:
            return self.state_dict()
        shard: dict[str, Any] = {"model": {}, "random": self._streams()}
        if self.shard_optimizer and self.optimizer is not None:
            shard["optimizer"] = self._named_optimizer_state()
        return shard

    def gather_state_dict(self, dst: int = 0) -> dict[str, Any] | None:
        """Collective: the merged state of all ranks on rank `dst` (None elsewhere). With
        replicas, replica 0's ranks hold it all; the others send only their dropout streams, and
        with `shard_optimizer` their share of the optimizer's state."""
        shard = self._own_shard()
        if self.world_size == 1 or not dist.is_initialized():
            return merge_state_dicts([shard])
        cpu_shard = _to_cpu(shard)
        shards: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(cpu_shard, shards, dst=dst)
        return merge_state_dicts(shards) if shards is not None else None

    def save_checkpoint(self, path: str | os.PathLike[str], sharded: bool = False, background: bool = False,
                        extra: Mapping[str, Any] | None = None) -> None:
        """Collective: gather to rank 0, which writes `path` atomically; all ranks return after.
        `sharded=True`: nothing is gathered; `path` is a directory where every rank writes its
        own shard (`_own_shard`) and rank 0 then the index naming them (`SHARDED_INDEX`), as
        Megatron's ranks write their own checkpoint files, so no process holds more than its own
        state. Loading a directory (`load_checkpoint`, `init=`, `checkpoint_state`) merges its
        shards, read memory-mapped, into the same state as the gathered file's; a directory
        saved over again keeps the shards of the last complete save (a crash mid-save leaves
        the index naming the previous ones) and drops the others once the new index is in.
        `background=True` (sharded only; Megatron's `--async-save`): each rank copies its shard
        into shared memory and returns, a process of its own (`octopipe.runtime.writer`, started
        by the first such save) writing the file while training goes on; the save is
        complete, its index written, at `finish_checkpoint()`, which the next save calls first
        and every rank must call before it exits (until then the directory holds the previous
        complete save). `extra`: the training loop's own state to keep beside the engine's (the
        iteration, an LR scheduler's `state_dict()`, ...), rank 0's saved, `load_checkpoint`
        returning it: tensors, numbers, strings, None, and lists, tuples and string-keyed dicts
        of them (what a checkpoint read with `weights_only` holds)."""
        if extra is not None:
            if not isinstance(extra, Mapping):
                raise ArgumentError(f"rank {self.rank}: save_checkpoint(extra=...) takes a dict of the loop's own state "
                                    f"(e.g. {{'iteration': 100}}), got {type(extra).__name__}")
            _check_extra(extra, "extra", self.rank)
        if not isinstance(sharded, bool) or not isinstance(background, bool):
            raise ArgumentError(f"rank {self.rank}: save_checkpoint(sharded={sharded!r}, background={background!r}): "
                                "each must be True or False")
        if background and not sharded:
            raise ArgumentError(f"rank {self.rank}: save_checkpoint(background=True) writes each rank's own shard "
                                "beside training, which needs sharded=True (a gathered file is rank 0's to write "
                                "whole); pass sharded=True too")
        self.finish_checkpoint()  # (an earlier background save completes first)
        if sharded:
            self._save_sharded(os.fspath(path), background, extra)
            return
        state = self.gather_state_dict(0)
        if state is not None and extra is not None:
            state["extra"] = _to_cpu(dict(extra))
        error = None
        if self.rank == 0:
            try:
                atomic_save(state, path)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = exc
        if self.world_size > 1 and dist.is_initialized():
            flag = [error is not None]
            dist.broadcast_object_list(flag, src=0)
            if flag[0] and error is None:
                raise ExecutionError(f"rank {self.rank}: checkpoint save to {os.fspath(path)!r} failed on rank 0")
        if isinstance(error, OSError):
            raise ExecutionError(f"rank {self.rank}: cannot write checkpoint {os.fspath(path)!r}: "
                                 f"{error.strerror or error}; give a path in an existing, writable folder") from None
        if error is not None:
            raise error

    def _save_sharded(self, path: str, background: bool, extra: Mapping[str, Any] | None = None) -> None:
        """`save_checkpoint(path, sharded=True)`: this rank's shard written (in the background by
        the writer process, `octopipe.runtime.writer`), then `_commit_sharded` (at
        `finish_checkpoint`, in the background)."""
        import uuid

        collective = self.world_size > 1 and dist.is_initialized()
        token = [uuid.uuid4().hex[:12]]
        if collective:  # (one name for the save, rank 0's, so the index can tell its shards from older ones)
            dist.broadcast_object_list(token, src=0)
        name = _shard_file(token[0], self.rank, self.world_size)
        errors: list[BaseException] = []

        def write(shard: Any) -> None:
            try:
                os.makedirs(path, exist_ok=True)
                atomic_save(shard, os.path.join(path, name))
            except Exception as exc:  # noqa: BLE001 - every rank learns of it at the commit, then raises
                errors.append(exc)

        try:
            shard = self._own_shard() if background else _to_cpu(self._own_shard())
            if extra is not None and self.rank == 0:
                shard["extra"] = _to_cpu(dict(extra))
            if background:  # one copy, into the writer's shared file (what the next steps change is not in it)
                self._shard_writer().submit(shard, os.path.join(path, name))
        except Exception as exc:  # noqa: BLE001 - as above
            errors.append(exc)
            background = False
        if errors:
            self._commit_sharded(path, token[0], name, errors)
        elif background:
            self._saving = (self._shard_writer(), path, token[0], name, errors)
        else:
            write(shard)
            self._commit_sharded(path, token[0], name, errors)

    def start_checkpoint_writer(self) -> None:
        """Start the process that writes background saves now (it imports torch: a second or
        two), rather than at the first `save_checkpoint(..., background=True)`, which would wait
        for it; a loop that will save in the background calls this before training."""
        self._shard_writer().start()

    def _shard_writer(self) -> ShardWriter:
        if self._writer is None:
            self._writer = ShardWriter()
        return self._writer

    def finish_checkpoint(self) -> None:
        """Collective where a background save (`save_checkpoint(..., background=True)`) is
        pending: wait for this rank's file, agree with every rank that all were written, and
        write the index that makes the save complete (rank 0). Nothing to do otherwise."""
        if self._saving is None:
            return
        writer, path, token, name, errors = self._saving
        self._saving = None
        error = writer.wait()
        if error is not None:
            errors.append(error)
        self._commit_sharded(path, token, name, errors)

    def _commit_sharded(self, path: str, token: str, name: str, errors: list[BaseException]) -> None:
        """After every rank wrote its shard (or failed): rank 0 writes the index naming the
        save's shards, last, and drops an earlier save's; every rank raises if any failed."""
        import json

        collective = self.world_size > 1 and dist.is_initialized()
        error = errors[0] if errors else None
        failed = [error is not None] * self.world_size
        if collective:
            dist.all_gather_object(failed, error is not None)
        if any(failed) and error is None:
            raise ExecutionError(f"rank {self.rank}: sharded checkpoint save to {path!r} failed on rank(s) "
                                 f"{[r for r, f in enumerate(failed) if f]}; the directory keeps its last complete save")
        if error is not None:
            why = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ExecutionError(f"rank {self.rank}: cannot write checkpoint shard {os.path.join(path, name)!r}: {why}; "
                                 "give a directory that can be created and written") from None
        index_error = None
        if self.rank == 0:  # the index last: it names a complete save
            files = [_shard_file(token, rank, self.world_size) for rank in range(self.world_size)]
            try:
                temporary = os.path.join(path, f".{SHARDED_INDEX}.tmp-{os.getpid()}")
                with open(temporary, "w", encoding="utf-8") as handle:
                    json.dump({"format": SHARDED_FORMAT, "world_size": self.world_size, "files": files}, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temporary, os.path.join(path, SHARDED_INDEX))
                for old in os.listdir(path):  # an earlier save's shards
                    if old.startswith("shard-") and old.endswith(".pt") and old not in files:
                        os.remove(os.path.join(path, old))
            except OSError as exc:
                index_error = exc.strerror or str(exc)
        flag = [index_error]
        if collective:
            dist.broadcast_object_list(flag, src=0)
        if flag[0] is not None:
            raise ExecutionError(f"rank {self.rank}: sharded checkpoint {path!r}: rank 0 could not write its index "
                                 f"({flag[0]}); the directory keeps its last complete save")

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a checkpoint written by `save_checkpoint`, a file or a sharded directory (every
        rank reads the entries it holds; any plan, rank or replica count). A background save
        still pending is finished first (collective), so its directory reads complete."""
        self.finish_checkpoint()
        state = checkpoint_state(os.fspath(path), self.rank)
        self.load_state_dict(state)  # type: ignore[arg-type]
        extra = state.get("extra") if state is not None else None
        return dict(extra) if isinstance(extra, Mapping) else {}


# -- state helpers (also for the plain model) -------------------------------------------------------


def _check_extra(value: Any, where: str, rank: int) -> None:
    """`save_checkpoint(extra=...)`: only what a checkpoint read with `weights_only` holds."""
    if isinstance(value, (Tensor, int, float, bool, str, type(None))):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_extra(item, f"{where}[{index}]", rank)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArgumentError(f"rank {rank}: save_checkpoint: {where} has the key {key!r}, not a string; use "
                                    "string keys")
            _check_extra(item, f"{where}[{key!r}]", rank)
        return
    raise ArgumentError(f"rank {rank}: save_checkpoint: {where} is a {type(value).__name__}, which a checkpoint read "
                        "with weights_only cannot hold; keep tensors, numbers, strings, None, and lists and dicts of "
                        "them (a scheduler's state_dict() without its functions, say)")


def _map_tensors(value: Any, function: Callable[[Tensor], Tensor]) -> Any:
    """`value` with `function` applied to every tensor in it (through dicts, lists, tuples)."""
    return map_leaves(value, Tensor, function)


def _to_cpu(value: Any) -> Any:
    """`value` with every tensor in it detached and on the CPU (itself where it is there)."""
    return _map_tensors(value, lambda tensor: tensor.detach().cpu())


_STAND_IN = "_octopipe_stand_in"
"""The attribute marking `Engine.attach_optimizer`'s stand-in parameter (a rank with none)."""


def named_optimizer_state(optimizer: torch.optim.Optimizer, named_parameters: Mapping[str, nn.Parameter]) -> dict[str, Any]:
    """optimizer.state_dict() with parameter names instead of positions."""
    name_of = {id(p): name for name, p in named_parameters.items()}
    raw = optimizer.state_dict()
    position_name: dict[int, str] = {}
    for group, raw_group in zip(optimizer.param_groups, raw["param_groups"]):
        for param, position in zip(group["params"], raw_group["params"]):
            if not getattr(param, _STAND_IN, False):
                position_name[position] = name_of[id(param)]
    return {
        "state": {position_name[k]: v for k, v in raw["state"].items() if k in position_name},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [position_name[p] for p in g["params"] if p in position_name]}
                         for g in raw["param_groups"]],
        "class": type(optimizer).__name__,
    }


def check_optimizer_class(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse to load a named optimizer state into another kind of optimizer: by the class it
    records (since stop 47), or, in an older state, by a setting its groups hold that this
    optimizer has none of (SGD's `momentum`, the Adam family's `betas`: an SGD loaded with
    AdamW's groups fails in its first step, without `momentum`)."""
    name = type(optimizer).__name__
    saved_class = saved.get("class")
    groups = saved.get("param_groups") or [{}]
    if saved_class is None:
        telling = [key for key in ("momentum", "betas") if key in groups[0] and key not in optimizer.defaults]
        saved_class = "another optimizer" if telling else None
    if saved_class is not None and saved_class != name:
        raise ExecutionError(f"{where}: the saved optimizer state is {saved_class}'s, this optimizer is {name}; resume "
                             "with the optimizer that saved it (train --optimizer), or take only the weights "
                             "(train --init, Engine(init=...))")


HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The weights' dtypes `master_weights` keeps fp32 copies of (and `fp32_grads` fp32 gradients for)."""

MASTER_KEY = "master"
"""Where a named optimizer state keeps a master copy's fp32 values (`Engine(master_weights=True)`)."""


def saved_master(state: Mapping[str, Any], name: str) -> Tensor | None:
    """The master copy of parameter `name` that a merged or shard state holds, or None."""
    optimizer = state.get("optimizer")
    entry = optimizer.get("state", {}).get(name) if isinstance(optimizer, Mapping) else None
    return entry.get(MASTER_KEY) if isinstance(entry, Mapping) else None


@dataclass(frozen=True)
class OptimizerLoad:
    """What `load_optimizer_state` found: whether the optimizer groups its parameters otherwise
    than the saved one did, and each setting whose saved value differs from the optimizer's own
    for some parameter, as (saved, own) pairs."""

    regrouped: bool = False
    differences: tuple[tuple[str, tuple[tuple[Any, Any], ...]], ...] = ()

    def note(self, where: str) -> str | None:
        parts = (["the saved optimizer grouped its parameters otherwise: each parameter's state was loaded by its "
                  "name"] if self.regrouped else [])
        parts += [f"{key} " + ", ".join(f"{saved} (now {own})" for saved, own in pairs)
                  for key, pairs in self.differences]
        return f"{where}: " + "; saved ".join(parts) if parts else None


def load_optimizer_state(optimizer: torch.optim.Optimizer, named_parameters: Mapping[str, nn.Parameter],
                         state: Mapping[str, Any], where: str = "load_optimizer_state",
                         split: Mapping[str, tuple[int, int, int]] | None = None) -> OptimizerLoad:
    """Load a named optimizer state (a shard or merged) into an optimizer over `named_parameters`
    (a master copy's values saved beside an entry are not the optimizer's: `load_state_dict`
    and `load_into_model` take them). `split`: name -> (first row, end row, rows) for each
    parameter the optimizer steps only some rows of (a sharded engine's): its saved state is
    cut to them (`saved_rows`).

    Each parameter's state is found by its name, so the optimizer may group the parameters
    otherwise than the saved one did (`train --weight-decay` makes two groups, where a run
    without it had one): a group whose parameters were all in one saved group takes that group's
    settings (lr, weight decay, ...: what `Optimizer.load_state_dict` restores), a group of
    parameters from several keeps its own. Returns what differed (`OptimizerLoad`): the grouping
    (a group of parameters from several saved groups, or a saved group's parameters in several
    groups here; a group left out for having no parameters is no difference), and the settings
    each parameter's saved group held against the optimizer's own before the load."""
    split = split or {}
    name_of = {id(p): name for name, p in named_parameters.items()}
    check_optimizer_class(state, optimizer, where)
    groups = state["param_groups"]
    saved_group = {name: index for index, group in enumerate(groups) for name in group.get("params", ())}
    raw_state: dict[int, Any] = {}
    raw_groups = []
    position = 0
    mixed = False
    owner_of_group: list[int | None] = []
    differences: dict[str, list[tuple[Any, Any]]] = {}
    for index, group in enumerate(optimizer.param_groups):
        positions = []
        names = [None if getattr(param, _STAND_IN, False) else name_of[id(param)] for param in group["params"]]
        for name in names:
            if name in state["state"]:
                entry = state["state"][name]
                raw_state[position] = {key: saved_rows(value, entry, split.get(name), f"{where}: {name!r}")
                                       for key, value in entry.items() if key not in (MASTER_KEY, ROWS_KEY)}
            positions.append(position)
            position += 1
        own = {k: v for k, v in group.items() if k != "params"}
        owners = sorted({saved_group[name] for name in names if name in saved_group})
        for owner in owners:
            for key, value in groups[owner].items():
                if key != "params" and key in own and value != own[key] and (value, own[key]) not in differences.get(key, []):
                    differences.setdefault(key, []).append((value, own[key]))
        mixed |= len(owners) > 1
        owner_of_group.append(owners[0] if len(owners) == 1 else None)
        if len(owners) == 1:
            settings = {k: v for k, v in groups[owners[0]].items() if k != "params"}
        elif not owners and len(groups) == len(optimizer.param_groups):  # (no named parameter: by position)
            settings = {k: v for k, v in groups[index].items() if k != "params"}
        else:  # parameters of several saved groups (or none): its own settings
            settings = own
        raw_groups.append({**settings, "params": positions})
    optimizer.load_state_dict({"state": raw_state, "param_groups": raw_groups})
    owned = [owner for owner in owner_of_group if owner is not None]
    return OptimizerLoad(mixed or len(owned) != len(set(owned)),
                         tuple((key, tuple(pairs)) for key, pairs in differences.items()))


SHARDED_INDEX = "octopipe-checkpoint.json"
"""The index file of a sharded checkpoint's directory (`Engine.save_checkpoint(path,
sharded=True)`): {"format": SHARDED_FORMAT, "world_size": N, "files": [one shard per rank]}."""

SHARDED_FORMAT = "octopipe sharded checkpoint 1"


def _shard_file(token: str, rank: int, world_size: int) -> str:
    """The file of rank `rank`'s shard in the sharded save named `token`."""
    return f"shard-{token}-rank{rank:05d}-of{world_size:05d}.pt"

ROWS_KEY = "rows"
"""Where a sharded engine's named optimizer state marks an entry that holds some rows of its
parameter only: (first row, end row, rows of the whole); `merge_state_dicts` joins the pieces."""

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                          torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
                          torch.optim.ASGD, torch.optim.Rprop)
"""The optimizers whose update of an element reads only that element's gradient and state (and
the step count): those `shard_optimizer` can step on rows of a parameter (Megatron's
distributed optimizer also takes Adam and SGD only)."""


def _num_rows(tensor: Tensor) -> int:
    """A tensor's rows: its length along dim 0 (a 0-d one is one row)."""
    return tensor.shape[0] if tensor.ndim else 1


def _rows_of(tensor: Tensor, rows: tuple[int, int]) -> Tensor:
    """Rows [first, end) of `tensor` (a view), or `tensor` itself where they are all of it."""
    first, end = rows
    return tensor if (first, end) == (0, _num_rows(tensor)) else tensor[first:end]


def saved_rows(value: Any, entry: Mapping[str, Any], rows: tuple[int, int, int] | None, where: str) -> Any:
    """The part of a saved optimizer state value (in `entry`, one parameter's) that an optimizer
    stepping rows `rows` = (first, end, rows of the whole) of it takes (None: all of it): a
    whole parameter's per-element tensors (length `rows` along dim 0) are cut to the rows; an
    entry saved by a sharded engine (`ROWS_KEY`) loads only where it holds those same rows."""
    saved = entry.get(ROWS_KEY)
    if saved is not None:
        if rows is None or tuple(saved) != tuple(rows):
            raise ExecutionError(f"{where}: the saved optimizer state holds rows {saved[0]}-{saved[1]} of "
                                 f"{saved[2]} only (one replica's share, shard_optimizer), but this optimizer steps "
                                 + ("all of them" if rows is None else f"rows {rows[0]}-{rows[1]}") +
                                 "; load the merged state (gather_state_dict, save_checkpoint), which joins every "
                                 "replica's share")
        return value
    if rows is None or not isinstance(value, Tensor) or value.ndim == 0 or value.shape[0] != rows[2]:
        return value  # (a step count, or a value of another shape: the same for every row)
    return value[rows[0]:rows[1]]


def shard_rows(units: Sequence[Sequence[tuple[str, tuple[int, ...]]]], replicas: int
               ) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """How `shard_optimizer` splits a pipeline rank's parameters between its `replicas` copies:
    name -> its pieces, (replica, first row, end row) each, the rows (a slice along dim 0, so a
    piece keeps its parameter's dimensions; a 0-d parameter is one row) whose optimizer state
    that replica holds and whose update it computes. Each unit (the parameters reduced together,
    as (name, shape)) is cut evenly, as Megatron's distributed optimizer cuts each bucket's flat
    buffer: laid end to end, a row goes to the replica whose 1/`replicas` of the unit's elements
    holds its middle element. So every replica holds its even share of each unit to within a
    row at each cut."""
    pieces: dict[str, tuple[tuple[int, int, int], ...]] = {}
    for unit in units:
        total = sum(math.prod(shape) for _, shape in unit)
        base = 0
        for name, shape in unit:
            rows = shape[0] if shape else 1
            size = math.prod(shape[1:]) if shape else 1  # a row's elements
            if not size or not rows or not total:
                pieces[name] = ((0, 0, rows),)
                continue
            # row i goes to replica k where k * total <= (base + i * size + size / 2) * replicas
            # < (k + 1) * total: replica k's first row is the smallest i meeting the left side
            starts = [min(rows, max(0, -((replicas * (2 * base + size) - 2 * k * total) // (2 * replicas * size))))
                      for k in range(replicas)] + [rows]
            pieces[name] = tuple((k, starts[k], starts[k + 1]) for k in range(replicas) if starts[k] < starts[k + 1])
            base += rows * size
    return pieces


def merge_state_dicts(shards: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Union of per-rank shards: one entry per original name (tied copies are equal)."""
    shards = list(shards)
    model: dict[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    pieces: dict[str, dict[int, Mapping[str, Any]]] = {}  # a sharded optimizer's rows, by first row
    groups: list[dict[str, Any]] = []
    has_optimizer = False
    for shard in shards:
        for name, value in shard["model"].items():
            model.setdefault(name, value)
        if "optimizer" in shard:
            has_optimizer = True
            for name, value in shard["optimizer"]["state"].items():
                if ROWS_KEY in value:
                    pieces.setdefault(name, {}).setdefault(value[ROWS_KEY][0], value)
                else:
                    optimizer_state.setdefault(name, value)
            for index, group in enumerate(shard["optimizer"]["param_groups"]):
                if index == len(groups):
                    groups.append({**group, "params": []})
                for name in group["params"]:
                    if name not in groups[index]["params"]:
                        groups[index]["params"].append(name)
    for name, parts in pieces.items():
        if name not in optimizer_state:
            optimizer_state[name] = _join_rows(name, [parts[first] for first in sorted(parts)])
    merged: dict[str, Any] = {"model": model}
    if has_optimizer:
        merged["optimizer"] = {"state": optimizer_state, "param_groups": groups}
        classes = [shard["optimizer"]["class"] for shard in shards if "class" in shard.get("optimizer", {})]
        if classes:
            merged["optimizer"]["class"] = classes[0]
    streams = {key: value for shard in shards for key, value in shard.get("random", {}).items()}
    if streams:
        merged["random"] = streams
    extras = [shard["extra"] for shard in shards if "extra" in shard]
    if extras:  # (rank 0's: `save_checkpoint(extra=...)`)
        merged["extra"] = extras[0]
    scalers = [shard["loss_scaler"] for shard in shards if "loss_scaler" in shard]
    if scalers:  # every rank's is the same: they decide each step together
        merged["loss_scaler"] = scalers[0]
    return merged


def _join_rows(name: str, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One parameter's optimizer state from the entries of the replicas stepping its rows (each
    with `ROWS_KEY`, in row order): the per-element tensors joined along dim 0, the rest (the
    step count) the first's."""
    rows = parts[0][ROWS_KEY][2]
    covered = [tuple(part[ROWS_KEY][:2]) for part in parts]
    if covered[0][0] != 0 or covered[-1][1] != rows or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise ExecutionError(f"merge_state_dicts: the optimizer state of {name!r} comes in pieces (shard_optimizer) "
                             f"that cover rows {covered} of its {rows}, not all of them once; merge the shards of "
                             "every replica of the ranks that hold it (gather_state_dict does)")
    joined: dict[str, Any] = {}
    for key, value in parts[0].items():
        if key == ROWS_KEY:
            continue
        values = [part[key] for part in parts]
        per_row = all(isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == end - first
                      for v, (first, end) in zip(values, covered))
        joined[key] = torch.cat(values) if per_row else value
    return joined


def _engine_device(device: torch.device | str | None, first: Tensor | None, rank: int) -> torch.device:
    """The engine's device: the one given; else the stages' own GPU; else, under an NCCL process
    group, this process's current GPU (what `launch` and torchrun set); else the stages' device
    (the CPU for a model on the meta device). NCCL moves GPU tensors only: a CPU engine under it is
    refused here, before its first message would fail inside NCCL."""
    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    if device is not None:
        chosen = torch.device(device)
    elif first is not None and first.device.type == "cuda":
        chosen = first.device
    elif nccl:
        chosen = torch.device("cuda", torch.cuda.current_device())
    else:
        chosen = first.device if first is not None and not first.is_meta else torch.device("cpu")
    if nccl and chosen.type != "cuda":
        raise ExecutionError(f"rank {rank}: Engine(device={str(chosen)!r}) under an NCCL process group, which moves "
                             "GPU tensors only; give device='cuda' (or leave it out), or start the processes with "
                             "launch(..., backend='gloo') to run on CPUs")
    return chosen


def _stage_stream(index: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Stage `index`'s initial random state (CPU; and `device`'s when it is a GPU)."""
    seed = (torch.initial_seed() + 0x9E3779B97F4A7C15 * (index + 1)) % 2**63
    cpu_state = torch.Generator().manual_seed(seed).get_state()
    cuda_state = torch.Generator(device=device).manual_seed(seed).get_state() if device.type == "cuda" else None
    return cpu_state, cuda_state


def load_into_model(model: nn.Module, state: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put a merged state into the plain model (and its optimizer): names are the model's own
    (tied parameters under their first name)."""
    entries = dict(state["model"])
    named = dict(model.named_parameters())
    for name, param in named.items():  # an fp32 weight takes a master copy's fp32 values where saved
        master = saved_master(state, name)
        if master is not None and param.dtype == master.dtype:
            entries[name] = master
    tensors = [*((name, param, True) for name, param in named.items()),
               *((name, buffer, False) for name, buffer in model.named_buffers())]
    load_named(tensors, entries, 0, "state")
    if optimizer is not None and "optimizer" in state:
        load_optimizer_state(optimizer, named, state["optimizer"], "load_into_model")


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save to a temporary file in the same directory, fsync, then os.replace: a crash
    mid-save leaves the previous file intact."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
