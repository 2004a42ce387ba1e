"""Graph-based pipeline simulator: a PipelinePlan + CostTable + ClusterSpec -> SimResult.

The contract every search component shares (DESIGN.md, "The simulator"). Nodes are ops and
transfers. F(s,m) waits for F(s-1,m)'s output to arrive; B(s,m) waits for F(s,m) and for the
gradient of B(s+1,m) (the last stage's B only for its F); W(s,m) for B(s,m). A device runs its ops
in plan order, each as soon as the previous one ended and its inputs arrived. A transfer between
devices takes latency + bytes / bandwidth, a directed link (device pair) carries one transfer at a
time in the order the sender produced them, and transfers overlap compute unless
`blocking_sends=True` (then the sender waits for its send). Hand-offs on one device are free.

Every compute op also pays the cluster's `op_overhead_ms` (host-side runtime cost per op), plus
`message_overhead_ms` for each message it receives from or sends to another device (the host
time of posting it; the transfer itself overlaps compute), plus bytes / `message_copy_bandwidth`
per such message where the hosts copy messages themselves (gloo between CPU processes: the
sender's thread writes the bytes at the op's end while they move, the receiver's I/O thread reads
them, both taking CPU from compute).
The iteration then ends `step_overhead_ms` later: the host time of a step outside its ops (the
engine's setup, its loop between ops, the barrier that ends the step), measured on CPU processes.

Tied parameters (`CostTable.tied`) whose layers sit on two or more devices: their gradient is
summed by an all-reduce among those devices that starts once each has run its last B/W (where
the runtime issues `reduce_tied`) and ends the iteration if it is the last thing running; a ring
all-reduce of k devices takes 2(k-1) x (latency + bytes / k / bandwidth) over the slowest link
among them, plus one message's host overhead. A device takes part in its tied all-reduces one after
another, in table order. On one device a tied parameter is held (and counted in memory) once.

Data parallelism (`cluster.data_parallel` = D > 1, a `ClusterSpec.replica`): every device sums
its gradients with its D - 1 copies (`cluster.all_reduce_ms`) bucket by bucket, as the runtime
issues them beside the backward: a stage's parameters once its last B/W on the device has run,
the parameters tied across devices after their tied all-reduce; one all-reduce at a time per
device. With the optimizer's state sharded over the copies (`MemoryModel.shards` > 1) each
bucket is summed onto its owners only (`cluster.reduce_scatter_ms`, half the all-reduce) and each
device then sends its copies their updated shares (`cluster.all_gather_ms` of its parameters).
The iteration ends when the last has (`Reduction`s named "data-parallel ..."). Where that
broadcast overlaps the next step (`MemoryModel.overlap_param_gather`) it is priced at the step's
start instead, one stage at a time in the order of the device's first forwards, and each stage's
forwards wait for its own ("data-parallel parameter gather stage s"): the steady state, where one
step's broadcast runs beside the next one's first forwards.

The optimizer step is priced only where the memory model says what it moves
(`MemoryModel.step_bytes_per_param_byte` > 0): each device's step then starts after its last
gradient reduction (tied or data-parallel) and takes its weights' bytes x that / the cluster's
`memory_bandwidth` (a `Reduction` named "optimizer step"), before a sharded state's broadcast.

Memory per device: parameter, gradient and optimizer-state bytes of its stages (a multiple of
`param_bytes`, default mixed-precision Adam) plus live activations: a stage's activation bytes are
allocated when its F starts; a full backward frees them at its end; a split backward (B then W)
leaves at B's end only what its W reads, its layers' `weight_stash_bytes` (the linear layers'
inputs and output gradients; where a table does not say, `weight_memory_fraction` of their
activation bytes), and W frees that at its end. An F's outputs (`output_bytes` of its last layer,
and skip tensors) are held at its end until they are sent, as the runtime frees them once sent:
a peak at F's end counts them; where the next stage runs on the same device they are held until
its F, whose input they become. A stage that recomputes
its activations (`Stage.recompute`) holds only its inputs from F to B (what the runtime keeps);
its B allocates the rest again at its start and takes one more forward's time.
A stage that recomputes selectively (`Stage.selective`) holds its layers' `selective_activation_bytes`
and its inputs from F to B, and its B takes their `selective_recompute_ms` more.

Cost: O(ops + transfers), a single pass with a worklist; about 3,000 ops in a few milliseconds.
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from octopipe.cluster import ClusterSpec
from octopipe.errors import ArgumentError, PlanError
from octopipe.ir.costs import CostTable, is_finite_number
from octopipe.ir.plan import Op, OpKind, PipelinePlan, render_grid

MIXED_ADAM_BYTES = (4.0, 12.0)
"""mixed-adam's bytes per weight: (the bf16 weight and gradient, the fp32 master copy and moments)."""

MIXED_ADAM_STEP_BYTES = 28.0
"""What mixed-adam's step reads and writes per weight: the bf16 gradient, the fp32 master copy
and moments read (2 + 12), the master copy and moments written back and the bf16 weight cast
from it (12 + 2)."""

MIXED_PRECISION_ADAM_STATE = sum(MIXED_ADAM_BYTES) / 2
"""Bytes of weights + gradients + optimizer state per byte of bf16 weights: 2 (weight) + 2 (grad)
+ 4 (fp32 master) + 4 + 4 (Adam moments) = 16 bytes per parameter = 8x its 2 bf16 bytes."""

ZERO_BUBBLE_WEIGHT_MEMORY = 32 / 34
"""Share of a layer's activation memory still held between B and W: W needs the linear layers'
inputs and output gradients, 32bsh of a transformer layer's 34bsh (Qi et al., Zero Bubble PP)."""

_KINDS = (OpKind.F, OpKind.B, OpKind.W)
_KIND_INDEX = {OpKind.F: 0, OpKind.B: 1, OpKind.W: 2}


OPTIMIZER_STATE: dict[str, int | None] = {"mixed-adam": None, "adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""The optimizers `MemoryModel.for_optimizer` knows, each with the buffers it keeps per weight in
the weights' dtype (beside the weight and its gradient): adamw and adam two moments,
sgd-momentum one, sgd none (`octopipe train`'s two are sgd and adamw). mixed-adam (None):
Megatron's mixed precision, bf16 weights and gradients with an fp32 master copy and two fp32
moments, 16 bytes per weight whatever the table counts."""

@dataclass(frozen=True, slots=True)
class MemoryModel:
    """What a device holds besides activations, and how long W keeps them."""

    state_bytes_per_param_byte: float = MIXED_PRECISION_ADAM_STATE
    """Weights + gradients + optimizer state, per byte of weights as the cost table counts them
    (`LayerCost.param_bytes`)."""
    weight_memory_fraction: float = ZERO_BUBBLE_WEIGHT_MEMORY
    """Share of a stage's activation bytes its B leaves for its W."""
    shards: int = 1
    """The data-parallel replicas the optimizer's state and step are split over (ZeRO-1;
    `for_optimizer`'s `shards`). With replicas (a `ClusterSpec.replica`), the simulator prices
    what OctoPipe's runtime then does: the gradients summed onto their share's owner (a
    reduce-scatter's bytes, half an all-reduce's) and after the step each replica's updated
    share sent to the other copies (an all-gather's bytes, "data-parallel shard broadcast")."""
    step_bytes_per_param_byte: float = 0.0
    """What the optimizer's step reads and writes on a device per byte of its weights as the
    cost table counts them (0, the default: the step is not priced). With it, the simulator adds
    each device's step ("optimizer step") after its last gradient reduction (and before a sharded
    state's broadcast), streamed at `ClusterSpec.memory_bandwidth`: an elementwise update is
    bound by memory traffic. `for_optimizer(..., price_step=True)` sets it (a sharded step moves
    1/shards of it)."""
    overlap_param_gather: bool = False
    """With `shards` > 1: the shares' broadcast after the step is left running and each stage's
    parameters are waited for only before its first forward of the next step (Megatron's
    `--overlap-param-gather`; `compile(..., overlap_param_gather=True)`). The simulator then
    prices the broadcast at the start of the step, stage by stage in the order of their first
    forwards on the device, each stage's forwards starting after its own ("data-parallel
    parameter gather stage s"), instead of at the end."""
    grad_bytes_per_param_byte: float = 1.0
    """The bytes of gradient the tied and data-parallel reductions sum per byte of weights as the
    cost table counts them: 1, gradients in the weights' dtype; 2 for fp32 gradients of bf16
    weights (`compile(..., master_weights=True, fp32_grads=True)`, Megatron's
    `--accumulate-allreduce-grads-in-fp32`; `for_optimizer(..., fp32_grads=True)`). The sharded
    state's broadcast sends weights: it is priced at their bytes whatever this is."""

    @classmethod
    def for_optimizer(cls, name: str, shards: int = 1, *, param_bytes_per_weight: float = 2.0,
                      weight_bytes: float | None = None, price_step: bool = False,
                      overlap_param_gather: bool = False, master_weights: bool = False,
                      fp32_grads: bool = False) -> MemoryModel:
        """The memory of a job stepping optimizer `name` (an OPTIMIZER_STATE key).
        `param_bytes_per_weight`: what the cost table's `param_bytes` count per weight (2, bf16,
        in the published profiles and analytic costs; the element size in a table profiled on the
        model itself). `weight_bytes`: the bytes per weight the job holds its weights in (default:
        the table's; 4 for fp32 weights; mixed-adam's are bf16). `shards`: the optimizer's own
        state split over that many data-parallel replicas (ZeRO-1, Megatron's distributed
        optimizer; OctoPipe's runtime does it with `compile(shard_optimizer=True)`). Mixed-adam
        on a bf16 table is the default model (8 bytes per byte of weights); adamw there 4, sgd 2.
        `price_step`: also price the step's memory traffic (`step_bytes_per_param_byte`): a
        weight, its gradient and k moments read and the weight and moments written, (3 + 2k) x
        the weight's bytes (28 per weight for fp32 Adam; mixed-adam 28, `MIXED_ADAM_STEP_BYTES`),
        over `shards` where each replica steps its share. `overlap_param_gather`: the shares'
        broadcast overlaps the next step's forwards (`MemoryModel.overlap_param_gather`; needs
        `shards` > 1). `master_weights`: the optimizer steps an fp32 copy of each (bf16) weight
        (`Engine(master_weights=True)`): its own state is then that copy and its moments in fp32,
        4 + 4k bytes a weight, and its step reads the gradient, copy and moments and writes the
        copy, moments and weight ((2 x the weight's bytes) + 8 + 8k); mixed-adam is this already.
        `fp32_grads` (with `master_weights`, or mixed-adam): the gradients are fp32 (`Engine(...,
        fp32_grads=True)`): 4 bytes a weight held and read by the step instead of the weight's,
        and the reductions sum 4 bytes a weight (`grad_bytes_per_param_byte`); mixed-adam comes
        to 18 bytes a weight (Megatron's figure for bf16 weights with fp32 gradients) and 30 of
        step traffic."""
        for what, flag in (("price_step", price_step), ("overlap_param_gather", overlap_param_gather),
                           ("master_weights", master_weights), ("fp32_grads", fp32_grads)):
            if not isinstance(flag, bool):
                raise ArgumentError(f"MemoryModel.for_optimizer: {what} must be True or False, got {flag!r:.40}")
        if name not in OPTIMIZER_STATE:
            raise ArgumentError(f"MemoryModel.for_optimizer: unknown optimizer {name!r:.40}; use one of "
                                f"{', '.join(OPTIMIZER_STATE)} (or MemoryModel(state_bytes_per_param_byte=...) for "
                                "another)")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ArgumentError(f"MemoryModel.for_optimizer: shards must be a positive integer (data-parallel "
                                f"replicas the optimizer state is split over), got {shards!r:.40}")
        for what, value in (("param_bytes_per_weight", param_bytes_per_weight), ("weight_bytes", weight_bytes)):
            if value is not None and not (is_finite_number(value) and value > 0):  # type: ignore[operator]
                raise ArgumentError(f"MemoryModel.for_optimizer: {what} must be a positive number of bytes, got "
                                    f"{value!r:.40}")
        moments = OPTIMIZER_STATE[name]
        if fp32_grads and moments is not None and not master_weights:
            raise ArgumentError(f"MemoryModel.for_optimizer: fp32_grads are the gradients of bf16 weights with fp32 "
                                f"master copies, but {name!r} is given without master_weights; pass "
                                "master_weights=True too (or mixed-adam, which has the copies)")
        size = param_bytes_per_weight if weight_bytes is None else weight_bytes
        if moments is None:  # mixed-adam: Adam over fp32 copies of bf16 weights, whatever the table counts
            moments, size, master_weights = 2, 2.0, True  # (MIXED_ADAM_BYTES, MIXED_ADAM_STEP_BYTES)
        grad = 4.0 if fp32_grads else size  # a weight's gradient bytes
        if master_weights:
            held, own = size + grad, 4.0 * (1 + moments)
            traffic = size + grad + 8.0 * (1 + moments)
        else:
            held, own = 2 * size, moments * size
            traffic = (3 + 2 * moments) * size
        step = traffic / shards / param_bytes_per_weight if price_step else 0.0
        model = cls(state_bytes_per_param_byte=(held + own / shards) / param_bytes_per_weight, shards=shards,
                    step_bytes_per_param_byte=step, overlap_param_gather=overlap_param_gather,
                    grad_bytes_per_param_byte=4.0 / param_bytes_per_weight if fp32_grads else 1.0)
        model.check("MemoryModel.for_optimizer")
        return model

    def check(self, where: str) -> None:
        """Raise ArgumentError unless both fields are sensible numbers."""
        state, share = self.state_bytes_per_param_byte, self.weight_memory_fraction
        if not (is_finite_number(state) and state >= 0):
            raise ArgumentError(f"{where}: state_bytes_per_param_byte must be a non-negative number of bytes per "
                                f"byte of weights (8 for mixed-precision Adam), got {state!r:.40}")
        if not (is_finite_number(share) and 0.0 <= share <= 1.0):
            raise ArgumentError(f"{where}: weight_memory_fraction must be a share in [0, 1], got {share!r:.40}")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ArgumentError(f"{where}: shards must be a positive integer (data-parallel replicas the optimizer "
                                f"state is split over), got {self.shards!r:.40}")
        step = self.step_bytes_per_param_byte
        if not (is_finite_number(step) and step >= 0):
            raise ArgumentError(f"{where}: step_bytes_per_param_byte must be a non-negative number of bytes per "
                                f"byte of weights (0: the optimizer step is not priced), got {step!r:.40}")
        grad = self.grad_bytes_per_param_byte
        if not (is_finite_number(grad) and grad > 0):
            raise ArgumentError(f"{where}: grad_bytes_per_param_byte must be a positive number of gradient bytes per "
                                f"byte of weights (1: gradients in the weights' dtype), got {grad!r:.40}")
        if not isinstance(self.overlap_param_gather, bool):
            raise ArgumentError(f"{where}: overlap_param_gather must be True or False, got "
                                f"{self.overlap_param_gather!r:.40}")
        if self.overlap_param_gather and self.shards == 1:
            raise ArgumentError(f"{where}: overlap_param_gather overlaps the broadcast of a sharded optimizer's "
                                "updated shares, but shards is 1 (nothing is broadcast); shard the state over the "
                                "replicas (shards = D, compile(shard_optimizer=True), plan --shard-optimizer) or "
                                "leave overlap_param_gather off")

    def to_dict(self) -> dict[str, float]:
        data = {"state_bytes_per_param_byte": self.state_bytes_per_param_byte,
                "weight_memory_fraction": self.weight_memory_fraction}
        if self.shards != 1:
            data["shards"] = self.shards
        if self.step_bytes_per_param_byte:
            data["step_bytes_per_param_byte"] = self.step_bytes_per_param_byte
        if self.overlap_param_gather:
            data["overlap_param_gather"] = True
        if self.grad_bytes_per_param_byte != 1.0:
            data["grad_bytes_per_param_byte"] = self.grad_bytes_per_param_byte
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> MemoryModel:
        if not isinstance(data, dict) or set(data) - {"state_bytes_per_param_byte", "weight_memory_fraction",
                                                      "shards", "step_bytes_per_param_byte",
                                                      "overlap_param_gather", "grad_bytes_per_param_byte"}:
            raise ArgumentError(f"{where}: a memory model is an object with state_bytes_per_param_byte, "
                                f"weight_memory_fraction and optionally shards, step_bytes_per_param_byte, "
                                f"overlap_param_gather and grad_bytes_per_param_byte, got {data!r:.120}")
        model = cls(**data)
        model.check(where)
        return model


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage sums of a cost table for one plan's partition (ms and bytes per microbatch)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_full: tuple[float, ...]
    weight: tuple[float, ...]
    activation: tuple[float, ...]
    """Bytes a stage's F keeps for its B: its layers' activations, and what it received that its
    first layer does not save (`LayerCost.unsaved_input_bytes`: the runtime holds it anyway)."""
    output: tuple[float, ...]
    """Bytes each stage sends to the next (its last layer's output, less the skip tensors the next
    stage does not read, plus those of its other layers it does); the gradient going back is as big."""
    params: tuple[float, ...]
    skips: tuple[tuple[int, int, float], ...] = ()
    """(producer stage, consumer stage, bytes): skip tensors sent past the next stage, one message
    per stage pair and microbatch (and their gradients back)."""
    held: tuple[float, ...] = ()
    """Bytes a stage holds per microbatch from its F to its B: its activations, or, where it
    recomputes them, its inputs (then its B allocates the rest again, and takes one more F)."""
    stash_known: tuple[float, ...] = ()
    """Bytes a stage's split B leaves for its W, summed over its layers whose table says
    (`LayerCost.weight_stash_bytes`)."""
    stash_unknown: tuple[float, ...] = ()
    """The activation bytes of its layers whose table does not: `weight_stash` takes the memory
    model's share of them."""

    def weight_stash(self, fraction: float) -> tuple[float, ...]:
        """Bytes each stage's split B leaves for its W (held until W ends): what its layers' table
        says, and `fraction` (`MemoryModel.weight_memory_fraction`) of the activation bytes of the
        layers it does not say it for."""
        return tuple(known + fraction * unknown for known, unknown in zip(self.stash_known, self.stash_unknown))

    @classmethod
    def of(cls, boundaries: tuple[int, ...], costs: CostTable, recompute: Sequence[bool] = (),
           selective: Sequence[bool] = ()) -> StageCosts:
        """`recompute[s]`: stage s recomputes its activations; `selective[s]`: it recomputes its
        cheap ops' outputs (empty: none does)."""
        pairs = list(zip(boundaries[:-1], boundaries[1:]))
        output = costs.output
        chain = [float(output[b - 1]) for _, b in pairs]
        links: dict[tuple[int, int], float] = {}
        if costs.skips:
            stage_of = [s for s, (a, b) in enumerate(pairs) for _ in range(a, b)]
            for skip in costs.skips:
                source = stage_of[skip.producer]
                readers = sorted({stage_of[c] for c in skip.consumers} - {source})
                last = skip.producer == boundaries[source + 1] - 1
                if last and source + 1 < len(pairs) and source + 1 not in readers:
                    chain[source] -= skip.bytes  # counted in the layer's output, not read next door
                for reader in readers:
                    if reader == source + 1:
                        if not last:
                            chain[source] += skip.bytes
                    else:
                        links[(source, reader)] = links.get((source, reader), 0.0) + skip.bytes
        forward = [costs.range_sum("forward", a, b) for a, b in pairs]
        backward_input = [costs.range_sum("backward_input", a, b) for a, b in pairs]
        backward_full = [costs.range_sum("backward_full", a, b) for a, b in pairs]
        # a stage's activations: its layers', and what it received that its first layer saves none
        # of (the runtime keeps a stage's inputs from its F to its B): a loss layer's logits
        unsaved = costs.unsaved_input
        activation = [costs.range_sum("activation", a, b) + (unsaved[a] if s else 0.0) for s, (a, b) in enumerate(pairs)]
        output = [max(0.0, value) for value in chain]
        held = list(activation)

        def boundary(stage: int) -> float:
            """What the stage received: kept from F to B whatever it recomputes (what it sends is
            held only until sent, as for every stage)."""
            return (output[stage - 1] if stage else 0.0) + sum(x for (_, c), x in links.items() if c == stage)

        for stage, again in enumerate(recompute):
            if again:  # B runs F again; until then the stage keeps what it received
                backward_input[stage] += forward[stage]
                backward_full[stage] += forward[stage]
                held[stage] = min(boundary(stage), activation[stage])
                forward[stage] = costs.range_sum("forward_no_grad", *pairs[stage])  # F itself keeps no graph
        for stage, cheap in enumerate(selective):
            if cheap:  # F keeps the heavy ops' outputs (and its inputs); B recomputes the rest first
                a, b = pairs[stage]
                extra = costs.range_sum("selective_recompute", a, b)
                backward_input[stage] += extra
                backward_full[stage] += extra
                held[stage] = costs.range_sum("selective_activation", a, b) + boundary(stage)
        return cls(
            forward=tuple(forward), backward_input=tuple(backward_input), backward_full=tuple(backward_full),
            weight=tuple(costs.range_sum("weight", a, b) for a, b in pairs),
            activation=tuple(activation), output=tuple(output),
            params=tuple(costs.range_sum("params", a, b) for a, b in pairs),
            skips=tuple((a, c, size) for (a, c), size in sorted(links.items())),
            held=tuple(held),
            stash_known=tuple(costs.range_sum("weight_stash", a, b) for a, b in pairs),
            stash_unknown=tuple(costs.range_sum("weight_stash_unknown", a, b) for a, b in pairs),
        )


def sent_outputs(sc: StageCosts, placement: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
    """Per stage, the bytes its F leaves for later stages (its outputs and skip tensors), held
    from F's end until sent; the bytes its F takes over as its input from the previous stage
    on the same device (held since that stage's F; 0 where the previous stage is elsewhere); and
    the bytes it leaves the next stage on the same device, held until that stage's F (0 where
    the next stage is elsewhere)."""
    num_stages = len(sc.forward)
    sent = [sc.output[s] if s + 1 < num_stages else 0.0 for s in range(num_stages)]
    for source, _, size in sc.skips:
        sent[source] += size
    taken = [sc.output[s - 1] if s > 0 and placement[s] == placement[s - 1] else 0.0 for s in range(num_stages)]
    left = [*taken[1:], 0.0]
    return sent, taken, left


def stage_costs(plan: PipelinePlan, costs: CostTable) -> StageCosts:
    if plan.num_layers != len(costs):
        raise PlanError(
            f"plan covers {plan.num_layers} layers but the cost table {costs.model!r} has {len(costs)}; "
            "plan and costs must describe the same model"
        )
    costs = costs.for_microbatches(plan.num_microbatches)  # accumulation as this plan's step has it (cached)
    key = ("stage_costs", id(costs))
    cached = plan._cache.get(key)
    if cached is None or cached[0] is not costs:
        if any(plan.selective) and not costs.has_selective_info:
            raise PlanError(f"stages {[s.index for s in plan.stages if s.selective]} recompute selectively, but the cost "
                            f"table {costs.model!r} does not say what that holds and costs (no layer has "
                            "selective_activation_bytes); use analytic costs of the model, or a plan without it")
        for stage in plan.stages:
            unknown = costs.selective_unknown(stage.layer_start, stage.layer_end) if stage.selective else None
            if unknown is not None:
                raise PlanError(f"stage {stage.index} recomputes selectively, but the cost table {costs.model!r} does "
                                f"not say what that holds and costs for its layer {unknown} "
                                f"({costs.layers[unknown].name!r}: no selective_activation_bytes; the analysis leaves it "
                                "out where selective recomputation cannot run a layer); recompute that stage fully "
                                "or not at all")
        cached = plan._cache[key] = (costs, StageCosts.of(plan.boundaries, costs, plan.recompute, plan.selective))
    return cached[1]


@dataclass(frozen=True)
class Transfer:
    kind: str  # "act" or "grad"
    src: int
    dst: int
    start_ms: float
    end_ms: float
    op: Op  # the producing op


@dataclass(frozen=True)
class Reduction:
    """The all-reduce of a tied parameter's gradient among the devices holding its layers, or
    (named "data-parallel") of one device's gradients over its data-parallel copies, or (named
    "optimizer step") a device's priced optimizer step."""

    name: str
    devices: tuple[int, ...]
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class SimResult:
    plan: PipelinePlan
    cluster: ClusterSpec
    iteration_ms: float
    transfers: tuple[Transfer, ...]
    static_memory_bytes: tuple[float, ...]
    peak_activation_bytes: tuple[float, ...]
    reductions: tuple[Reduction, ...]
    """Tied-parameter all-reduces, in the order they run (empty when no tied parameter spans
    devices), then with data parallelism each device's all-reduce over its copies."""
    _starts: list[float] = field(repr=False)
    _ends: list[float] = field(repr=False)
    _pred: list[int] = field(repr=False)
    """Per op key (kind * S * M + stage * M + microbatch): start, end, the key of the op that
    released it (its device predecessor or the dependency it waited for), -1 for none."""
    memory: MemoryModel = MemoryModel()
    """The memory model `static_memory_bytes` and the activations were counted with."""

    def _key(self, op: Op) -> int:
        return _slot(self.plan, op)

    def _op(self, key: int) -> Op:
        per_kind = self.plan.num_stages * self.plan.num_microbatches
        kind_index, rest = divmod(key, per_kind)
        stage, micro = divmod(rest, self.plan.num_microbatches)
        return Op(stage, _KINDS[kind_index], micro)

    @cached_property
    def op_start(self) -> dict[Op, float]:
        return {op: self._starts[self._key(op)] for ops in self.plan.device_ops for op in ops}

    @cached_property
    def op_end(self) -> dict[Op, float]:
        return {op: self._ends[self._key(op)] for ops in self.plan.device_ops for op in ops}

    # -- time ---------------------------------------------------------------------------------
    @cached_property
    def device_busy_ms(self) -> tuple[float, ...]:
        """Per device, the ms its ops run, and its optimizer step where that is priced."""
        ends, starts, plan = self._ends, self._starts, self.plan
        keys = [[_slot(plan, op) for op in ops] for ops in plan.device_ops]
        return tuple(sum(ends[key] - starts[key] for key in device_keys) + step
                     for device_keys, step in zip(keys, self.optimizer_step_ms))

    @cached_property
    def optimizer_step_ms(self) -> tuple[float, ...]:
        """Per device, its optimizer step's ms where the memory model prices it, else 0."""
        steps = [0.0] * self.plan.num_devices
        for reduction in self.reductions:
            if reduction.name == OPTIMIZER_STEP:
                steps[reduction.devices[0]] += reduction.end_ms - reduction.start_ms
        return tuple(steps)

    @cached_property
    def device_idle_ms(self) -> tuple[float, ...]:
        return tuple(self.iteration_ms - busy for busy in self.device_busy_ms)

    @cached_property
    def bubbles(self) -> tuple[tuple[float, float, float], ...]:
        """Per device (warm-up, cool-down, residual) idle ms. A gap that ends before the device's
        first backward is warm-up (the pipeline filling), one that starts after its last forward is
        cool-down (draining, up to the iteration's end, less a priced optimizer step there); the
        other gaps are residual bubbles."""
        result = []
        for ops, step in zip(self.plan.device_ops, self.optimizer_step_ms):
            if not ops:
                result.append((self.iteration_ms, 0.0, 0.0))
                continue
            first_backward = min((self.op_start[op] for op in ops if op.kind is not OpKind.F), default=self.iteration_ms)
            last_forward = max((self.op_end[op] for op in ops if op.kind is OpKind.F), default=0.0)
            warmup = cooldown = residual = 0.0
            previous_end = 0.0
            for op in (*ops, None):
                begin = self.iteration_ms if op is None else self.op_start[op]
                gap = begin - previous_end
                if gap > 1e-12:
                    if begin <= first_backward:
                        warmup += gap
                    elif previous_end >= last_forward:
                        cooldown += gap
                    else:
                        residual += gap
                if op is not None:
                    previous_end = self.op_end[op]
            result.append((warmup, max(0.0, cooldown - step), residual))
        return tuple(result)

    @property
    def bubble_ratio(self) -> float:
        total = self.iteration_ms * self.plan.num_devices
        return sum(self.device_idle_ms) / total if total > 0 else 0.0

    def bubble_split(self) -> tuple[float, float, float]:
        """Total (warm-up, cool-down, residual) idle ms over all devices."""
        return tuple(sum(b[i] for b in self.bubbles) for i in range(3))  # type: ignore[return-value]

    # -- memory -------------------------------------------------------------------------------
    @property
    def peak_memory_bytes(self) -> tuple[float, ...]:
        return tuple(s + a for s, a in zip(self.static_memory_bytes, self.peak_activation_bytes))

    @property
    def data_parallel_ms(self) -> float:
        """The most time a device spends all-reducing its gradients over its data-parallel copies
        (its buckets together; 0 without copies), and with the optimizer's state sharded sending
        its updated share after (or, overlapped, before its stages' first forwards). Most of the
        all-reduces may overlap the device's backward."""
        per_device: dict[int, float] = {}
        for r in self.reductions:
            if r.name.startswith("data-parallel"):
                per_device[r.devices[0]] = per_device.get(r.devices[0], 0.0) + r.end_ms - r.start_ms
        return max(per_device.values(), default=0.0)

    # -- critical path ------------------------------------------------------------------------
    @cached_property
    def critical_path(self) -> tuple[Op, ...]:
        """Ops on the longest dependency chain that ends the iteration, first to last."""
        if not self.op_end:
            return ()
        last = max(self.op_end, key=lambda o: (self.op_end[o], -self.op_start[o]))
        key = self._key(last)
        path = []
        while key >= 0:
            path.append(self._op(key))
            key = self._pred[key]
        return tuple(reversed(path))

    # -- output -------------------------------------------------------------------------------
    def chrome_trace(self) -> dict[str, Any]:
        """Chrome / Perfetto trace: one process per device, compute and link threads."""
        events: list[dict[str, Any]] = []
        for device in range(self.plan.num_devices):
            events.append({"ph": "M", "name": "process_name", "pid": device, "args": {"name": f"device {device}"}})
            events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": 0, "args": {"name": "compute"}})
            events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": 1, "args": {"name": "send"}})
        for device, ops in enumerate(self.plan.device_ops):
            for op in ops:
                events.append({
                    "ph": "X", "pid": device, "tid": 0, "name": str(op), "cat": op.kind.value,
                    "ts": self.op_start[op] * 1e3, "dur": (self.op_end[op] - self.op_start[op]) * 1e3,
                    "args": {"stage": op.stage, "microbatch": op.microbatch},
                })
        for transfer in self.transfers:
            events.append({
                "ph": "X", "pid": transfer.src, "tid": 1, "name": f"{transfer.kind} {transfer.op}->{transfer.dst}",
                "cat": "comm", "ts": transfer.start_ms * 1e3, "dur": (transfer.end_ms - transfer.start_ms) * 1e3,
            })
        for reduction in self.reductions:
            step = reduction.name == OPTIMIZER_STEP
            for device in reduction.devices:
                events.append({
                    "ph": "X", "pid": device, "tid": 0 if step else 1,
                    "name": OPTIMIZER_STEP if step else f"all-reduce {reduction.name} {list(reduction.devices)}",
                    "cat": "compute" if step else "comm", "ts": reduction.start_ms * 1e3, "dur": (reduction.end_ms - reduction.start_ms) * 1e3,
                })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def __str__(self) -> str:
        lines = [
            f"iteration {self.iteration_ms:.3f} ms, bubble ratio {self.bubble_ratio:.1%}, "
            f"{self.plan.num_stages} stages on {self.plan.num_devices} devices, {self.plan.num_microbatches} microbatches",
            f"{'device':>6} {'busy ms':>10} {'warm-up':>9} {'cool-down':>9} {'residual':>9} {'peak GiB':>9}",
        ]
        for device in range(self.plan.num_devices):
            warmup, cooldown, residual = self.bubbles[device]
            lines.append(
                f"{device:>6} {self.device_busy_ms[device]:>10.3f} {warmup:>9.3f} {cooldown:>9.3f} {residual:>9.3f} "
                f"{self.peak_memory_bytes[device] / 2**30:>9.3f}"
            )
        for reduction in self.reductions:
            if reduction.name == OPTIMIZER_STEP:
                lines.append(f"optimizer step: device {reduction.devices[0]} {reduction.start_ms:.3f}-"
                             f"{reduction.end_ms:.3f} ms (its state's traffic at the memory bandwidth)")
            elif reduction.name.startswith(PARAM_GATHER):
                stage = reduction.name.rsplit(" ", 1)[1]
                lines.append(f"data-parallel: device {reduction.devices[0]}'s copies send each other stage {stage}'s "
                             f"updated shares before its first forward (overlapped with the step) "
                             f"{reduction.start_ms:.3f}-{reduction.end_ms:.3f} ms")
            elif reduction.name == SHARD_BROADCAST:
                lines.append(f"data-parallel: device {reduction.devices[0]}'s copies send each other their updated "
                             f"shares (the optimizer state is sharded over the {self.cluster.data_parallel} copies) "
                             f"{reduction.start_ms:.3f}-{reduction.end_ms:.3f} ms")
            elif reduction.name.startswith("data-parallel"):
                what = reduction.name.removeprefix("data-parallel ")
                how = "reduce-scattered" if self.memory.shards > 1 else "all-reduced"
                lines.append(f"data-parallel: device {reduction.devices[0]}'s gradients ({what}) {how} over its "
                             f"{self.cluster.data_parallel} copies {reduction.start_ms:.3f}-{reduction.end_ms:.3f} ms")
            else:
                lines.append(f"tied {reduction.name}: all-reduce on devices {list(reduction.devices)} "
                             f"{reduction.start_ms:.3f}-{reduction.end_ms:.3f} ms")
        return "\n".join(lines)


def message_host_ms(sc: StageCosts, stage_device: Sequence[int], cluster: ClusterSpec
                    ) -> tuple[list[float] | None, tuple[list[float], list[float]] | None]:
    """Host time each stage's F and B spend on their cross-device messages (`posting`, per stage;
    None when messages cost the host nothing, as on the GPU presets), and of that the time spent
    copying the op's own sends (`sending`: F's, B's per stage; None where hosts do not copy).
    An F or B posts one message per neighbouring stage on another device (F: receive from the
    previous, send to the next; B: the reverse) and one per skip tensor it sends or reads across
    devices; each costs `message_overhead_ms` and, where hosts copy (gloo on CPU), bytes /
    `message_copy_bandwidth`. Shared by the simulator and the tuner's list scheduler."""
    if not cluster.hosts_pay_for_messages:
        return None, None
    copy_rate = cluster.message_copy_bandwidth / 1e3  # bytes per ms; 0: no host copy
    num_stages = len(stage_device)
    messages: list[tuple[int, float, bool]] = []  # (stage, bytes, its F sends them)
    for s in range(num_stages - 1):
        if stage_device[s] != stage_device[s + 1]:
            messages += [(s, sc.output[s], True), (s + 1, sc.output[s], False)]
    for source, reader, size in sc.skips:
        if stage_device[source] != stage_device[reader]:
            messages += [(source, size, True), (reader, size, False)]
    posting = [0.0] * num_stages
    sending = ([0.0] * num_stages, [0.0] * num_stages) if copy_rate else None
    for s, size, forward_sends in messages:
        posting[s] += cluster.message_overhead_ms
        if sending is not None:
            posting[s] += size / copy_rate
            sending[not forward_sends][s] += size / copy_rate
    return posting, sending


def simulate(
    plan: PipelinePlan,
    costs: CostTable,
    cluster: ClusterSpec | str,
    *,
    blocking_sends: bool = False,
    memory: MemoryModel = MemoryModel(),
    validated: bool = False,
    jitter: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one training iteration of `plan` on `cluster` (a ClusterSpec, a preset name or a
    spec file, as `plan` takes it). Raises PlanError (with the device x step grid)
    for a plan that cannot run: an op on the wrong device, a missing or repeated op, or a
    dependency cycle, or a partition that does not cover `costs`' layers in order.
    `validated`: the caller built or checked the plan itself (the planner's own search, which
    re-simulates its plans in loops), so `PipelinePlan.validate` (about 0.7x a simulation) is
    skipped; the simulation still refuses a plan that cannot run. A table that knows what gradient
    accumulation costs is taken for the plan's microbatch count (`CostTable.for_microbatches`).
    `jitter`: one factor per op on its compute time (indexed kind x stages x microbatches +
    stage x microbatches + microbatch, kinds F, B, W; see `jittered_iterations`), for a run
    whose ops do not all take their mean time."""
    if not validated:
        if not isinstance(plan, PipelinePlan):
            raise ArgumentError(f"simulate: plan must be a PipelinePlan (PipelinePlan.parse(text), "
                                f"octopipe.api.load_saved_plan(path).plan), got {type(plan).__name__}")
        if not isinstance(costs, CostTable):
            raise ArgumentError(f"simulate: costs must be a CostTable (CostTable.load(path)), got {type(costs).__name__}")
        cluster = ClusterSpec.of(cluster, "simulate: cluster")
        plan.validate(num_layers=len(costs))
    if jitter is not None and len(jitter) != _op_slots(plan):
        raise ArgumentError(f"simulate: jitter needs one factor per op slot (3 x {plan.num_stages} stages x "
                            f"{plan.num_microbatches} microbatches = {_op_slots(plan)}), got {len(jitter)}")
    core = _run(plan, costs, cluster, blocking_sends, memory, record=True, jitter=jitter)
    return core  # type: ignore[return-value]


def jittered_iterations(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, ratios: Sequence[float], *,
                        samples: int = 32, seed: int = 0) -> list[float]:
    """Iteration times (ms, sorted) of `samples` simulations of `plan` in which every op's compute
    time is its mean times a factor drawn from `ratios` (measured durations over their op's mean,
    e.g. `RuntimeProfile.spread`): what op-to-op jitter alone does to a schedule. A schedule
    with slack absorbs a late op; one that keeps a device busy every millisecond passes it on to
    the ops that wait for it."""
    if not ratios or samples < 1:
        raise ArgumentError(f"jittered_iterations: need ratios and samples >= 1, got {len(ratios)} ratios, "
                            f"samples={samples!r}")
    draw = random.Random(seed).choices
    return sorted(simulate(plan, costs, cluster, validated=True, jitter=draw(ratios, k=_op_slots(plan))).iteration_ms
                  for _ in range(samples))


def _op_slots(plan: PipelinePlan) -> int:
    """F, B and W of every stage and microbatch: the length of the simulator's per-op arrays."""
    return 3 * plan.num_stages * plan.num_microbatches


def _slot(plan: PipelinePlan, op: Op) -> int:
    """An op's index in the simulator's per-op arrays (kind x stages x microbatches + stage x
    microbatches + microbatch)."""
    return (_KIND_INDEX[op.kind] * plan.num_stages + op.stage) * plan.num_microbatches + op.microbatch


def jitter_of(plan: PipelinePlan, factors: Mapping[Op, float]) -> list[float]:
    """`simulate`'s `jitter` list for `plan` from a factor per op (1 for an op not given)."""
    jitter = [1.0] * _op_slots(plan)
    for op, factor in factors.items():
        jitter[_slot(plan, op)] = factor
    return jitter


def iteration_time(
    plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, *, blocking_sends: bool = False,
    memory: MemoryModel = MemoryModel(),
) -> tuple[float, tuple[float, ...]]:
    """The tuner's fast path: (iteration ms, peak memory bytes per device), nothing recorded."""
    return _run(plan, costs, cluster, blocking_sends, memory, record=False)  # type: ignore[return-value]


class LinkQueues:
    """The links' timing rule, shared by the simulator and the tuner's list scheduler: a message
    queues on its (source, target) link behind the ones sent before it, starts when the op that
    sends it ends (or the link frees), and arrives latency + size / bandwidth after it starts."""

    __slots__ = ("cluster", "latency_ms", "free_at", "bandwidth")

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.latency_ms = cluster.latency_s * 1e3
        self.free_at: dict[tuple[int, int], float] = {}
        self.bandwidth: dict[tuple[int, int], float] = {}
        """Bytes per ms of each link used so far."""

    def send(self, source: int, target: int, size_bytes: float, finish: float) -> tuple[float, float]:
        """(start, arrival) in ms of `size_bytes` sent from `source` to `target` after `finish`."""
        link = (source, target)
        bandwidth = self.bandwidth.get(link)
        if bandwidth is None:
            bandwidth = self.bandwidth[link] = self.cluster.bandwidth(source, target) / 1e3
        start = self.free_at.get(link, 0.0)
        if finish > start:
            start = finish
        arrive = start + self.latency_ms + size_bytes / bandwidth
        self.free_at[link] = arrive
        return start, arrive


def _run(
    plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, blocking_sends: bool, memory: MemoryModel, record: bool,
    jitter: Sequence[float] | None = None,
) -> SimResult | tuple[float, tuple[float, ...]]:
    if plan.num_devices > cluster.num_devices:
        raise PlanError(f"plan uses {plan.num_devices} devices but the cluster has {cluster.num_devices}")
    sc = stage_costs(plan, costs)
    kind_f, kind_b, kind_w = OpKind.F, OpKind.B, OpKind.W  # locals: looked up once per op below
    num_stages, num_micro, num_devices = plan.num_stages, plan.num_microbatches, plan.num_devices
    stage_device = plan.placement
    per_kind = num_stages * num_micro
    is_split = _split_flags(plan, per_kind)
    total = 3 * per_kind
    # done[k]: end time of op k on its device; ready[k]: when op k's output is at its consumer.
    done = [-1.0] * total
    ready = [-1.0] * total
    starts = [0.0] * total if record else None
    pred: list[int] = [-1] * total if record else []
    waiters: dict[int, list[int]] = {}
    links = LinkQueues(cluster)
    transfers: list[Transfer] = []
    device_time = [0.0] * num_devices
    pointer = [0] * num_devices
    last_op = [-1] * num_devices
    activation = [0.0] * num_devices
    peak = [0.0] * num_devices
    forward, backward_input, backward_full, weight = sc.forward, sc.backward_input, sc.backward_full, sc.weight
    act_bytes, out_bytes, held = sc.activation, sc.output, sc.held
    stash = sc.weight_stash(memory.weight_memory_fraction)
    sent, taken, left = sent_outputs(sc, stage_device)
    # per stage, what an F adds (what it holds to B, less the input the previous stage left it on
    # this device), what it sends on (held at its end: a peak there), what stays for the next
    # stage's F on this device; what a B takes back at its start (a recomputing stage) and adds
    # at its end with a split (what W reads, less its activations)
    f_adds = [held[s] - taken[s] for s in range(num_stages)]
    b_regrows = [act_bytes[s] - held[s] for s in range(num_stages)]
    b_split_end = [stash[s] - act_bytes[s] for s in range(num_stages)]
    latency_ms = cluster.latency_s * 1e3
    overhead = cluster.op_overhead_ms
    # skip tensors between stages on different devices: F(c) also waits for each one's message,
    # B(a) for its gradient. Message keys follow the ops': total + (2 link + 0|1) x micro + m.
    # (On one device they add nothing: the chain already orders those ops.)
    skip_in: list[list[tuple[int, int]]] = [[] for _ in range(num_stages)]
    skip_out: list[list[tuple[int, int, float]]] = [[] for _ in range(num_stages)]
    for link, (source, reader, size) in enumerate(sc.skips):
        if stage_device[source] != stage_device[reader]:
            skip_out[source].append((link, reader, size))
            skip_in[reader].append((link, source))
    # host time of each F and B's messages (see message_host_ms); the op's own sends are copied
    # at its end while their bytes move, so they leave `sending[is B][stage]` ms before it ends
    posting, sending = message_host_ms(sc, stage_device, cluster)
    if sc.skips:
        ready.extend([-1.0] * (2 * len(sc.skips) * num_micro))
    device_ops = plan.device_ops
    queue = list(range(num_devices - 1, -1, -1))
    # a sharded state's broadcast overlapped with this step: each stage's forwards wait for its own
    gathers: list[Reduction] = []
    release: list[float] | None = None
    if cluster.data_parallel > 1 and memory.shards > 1 and memory.overlap_param_gather:
        gathers, release = _param_gathers(plan, costs, cluster, sc.params)

    def send(message: int, device: int, target: int, size: float, finish: float, op: Op) -> None:
        """Queue `size` bytes on the link device -> target after `finish`; the message is ready on
        arrival (and wakes the devices waiting for it, except the chain's, which the caller wakes)."""
        send_start, arrive = links.send(device, target, size, finish)
        ready[message] = arrive
        if blocking_sends:
            device_time[device] = arrive
        if record:
            transfers.append(Transfer("act" if op.kind is kind_f else "grad", device, target, send_start, arrive, op))
        if message >= total:
            woken = waiters.pop(message, None)
            if woken:
                queue.extend(woken)

    def fail(device: int, step: int, message: str) -> PlanError:
        return PlanError(f"device {device} step {step}: {message}\n" + render_grid(device_ops, mark=(device, step)))

    while queue:
        device = queue.pop()
        ops = device_ops[device]
        index = pointer[device]
        count = len(ops)
        while index < count:
            op = ops[index]
            stage, micro, kind = op.stage, op.microbatch, op.kind
            if not (0 <= stage < num_stages and 0 <= micro < num_micro):
                raise fail(device, index, f"op {op} is outside stages 0..{num_stages - 1}, microbatches 0..{num_micro - 1}")
            if stage_device[stage] != device:
                raise fail(device, index, f"op {op} belongs to stage {stage}, placed on device {stage_device[stage]}")
            base = stage * num_micro + micro
            if kind is kind_f:
                key = base
                if stage > 0:
                    dep = base - num_micro
                    arrival = ready[dep]
                    if arrival < 0:
                        waiters.setdefault(dep, []).append(device)
                        break
                else:
                    dep, arrival = -1, 0.0
                if release is not None and release[stage] > arrival:
                    dep, arrival = -1, release[stage]
                if skip_in[stage]:
                    missing = -1
                    for link, source in skip_in[stage]:
                        message = total + 2 * link * num_micro + micro
                        if ready[message] < 0:
                            missing = message
                            break
                        if ready[message] > arrival:
                            arrival, dep = ready[message], source * num_micro + micro
                    if missing >= 0:
                        waiters.setdefault(missing, []).append(device)
                        break
                duration = forward[stage]
            elif kind is kind_b:
                key = per_kind + base
                own = done[base]
                if own < 0:
                    raise fail(device, index, f"{op} runs before its forward {stage}F{micro} on this device")
                if stage < num_stages - 1:
                    dep = key + num_micro
                    arrival = ready[dep]
                    if arrival < 0:
                        waiters.setdefault(dep, []).append(device)
                        break
                    if own > arrival:
                        arrival, dep = own, base
                else:
                    dep, arrival = base, own
                if skip_out[stage]:
                    missing = -1
                    for link, reader, _ in skip_out[stage]:
                        message = total + (2 * link + 1) * num_micro + micro
                        if ready[message] < 0:
                            missing = message
                            break
                        if ready[message] > arrival:
                            arrival, dep = ready[message], per_kind + reader * num_micro + micro
                    if missing >= 0:
                        waiters.setdefault(missing, []).append(device)
                        break
                duration = backward_input[stage] if is_split[base] else backward_full[stage]
            else:
                key = 2 * per_kind + base
                dep = per_kind + base
                arrival = done[dep]
                if arrival < 0:
                    raise fail(device, index, f"{op} runs before its B {stage}B{micro} on this device")
                duration = weight[stage]
            if done[key] >= 0:
                raise fail(device, index, f"op {op} appears twice")
            begin = device_time[device]
            if record:
                pred[key] = last_op[device]
                if arrival > begin:
                    begin = arrival
                    pred[key] = dep
                starts[key] = begin  # type: ignore[index]
            elif arrival > begin:
                begin = arrival
            if jitter is not None:
                duration *= jitter[key]
            if posting is not None and kind is not kind_w:
                duration += posting[stage]
            finish = begin + duration + overhead
            done[key] = finish
            device_time[device] = finish
            last_op[device] = key
            # memory: allocate at F start (what the stage holds until B: all its activations, or
            # its inputs where it recomputes the rest at B's start), free at B's end (all, or
            # all but what its W reads) and at W's end
            if kind is kind_f:
                # (the input the previous stage left here is the F's now; its outputs are held at
                # its end until sent, or until the next F here reads them: sent >= 0)
                level = activation[device] + f_adds[stage]
                if level + sent[stage] > peak[device]:
                    peak[device] = level + sent[stage]
                activation[device] = level + left[stage]
            elif kind is kind_b:
                level = activation[device]
                if b_regrows[stage]:
                    level += b_regrows[stage]
                    if level > peak[device]:
                        peak[device] = level
                if is_split[base]:  # its activations go, what W reads stays (it can be more: output gradients)
                    level += b_split_end[stage]
                    if level > peak[device]:
                        peak[device] = level
                else:
                    level -= act_bytes[stage]
                activation[device] = level
            else:
                activation[device] -= stash[stage]
            # output transfer
            if kind is kind_f and stage < num_stages - 1:
                target = stage_device[stage + 1]
                size = out_bytes[stage]
            elif kind is kind_b and stage > 0:
                target = stage_device[stage - 1]
                size = out_bytes[stage - 1]
            else:
                target = -1
            leave = finish if sending is None or kind is kind_w else finish - sending[kind is kind_b][stage]
            if target >= 0:
                if target == device:
                    ready[key] = finish
                else:
                    send(key, device, target, size, leave, op)
                woken = waiters.pop(key, None)
                if woken:
                    queue.extend(woken)
            if kind is kind_f:
                for link, reader, size in skip_out[stage]:
                    send(total + 2 * link * num_micro + micro, device, stage_device[reader], size, leave, op)
            elif kind is kind_b:
                for link, source in skip_in[stage]:
                    send(total + (2 * link + 1) * num_micro + micro, device, stage_device[source], sc.skips[link][2],
                         leave, op)
            index += 1
        pointer[device] = index

    if any(pointer[d] < len(device_ops[d]) for d in range(num_devices)):
        raise _deadlock(plan, pointer)
    if min(done[: 2 * per_kind]) < 0:
        missing = [str(op) for op in _missing_ops(plan, done, per_kind)]
        raise PlanError(
            f"plan is missing {len(missing)} op(s): {' '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}; "
            "every stage and microbatch needs one F and one B\n" + render_grid(device_ops)
        )
    iteration = max(device_time) if device_time else 0.0
    tied = _tied_holders(plan, costs) if costs.tied else []
    static = _static_bytes(sc.params, stage_device, tied, num_devices, memory)
    reductions = []
    reduced_until = [0.0] * num_devices
    if costs.tied:
        for name, size, holders in tied:
            if len(holders) < 2:
                continue
            devices = tuple(sorted(holders))
            start = max(max(_last_gradient_end(device_ops[d], done, per_kind, num_micro), reduced_until[d])
                        for d in devices)
            slowest = min(cluster.bandwidth(a, b) for a in devices for b in devices if a != b) / 1e3
            steps = 2 * (len(devices) - 1)
            moved = size * memory.grad_bytes_per_param_byte
            end = start + steps * (latency_ms + moved / len(devices) / slowest) + cluster.message_overhead_ms
            for d in devices:
                reduced_until[d] = end
            iteration = max(iteration, end)
            reductions.append(Reduction(name, devices, start, end))
    # per device, after its tied reductions: its data-parallel buckets, then (where priced) its
    # optimizer step, then with a sharded state its copies' updated shares to each other
    per_device: list[list[Reduction]] = [[] for _ in range(num_devices)]
    for gather in gathers:
        per_device[gather.devices[0]].append(gather)
        reduced_until[gather.devices[0]] = max(reduced_until[gather.devices[0]], gather.end_ms)
    held: list[float] = []  # the parameter bytes each device's buckets summed
    if cluster.data_parallel > 1:
        buckets, held = _data_parallel_buckets(plan, costs, cluster, sc.params, done, per_kind, reduced_until,
                                               memory.shards > 1, memory.grad_bytes_per_param_byte)
        for reduction in buckets:
            per_device[reduction.devices[0]].append(reduction)
            reduced_until[reduction.devices[0]] = reduction.end_ms  # one at a time, in order, per device
    sharded = bool(held) and memory.shards > 1
    if memory.step_bytes_per_param_byte > 0 or sharded:
        weights = _static_bytes(sc.params, stage_device, tied, num_devices, MemoryModel(state_bytes_per_param_byte=1.0))
        for device in range(num_devices):
            at = max(_last_gradient_end(device_ops[device], done, per_kind, num_micro), reduced_until[device])
            step = weights[device] * memory.step_bytes_per_param_byte / cluster.memory_bandwidth * 1e3
            if step > 0:
                per_device[device].append(Reduction(OPTIMIZER_STEP, (device,), at, at + step))
                at += step
            if sharded and held[device] > 0 and not gathers:
                per_device[device].append(Reduction(SHARD_BROADCAST, (device,), at, at + cluster.all_gather_ms(
                    held[device]) + cluster.message_overhead_ms))
    for mine in per_device:
        for reduction in mine:
            iteration = max(iteration, reduction.end_ms)
        reductions.extend(mine)
    iteration += cluster.step_overhead_ms  # host time outside the ops, once a step
    if not record:
        return iteration, tuple(s + a for s, a in zip(static, peak))

    return SimResult(
        plan=plan, cluster=cluster, iteration_ms=iteration, transfers=tuple(transfers),
        static_memory_bytes=tuple(static), peak_activation_bytes=tuple(peak), reductions=tuple(reductions),
        _starts=starts, _ends=done, _pred=pred, memory=memory,  # type: ignore[arg-type]
    )


def _last_gradient_end(ops: tuple[Op, ...], done: list[float], per_kind: int, num_micro: int) -> float:
    """When a device's last B or W ended (0 if it runs none): where the runtime reduces tied gradients."""
    for op in reversed(ops):
        if op.kind is not OpKind.F:
            return done[_KIND_INDEX[op.kind] * per_kind + op.stage * num_micro + op.microbatch]
    return 0.0


SHARD_BROADCAST = "data-parallel shard broadcast"
"""The `Reduction` name of a device's share broadcast after a sharded optimizer step."""

PARAM_GATHER = "data-parallel parameter gather"
"""The `Reduction` name (then " stage s") of a stage's share broadcast overlapped with the next
step (`MemoryModel.overlap_param_gather`)."""

OPTIMIZER_STEP = "optimizer step"
"""The `Reduction` name of a device's optimizer step (`MemoryModel.step_bytes_per_param_byte`):
compute on the device, not a message."""


def _layer_stages(plan: PipelinePlan) -> list[int]:
    """Each layer's stage under the plan's partition."""
    return [stage for stage, (start, end) in enumerate(zip(plan.boundaries[:-1], plan.boundaries[1:]))
            for _ in range(start, end)]


def _param_gathers(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec,
                   params: Sequence[float]) -> tuple[list[Reduction], list[float]]:
    """A sharded state's broadcast overlapped with the step (`MemoryModel.overlap_param_gather`),
    as the runtime issues it: from the step's start, per device one stage at a time in the order
    of their first forwards there (a parameter tied across two of the device's stages goes with
    the first), each an all-gather of the stage's parameters among the device's copies. Returns
    the gathers and when each stage's has ended (its forwards' release; 0 for a stage with none)."""
    stage_of = _layer_stages(plan)
    tied_in: list[list[tuple[int, float]]] = [[] for _ in range(plan.num_stages)]  # (tied index, bytes) per layer
    for index, tied in enumerate(costs.tied):
        for layer in tied.layers:
            tied_in[stage_of[layer]].append((index, float(tied.bytes)))
    gathers = []
    release = [0.0] * plan.num_stages
    for device, ops in enumerate(plan.device_ops):
        sent: set[int] = set()
        free = 0.0
        seen: set[int] = set()
        for op in ops:
            if op.kind is not OpKind.F or op.stage in seen:
                continue
            seen.add(op.stage)
            size = params[op.stage]
            for index, size_of in tied_in[op.stage]:  # each tied layer counted the parameter: once a device
                size -= size_of
                if index not in sent:
                    sent.add(index)
                    size += size_of
            if size > 0:
                end = free + cluster.all_gather_ms(size) + cluster.message_overhead_ms
                gathers.append(Reduction(f"{PARAM_GATHER} stage {op.stage}", (device,), free, end))
                release[op.stage] = free = end
    return gathers, release


def _data_parallel_buckets(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, params: Sequence[float],
                           done: list[float], per_kind: int, reduced_until: Sequence[float],
                           sharded: bool = False, grad_bytes: float = 1.0) -> tuple[list[Reduction], list[float]]:
    """Each device's gradient all-reduces over its data-parallel copies, as the runtime issues
    them: a bucket per stage once the stage's last B/W on the device has run (a parameter that
    two of the device's stages share goes with the later one), then the parameters tied across
    devices after their tied all-reduce; one at a time per device, in the order they are ready.
    `sharded` (the optimizer's state split over the copies): each bucket is reduced onto its
    owning copies (a reduce-scatter). `grad_bytes`: gradient bytes per byte of weights
    (`MemoryModel.grad_bytes_per_param_byte`). Returns the reductions and each device's weight
    bytes summed (what a sharded state's broadcast after the step moves, which `_run` prices)."""
    num_micro = plan.num_microbatches
    ready = [0.0] * plan.num_stages
    for ops in plan.device_ops:
        for op in ops:
            if op.kind is not OpKind.F:
                ready[op.stage] = max(ready[op.stage], done[_KIND_INDEX[op.kind] * per_kind + op.stage * num_micro
                                                            + op.microbatch])
    bucket = list(params)
    across = [0.0] * plan.num_devices
    stage_of = _layer_stages(plan)
    for tied in costs.tied:
        stages = [stage_of[layer] for layer in tied.layers]
        for stage in stages:  # every layer of it counted the tied bytes
            bucket[stage] -= tied.bytes
        devices = {plan.placement[stage] for stage in stages}
        if len(devices) > 1:
            for device in devices:
                across[device] += tied.bytes
        else:
            bucket[max(stages, key=lambda stage: (ready[stage], stage))] += tied.bytes
    result = []
    held = [0.0] * plan.num_devices
    for device in range(plan.num_devices):
        queue = sorted((ready[stage], stage) for stage in plan.stages_of(device) if bucket[stage] > 0)
        end_of_backward = max((ready[stage] for stage in plan.stages_of(device)), default=0.0)
        if across[device] > 0:
            queue.append((max(end_of_backward, reduced_until[device]), -1))
        free = 0.0
        for at, stage in queue:
            size = bucket[stage] if stage >= 0 else across[device]
            held[device] += size
            start = max(at, free)
            moved = size * grad_bytes
            free = start + (cluster.reduce_scatter_ms(moved) if sharded else cluster.all_reduce_ms(moved)) \
                + cluster.message_overhead_ms
            name = f"data-parallel stage {stage}" if stage >= 0 else "data-parallel tied"
            result.append(Reduction(name, (device,), start, free))
    return result, held


def _tied_holders(plan: PipelinePlan, costs: CostTable) -> list[tuple[str, float, dict[int, int]]]:
    """Per tied parameter: (name, bytes, {device: how many of its layers that device holds})."""
    key = ("tied_holders", id(costs))
    cached = plan._cache.get(key)
    if cached is None or cached[0] is not costs:
        cached = plan._cache[key] = (costs, _tied_counts(costs, plan.boundaries, plan.placement))
    return cached[1]


def _tied_counts(costs: CostTable, boundaries: Sequence[int], placement: Sequence[int]
                 ) -> list[tuple[str, float, dict[int, int]]]:
    """Per tied parameter of `costs`: (name, bytes, {device: how many of its layers that device
    holds}) under the partition `boundaries` and the stage -> device map `placement`."""
    holders = []
    for tied in costs.tied:
        counts: dict[int, int] = {}
        for layer in tied.layers:
            device = placement[bisect.bisect_right(boundaries, layer) - 1]
            counts[device] = counts.get(device, 0) + 1
        holders.append((tied.name, float(tied.bytes), counts))
    return holders


def static_memory(costs: CostTable, boundaries: Sequence[int], placement: Sequence[int], num_devices: int,
                  memory: MemoryModel = MemoryModel()) -> list[float]:
    """Bytes of weights, gradients and optimizer state per device, as `simulate` counts them: each
    stage's parameters on its device, a tied parameter once per device however many of its layers
    that device holds."""
    params = [costs.range_sum("params", start, end) for start, end in zip(boundaries[:-1], boundaries[1:])]
    return _static_bytes(params, placement, _tied_counts(costs, boundaries, placement), num_devices, memory)


def _static_bytes(params: Sequence[float], placement: Sequence[int], tied: list[tuple[str, float, dict[int, int]]],
                  num_devices: int, memory: MemoryModel) -> list[float]:
    static = [0.0] * num_devices
    for stage, size in enumerate(params):
        static[placement[stage]] += size * memory.state_bytes_per_param_byte
    for _, size, holders in tied:
        for device, count in holders.items():  # the layers on one device share one copy
            static[device] -= (count - 1) * size * memory.state_bytes_per_param_byte
    return static


def _split_flags(plan: PipelinePlan, per_kind: int) -> list[bool]:
    """is_split[stage * M + microbatch]: whether that pair has a W op (its B is input-only)."""
    cached = plan._cache.get("split_flags")
    if cached is None:
        cached = [False] * per_kind
        num_micro = plan.num_microbatches
        for ops in plan.device_ops:
            for op in ops:
                if op.kind is OpKind.W and 0 <= op.stage < plan.num_stages and 0 <= op.microbatch < num_micro:
                    cached[op.stage * num_micro + op.microbatch] = True
        plan._cache["split_flags"] = cached
    return cached


def _missing_ops(plan: PipelinePlan, done: list[float], per_kind: int) -> list[Op]:
    missing = []
    for kind_index, kind in enumerate((OpKind.F, OpKind.B)):
        for stage in range(plan.num_stages):
            for micro in range(plan.num_microbatches):
                if done[kind_index * per_kind + stage * plan.num_microbatches + micro] < 0:
                    missing.append(Op(stage, kind, micro))
    return missing


def _deadlock(plan: PipelinePlan, pointer: list[int]) -> PlanError:
    present = {op for ops in plan.device_ops for op in ops}
    stuck = []
    for device, ops in enumerate(plan.device_ops):
        if pointer[device] < len(ops):
            op = ops[pointer[device]]
            if op.kind is OpKind.F:
                need = Op(op.stage - 1, OpKind.F, op.microbatch)
            else:
                need = Op(op.stage + 1, OpKind.B, op.microbatch)
            reason = "which no device runs" if need not in present else "which never runs (dependency cycle)"
            stuck.append((device, pointer[device], op, need, reason))
    device, step, op, need, reason = stuck[0]
    others = "; ".join(f"device {d} waits at {o} for {n}" for d, _, o, n, _ in stuck[1:])
    return PlanError(
        f"plan deadlocks: device {device} step {step}: {op} waits for {need}, {reason}"
        + (f"; {others}" if others else "")
        + "\n" + render_grid(plan.device_ops, mark=(device, step))
    )
