"""Baseline schedules: the plans users pick today, built on an OctoPipe cost table.

Consumes a CostTable, a ClusterSpec and a microbatch count; produces a PipelinePlan (partition +
placement + per-device op order) for one of the published schedule families in `NAMES`. The
tuner and the solver start from these plans, and every report puts them beside OctoPipe's.

Glossary (as in `octopipe.ir.plan`):
  p, device      one accelerator; `num_devices` of them, numbered 0..p-1 (a *rank* in torch).
  v, chunk       the number of stages per device (`stages_per_device`); a device's stages are
                 its *chunks* (Megatron's virtual pipeline stages, DualPipe's chunk 0 / chunk 1).
  stage          a contiguous run of layers; S = p * v of them, numbered in data-flow order.
  placement      stage -> device. *sequential* (v = 1): stage s on device s; *looped*: stage s on
                 device s % p (Megatron interleaving); *V*: stages i and 2p-1-i on device i
                 (ZB-V, DualPipeV), so the forward goes down the devices and comes back up.
  m, microbatch  `num_microbatches` equal slices of the batch.
  F, B, W        forward; input gradient (a full backward when the pair has no W); weight gradient.

Families (one small generator each: (p, m, v) -> per-device op lists, no costs involved):
  gpipe             all forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019).
  1f1b              p-1-i warm-up forwards on device i, then one forward / one backward pairs
                    (Narayanan et al., "PipeDream-Flush", ICML 2021; Megatron-LM's default).
  interleaved-1f1b  Megatron's interleaved 1F1B on the looped placement with v chunks per device
                    (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
                    Clusters Using Megatron-LM", SC 2021), with torch.distributed.pipelining's
                    generalisation to num_microbatches not a multiple of p (rounds of
                    m // max(1, m // p) microbatches; defined when that divides m). For m % p == 0
                    and m > p it is Megatron's order; at m == p Megatron runs every forward first,
                    we (like torch) keep the 1F1B warm-up formula.
  zb-h1, zb-h2      the handcrafted schedules of Qi et al., "Zero Bubble Pipeline Parallelism",
                    ICLR 2024, Sec. 3: every backward split into B and W; device i runs, at step
                    x, F(x), B(x - k(p-1-i)), W(x - k(p-1)) (those that exist), k = 1 for ZB-H1
                    (1F1B's peak memory, bubble (p-1)(T_F + T_B - T_W), T_B the input gradient)
                    and k = 2 for ZB-H2 ((2p-1) microbatches of activations; the paper's bubble
                    (p-1)(T_F + T_B - 2 T_W) hides the fill behind the previous iteration, a
                    synchronous iteration's is (p-1) max(T_F, T_F + T_B - 2 T_W)). This is the paper's
                    schedule, not the authors' "quick start" Megatron patch, which keeps most B+W
                    fused.
  zb-v              their V-shape schedule (Sec. 6), 2 stages per device, the same order as
                    torch.distributed.pipelining.ScheduleZBVZeroBubble; for m < 2p-1 it is built
                    for 2p-1 microbatches and the extra ones are dropped (torch does the same).
  dualpipe-v        DeepSeek's DualPipeV order (DeepSeek-AI, "DeepSeek-V3 Technical Report",
                    2024; github.com/deepseek-ai/DualPipe) on the V placement, as in torch's
                    ScheduleDualPipeV; each overlapped F&B pair runs as F then (full) B because
                    OctoPipe has no F&B overlap. Defined for m >= 2p.

Partitions: `"uniform"` (Megatron-style equal layer counts; see `uniform_boundaries`),
`"balanced"` (cost-balanced for the family's placement; see `balanced_partition`), or explicit
boundaries [0, b1, ..., L].
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from octopipe.cluster import ClusterSpec
from octopipe.errors import ArgumentError, PlanError
from octopipe.ir.costs import CostTable
from octopipe.ir.plan import Op, OpKind, PipelinePlan

__all__ = [
    "NAMES", "PARTITIONS", "build", "baselines", "device_orders", "placement_of", "uniform_boundaries",
    "balanced_boundaries", "balanced_partition", "device_loads",
]

NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipe-v")
"""Every schedule family `build` accepts, in the order reports list them."""

PARTITIONS: tuple[str, ...] = ("uniform", "balanced")
"""The named partitions; `baselines` builds each family with each of them."""

_UNIFORM_OPTIONS = ("first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss")

DeviceOrders = list[list[Op]]


# -- order generators: (p, m, v) -> per-device op lists, global stage numbers ---------------------

class _Counters:
    """Per-device bookkeeping of the multi-stage generators: the next microbatch of each
    (kind, stage) and the queue of pending weight gradients (W runs in the order its B ran)."""

    __slots__ = ("ops", "next", "pending_w")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.next: dict[tuple[OpKind, int], int] = {}
        self.pending_w: deque[tuple[int, int]] = deque()

    def emit(self, kind: OpKind, stage: int) -> int:
        microbatch = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = microbatch + 1
        self.ops.append(Op(stage, kind, microbatch))
        return microbatch

    def count(self, kind: OpKind, stage: int) -> int:
        return self.next.get((kind, stage), 0)

    def backward(self, stage: int, split: bool) -> None:
        microbatch = self.emit(OpKind.B, stage)
        if split:
            self.pending_w.append((stage, microbatch))

    def weight(self) -> None:
        if self.pending_w:
            stage, microbatch = self.pending_w.popleft()
            self.ops.append(Op(stage, OpKind.W, microbatch))


def _gpipe_order(p: int, m: int, v: int) -> DeviceOrders:
    return [[Op(i, OpKind.F, k) for k in range(m)] + [Op(i, OpKind.B, k) for k in range(m)] for i in range(p)]


def _one_f_one_b_order(p: int, m: int, v: int) -> DeviceOrders:
    orders = []
    for i in range(p):
        warmup = min(p - 1 - i, m)
        ops = [Op(i, OpKind.F, k) for k in range(warmup)]
        for k in range(m - warmup):
            ops += (Op(i, OpKind.F, warmup + k), Op(i, OpKind.B, k))
        ops += [Op(i, OpKind.B, k) for k in range(m - warmup, m)]
        orders.append(ops)
    return orders


def _zero_bubble_order(p: int, m: int, lag: int) -> DeviceOrders:
    # Step x of device i: F(x), B(x - lag(p-1-i)), W(x - lag(p-1)), each if that microbatch exists.
    # B(i, y) waits on B(i+1, y), which device i+1 issues `lag` steps earlier, and F(i, x) on
    # F(i-1, x), issued first in the same step: every dependency points to an earlier
    # (step, kind, device) key, so the order cannot deadlock for any p and m.
    orders = []
    for i in range(p):
        b_lag, w_lag = lag * (p - 1 - i), lag * (p - 1)
        ops = []
        for x in range(m + w_lag):
            if x < m:
                ops.append(Op(i, OpKind.F, x))
            if 0 <= x - b_lag < m:
                ops.append(Op(i, OpKind.B, x - b_lag))
            if x >= w_lag:
                ops.append(Op(i, OpKind.W, x - w_lag))
        orders.append(ops)
    return orders


def _zb_h1_order(p: int, m: int, v: int) -> DeviceOrders:
    return _zero_bubble_order(p, m, lag=1)


def _zb_h2_order(p: int, m: int, v: int) -> DeviceOrders:
    return _zero_bubble_order(p, m, lag=2)


def _interleaved_round_size(p: int, m: int) -> int:
    """Microbatches per round of interleaved 1F1B: m // max(1, m // p), which must divide m
    (torch's generalisation of Megatron's rounds of p microbatches, which need m % p == 0)."""
    rounds = max(1, m // p)
    if m % rounds:
        raise PlanError(
            f"interleaved-1f1b: {m} microbatches on {p} devices run in {rounds} rounds, and {m} is not a multiple "
            f"of {rounds}: use num_microbatches = k * {rounds} or a multiple of {p} (Megatron needs "
            f"num_microbatches % num_devices == 0; torch.distributed.pipelining allows m % max(1, m // p) == 0)"
        )
    return m // rounds


def _interleaved_order(p: int, m: int, v: int) -> DeviceOrders:
    per_round = _interleaved_round_size(p, m)
    total = m * v  # forwards (and backwards) per device
    orders = []
    for rank in range(p):
        # Warm-up: the earlier chunks of one round plus two forwards per hop to the last device.
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
        d = _Counters()
        for k in range(total + warmup):
            if k < total:  # forward k runs chunk (k // per_round) % v: rounds go down the chunks
                d.emit(OpKind.F, ((k // per_round) % v) * p + rank)
            if k >= warmup:  # backward j runs the chunks in reverse
                j = k - warmup
                d.emit(OpKind.B, (v - 1 - (j // per_round) % v) * p + rank)
        orders.append(d.ops)
    return orders


def _zb_v_order(p: int, m: int, v: int) -> DeviceOrders:
    built = max(2 * p - 1, m)  # fewer microbatches than 2p-1: build for 2p-1, drop the rest
    orders = []
    F_, B_, W_ = OpKind.F, OpKind.B, OpKind.W
    for i in range(p):
        down, up = i, 2 * p - 1 - i  # the V's way down (stage i) and back up (stage 2p-1-i)
        d = _Counters()
        for _ in range(2 * (p - i) - 1):  # warm-up: fill the way down,
            d.emit(F_, down)
        for _ in range(i):  # then alternate with the first forwards on the way up,
            d.emit(F_, up)
            d.emit(F_, down)
        for _ in range(p - i):  # then start the way up's backwards, W right after B
            d.emit(F_, up)
            d.emit(B_, up)
            d.emit(W_, up)
        while d.count(F_, up) < d.count(F_, down) or d.count(F_, down) < built:  # steady: F B W on each
            if d.count(F_, down) < built:
                d.emit(F_, down)
            d.emit(B_, down)
            d.emit(W_, down)
            d.emit(F_, up)
            d.emit(B_, up)
            d.emit(W_, up)
        for _ in range(i):  # cool-down: B first, W deferred into the drain's gaps
            d.emit(B_, down)
            d.emit(B_, up)
        for _ in range(p - i):
            d.emit(B_, down)
            d.emit(W_, down)
        for stage in (up, down):
            while d.count(W_, stage) < d.count(B_, stage):
                d.emit(W_, stage)
        orders.append([op for op in d.ops if op.microbatch < m])
    return orders


def _dualpipe_v_requires(p: int, m: int) -> None:
    if m < 2 * p:
        raise PlanError(
            f"dualpipe-v needs num_microbatches >= 2 * num_devices ({2 * p}), got {m} (DeepSeek's DualPipeV and "
            "torch's ScheduleDualPipeV require it): raise num_microbatches, or use zb-v, which runs any count"
        )


def _dualpipe_v_order(p: int, m: int, v: int) -> DeviceOrders:
    _dualpipe_v_requires(p, m)
    orders = []
    for i in range(p):
        down, up = i, 2 * p - 1 - i  # DualPipe's chunk 0 and chunk 1 on rank i
        d = _Counters()
        for _ in range(2 * (p - i - 1)):  # step 1: F0
            d.emit(OpKind.F, down)
        for _ in range(i + 1):  # step 2: F0 F1
            d.emit(OpKind.F, down)
            d.emit(OpKind.F, up)
        for _ in range(p - i - 1):  # step 3: B1 W1 F1 (zero bubble)
            d.backward(up, split=True)
            d.weight()
            d.emit(OpKind.F, up)
        for _ in range(m - 2 * p + i + 1):  # step 4: (F0 & B1) (F1 & B0), each pair as F then B
            d.emit(OpKind.F, down)
            d.backward(up, split=False)
            d.emit(OpKind.F, up)
            d.backward(down, split=False)
        for _ in range(p - i - 1):  # step 5: B1 (F1 & B0)
            d.backward(up, split=False)
            d.emit(OpKind.F, up)
            d.backward(down, split=False)
        split = False  # step 6: B1 B0, the second half with B and W split
        for step in range(i + 1):
            if step == (i + 1) // 2 and i % 2 == 1:
                split = True
            d.backward(up, split)
            if step == (i + 1) // 2 and i % 2 == 0:
                split = True
            d.backward(down, split)
        for _ in range(p - i - 1):  # step 7: W B0
            d.weight()
            d.backward(down, split=True)
        while d.pending_w:  # step 8: the remaining W (i + 1 of them)
            d.weight()
        orders.append(d.ops)
    return orders


# -- families -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    order: Callable[[int, int, int], DeviceOrders]
    placement: str  # "sequential" | "looped" | "v"
    default_stages_per_device: int
    fixed_stages_per_device: bool
    requires: Callable[[int, int], object] | None = None
    """(p, m) -> raises PlanError where the family is undefined; run before partitioning."""


_FAMILIES: dict[str, _Family] = {
    family.name: family
    for family in (
        _Family("gpipe", _gpipe_order, "sequential", 1, True),
        _Family("1f1b", _one_f_one_b_order, "sequential", 1, True),
        _Family("interleaved-1f1b", _interleaved_order, "looped", 2, False, _interleaved_round_size),
        _Family("zb-h1", _zb_h1_order, "sequential", 1, True),
        _Family("zb-h2", _zb_h2_order, "sequential", 1, True),
        _Family("zb-v", _zb_v_order, "v", 2, True),
        _Family("dualpipe-v", _dualpipe_v_order, "v", 2, True, _dualpipe_v_requires),
    )
}


def _family(name: str) -> _Family:
    family = _FAMILIES.get(name)
    if family is None:
        raise ArgumentError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")
    return family


def _stages_per_device(family: _Family, stages_per_device: int | None) -> int:
    if stages_per_device is None:
        return family.default_stages_per_device
    if not isinstance(stages_per_device, int) or isinstance(stages_per_device, bool) or stages_per_device < 1:
        raise ArgumentError(f"{family.name}: stages_per_device must be a positive integer, got {stages_per_device!r}")
    if family.fixed_stages_per_device and stages_per_device != family.default_stages_per_device:
        raise PlanError(
            f"{family.name} runs exactly {family.default_stages_per_device} stage(s) per device, got "
            f"stages_per_device={stages_per_device}; use interleaved-1f1b for other counts"
        )
    return stages_per_device


def placement_of(name: str, num_devices: int, stages_per_device: int | None = None) -> tuple[int, ...]:
    """Stage -> device of a family: sequential, looped (s % p) or V (i and 2p-1-i on device i)."""
    family = _family(name)
    v = _stages_per_device(family, stages_per_device)
    p = num_devices
    if family.placement == "v":
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))


def device_orders(
    name: str, num_devices: int, num_microbatches: int, stages_per_device: int | None = None
) -> tuple[tuple[Op, ...], ...]:
    """The per-device op order of a family, independent of costs and partition (stages are
    numbered globally; see `placement_of`). Raises PlanError where the family is undefined."""
    family = _family(name)
    v = _stages_per_device(family, stages_per_device)
    _check_counts(num_devices, num_microbatches)
    return tuple(tuple(ops) for ops in family.order(num_devices, num_microbatches, v))


def _check_counts(num_devices: int, num_microbatches: int) -> None:
    for label, value in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError(f"{label} must be a positive integer, got {value!r}")


# -- partitions -----------------------------------------------------------------------------------

def uniform_boundaries(
    num_layers: int,
    num_stages: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
) -> tuple[int, ...]:
    """Megatron-style partition by layer count: boundaries [0, b1, ..., num_layers].

    Every stage gets num_layers // num_stages layers; Megatron asserts that this divides, we
    spread the remainder one layer each over the first stages (DeepSpeed's `partition_uniform`,
    torchtitan). `first_stage_layers` / `last_stage_layers` fix the first / last stage's count
    like Megatron's num_layers_in_first/last_pipeline_stage (with several stages per device they
    apply to stage 0 and stage S-1, not to every chunk of the first/last rank as in Megatron).
    `account_for_embedding` / `account_for_loss` count the embedding / loss as one extra virtual
    layer of the first / last stage, like Megatron's account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split (the profiles merge embedding and head into the first and
    last layer, so the first / last stage ends up one real layer lighter)."""
    where = "uniform partition"
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ArgumentError(f"{where}: num_stages must be a positive integer, got {num_stages!r}")
    if first_stage_layers is not None and account_for_embedding:
        raise PlanError(f"{where}: first_stage_layers and account_for_embedding exclude each other (as in Megatron)")
    if last_stage_layers is not None and account_for_loss:
        raise PlanError(f"{where}: last_stage_layers and account_for_loss exclude each other (as in Megatron)")
    counts: list[int | None] = [None] * num_stages
    for position, label, value in ((0, "first_stage_layers", first_stage_layers), (-1, "last_stage_layers", last_stage_layers)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError(f"{where}: {label} must be a positive integer, got {value!r}")
        if num_stages == 1:
            raise PlanError(f"{where}: {label} needs at least 2 stages, the plan has 1")
        counts[position] = value
    free = [s for s, c in enumerate(counts) if c is None]
    virtual_layers = num_layers - sum(c for c in counts if c is not None)
    virtual_layers += int(account_for_embedding) + int(account_for_loss)
    if free:
        share, extra = divmod(virtual_layers, len(free))
        for position, stage in enumerate(free):
            counts[stage] = share + (1 if position < extra else 0)
    elif virtual_layers != 0:
        raise PlanError(
            f"{where}: first_stage_layers + last_stage_layers = {num_layers - virtual_layers} but the model has "
            f"{num_layers} layers and there are no other stages to take the difference"
        )
    if account_for_embedding:
        counts[0] -= 1  # type: ignore[operator]
    if account_for_loss:
        counts[-1] -= 1  # type: ignore[operator]
    if any(c is None or c < 1 for c in counts):
        raise PlanError(
            f"{where}: {num_layers} layers cannot give each of {num_stages} stages at least one layer with these "
            f"options (stage layer counts would be {counts}); use fewer stages or devices"
        )
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)  # type: ignore[operator]
    return tuple(bounds)


def balanced_boundaries(weights: Sequence[float], num_parts: int) -> tuple[int, ...]:
    """Split `weights` into `num_parts` non-empty contiguous parts minimising the heaviest part
    (exact), and among those splits the sum of squared part weights (the most even one).
    Returns boundaries [0, b1, ..., len(weights)]. O(L^2 log L) for the min-max search plus a DP
    over parts whose width is limited by the optimal cap."""
    weights = [float(w) for w in weights]
    size = len(weights)
    if not isinstance(num_parts, int) or not 1 <= num_parts <= size:
        raise PlanError(f"cannot split {size} layers into {num_parts!r} non-empty stages; need 1 <= stages <= layers")
    if any(w < 0 for w in weights):
        raise PlanError("balanced partition: layer weights must be non-negative")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    scale = max(prefix[-1], 1.0) * 1e-12

    def parts_needed(cap: float) -> int:
        # greedy: each part takes as many layers as fit under cap (at least one)
        parts, start = 0, 0
        while start < size:
            end = bisect.bisect_right(prefix, prefix[start] + cap + scale, lo=start + 1) - 1
            start = max(end, start + 1)
            parts += 1
        return parts

    candidates = sorted({prefix[b] - prefix[a] for a in range(size) for b in range(a + 1, size + 1)})
    # the answer is a part's weight, and no part is lighter than the heaviest layer (a prefix
    # difference can round a layer's weight down by an ulp: compare with the same tolerance)
    lo, hi = bisect.bisect_left(candidates, max(weights) - scale), len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if parts_needed(candidates[mid]) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    cap = candidates[lo] + scale
    # DP over (parts used, layers covered): minimise the sum of squares under the cap
    inf = float("inf")
    best = [[inf] * (size + 1) for _ in range(num_parts + 1)]
    choice = [[-1] * (size + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for part in range(1, num_parts + 1):
        row, previous = best[part], best[part - 1]
        for end in range(part, size - (num_parts - part) + 1):
            start = end - 1
            while start >= part - 1:
                load = prefix[end] - prefix[start]
                if load > cap:
                    break
                if previous[start] < inf:
                    value = previous[start] + load * load
                    if value < row[end]:
                        row[end] = value
                        choice[part][end] = start
                start -= 1
    bounds = [size]
    for part in range(num_parts, 0, -1):
        bounds.append(choice[part][bounds[-1]])
    return tuple(reversed(bounds))


def device_loads(bounds: Sequence[int], placement: Sequence[int], weights: Sequence[float]) -> tuple[float, ...]:
    """Sum of `weights` over each device's stages for boundaries `bounds` and stage -> device `placement`."""
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    loads = [0.0] * (max(placement) + 1)
    for stage, device in enumerate(placement):
        loads[device] += prefix[bounds[stage + 1]] - prefix[bounds[stage]]
    return tuple(loads)


def balanced_partition(
    weights: Sequence[float], placement: Sequence[int], start: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Boundaries minimising the busiest device's load (sum of `weights` over its stages).

    One stage per device (any distinct placement): exact, `balanced_boundaries`. Several stages
    per device (looped, V): coordinate descent that moves one boundary at a time to its best
    position, from the stage-balanced split and from `start` (pass the uniform split; the
    result is never worse than it), minimising (max device load, sum of squared stage loads):
    the tie-break evens out the stages, which run in lockstep rounds in these schedules.
    Exact optimisation there is a non-contiguous bin-packing problem; this is a heuristic."""
    num_stages = len(placement)
    if len(set(placement)) == num_stages:
        return balanced_boundaries(weights, num_stages)
    size = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    num_devices = max(placement) + 1

    def objective(bounds: list[int]) -> tuple[float, float]:
        loads, spread = [0.0] * num_devices, 0.0
        for stage, device in enumerate(placement):
            load = prefix[bounds[stage + 1]] - prefix[bounds[stage]]
            loads[device] += load
            spread += load * load
        return max(loads), spread

    def descend(bounds: list[int]) -> tuple[tuple[float, float], list[int]]:
        current = objective(bounds)
        improved = True
        while improved:
            improved = False
            for k in range(1, num_stages):
                keep = bounds[k]
                best_position, best_value = keep, current
                for position in range(bounds[k - 1] + 1, bounds[k + 1]):
                    if position == keep:
                        continue
                    bounds[k] = position
                    value = objective(bounds)
                    if value < best_value:
                        best_position, best_value = position, value
                bounds[k] = best_position
                if best_position != keep:
                    current, improved = best_value, True
        return current, bounds

    starts = [list(balanced_boundaries(weights, num_stages))]
    if start is not None:
        if len(start) != num_stages + 1 or start[0] != 0 or start[-1] != size:
            raise PlanError(f"balanced partition: start boundaries {list(start)} do not split {size} layers into {num_stages} stages")
        starts.append(list(start))
    return tuple(min((descend(b) for b in starts), key=lambda result: result[0])[1])


def _layer_loads(costs: CostTable) -> list[float]:
    return [f + b for f, b in zip(costs.forward, costs.backward_full)]


def _boundaries(
    partition: str | Sequence[int], costs: CostTable, placement: Sequence[int], options: Mapping[str, Any], name: str
) -> tuple[int, ...]:
    num_layers, num_stages = len(costs), len(placement)
    if num_layers < num_stages:
        raise PlanError(
            f"{name} on this placement needs {num_stages} stages but the cost table {costs.model!r} has only "
            f"{num_layers} layers; use fewer devices (CLI: --devices, train --nprocs) or a schedule with fewer "
            "stages per device"
        )
    if isinstance(partition, str):
        if partition == "uniform":
            return uniform_boundaries(num_layers, num_stages, **options)
        if partition == "balanced":
            if options:
                raise PlanError(f"options {sorted(options)} apply to partition='uniform' only, not 'balanced'")
            uniform = uniform_boundaries(num_layers, num_stages)
            return balanced_partition(_layer_loads(costs), placement, start=uniform)
        raise ArgumentError(f"unknown partition {partition!r}; use 'uniform', 'balanced' or boundaries [0, b1, ..., L]")
    if options:
        raise PlanError(f"options {sorted(options)} apply to partition='uniform' only, not to explicit boundaries")
    bounds = tuple(int(b) for b in partition)
    if (
        len(bounds) != num_stages + 1 or bounds[0] != 0 or bounds[-1] != num_layers
        or any(a >= b for a, b in zip(bounds, bounds[1:]))
    ):
        raise PlanError(
            f"{name}: explicit partition {list(bounds)} must be {num_stages + 1} strictly increasing boundaries "
            f"from 0 to {num_layers} (one non-empty layer range per stage)"
        )
    return bounds


# -- public entry points --------------------------------------------------------------------------

def build(
    name: str,
    costs: CostTable,
    cluster: ClusterSpec | str,
    num_microbatches: int,
    *,
    num_devices: int | None = None,
    partition: str | Sequence[int] = "uniform",
    stages_per_device: int | None = None,
    **options: Any,
) -> PipelinePlan:
    """Build the baseline plan `name` (one of `NAMES`) for `costs` on `cluster`.

    num_devices: devices to use (default: all of the cluster's). partition: "uniform",
    "balanced" or boundaries [0, b1, ..., L] with one range per stage. stages_per_device: v of
    interleaved-1f1b (default 2); the other families have a fixed count (1, or 2 for zb-v and
    dualpipe-v). options (uniform partition only): first_stage_layers, last_stage_layers,
    account_for_embedding, account_for_loss (see `uniform_boundaries`).
    Raises PlanError naming the constraint where the family is undefined for the input."""
    family = _family(name)
    cluster = ClusterSpec.of(cluster, f"{name}: cluster")  # a preset name or spec file too
    unknown = sorted(set(options) - set(_UNIFORM_OPTIONS))
    if unknown:
        raise ArgumentError(f"{name}: unknown option(s) {unknown}; valid options are {list(_UNIFORM_OPTIONS)}")
    p = cluster.num_devices if num_devices is None else num_devices
    _check_counts(p, num_microbatches)
    if p > cluster.num_devices:
        raise ArgumentError(f"{name}: num_devices={p} but the cluster {cluster.name!r} has {cluster.num_devices} devices")
    v = _stages_per_device(family, stages_per_device)
    if family.requires is not None:
        family.requires(p, num_microbatches)
    placement = placement_of(name, p, v)
    bounds = _boundaries(partition, costs, placement, options, name)
    return PipelinePlan.build(num_microbatches, bounds, placement, _orders(name, p, num_microbatches, v), num_devices=p)


@functools.lru_cache(maxsize=64)
def _orders(name: str, p: int, m: int, v: int) -> tuple[tuple[Op, ...], ...]:
    """Family `name`'s per-device op orders: they do not depend on the partition, so a family's
    uniform and balanced plans (and `every_partition`'s) share one generated order."""
    return tuple(tuple(ops) for ops in _family(name).order(p, m, v))


EVERY_PARTITION_LIMIT = 32
"""`every_partition` builds a family on each of its contiguous partitions where there are at most this many."""


def every_partition(
    costs: CostTable, cluster: ClusterSpec, num_microbatches: int, known: Mapping[str, PipelinePlan], *,
    num_devices: int | None = None, limit: int = EVERY_PARTITION_LIMIT,
) -> dict[str, PipelinePlan]:
    """Every family on each of its contiguous partitions ("<family>/0,1,4" by boundaries), for the
    families with at most `limit` of them (few layers for their stages: a tiny model), less those
    in `known` (`baselines`' plans, by family and boundaries): there the search starts from all of
    them, so its plan is never slower than one of them that fits the limits, unless cut short (the
    balanced partition weighs compute only; a slow link wants the cut where the least crosses it)."""
    p = num_devices or cluster.num_devices
    layers = len(costs)
    built = {(name.split("/")[0], plan.boundaries) for name, plan in known.items()}
    plans: dict[str, PipelinePlan] = {}
    for name in NAMES:
        try:
            stages = len(placement_of(name, p))
        except PlanError:
            continue
        if not 1 <= stages <= layers or math.comb(layers - 1, stages - 1) > limit:
            continue
        for cuts in itertools.combinations(range(1, layers), stages - 1):
            bounds = (0, *cuts, layers)
            if (name, bounds) in built:
                continue
            try:
                plans[f"{name}/{','.join(map(str, bounds))}"] = build(
                    name, costs, cluster, num_microbatches, num_devices=p, partition=list(bounds))
            except PlanError:
                continue
    return plans


def baselines(
    costs: CostTable, cluster: ClusterSpec, num_microbatches: int, *, num_devices: int | None = None
) -> dict[str, PipelinePlan]:
    """Every family x {uniform, balanced} partition defined for this input, keyed
    "<family>/<partition>" (e.g. "1f1b/uniform", "zb-v/balanced"), in `NAMES` order. A family
    that is undefined here (too few layers for its stages, a microbatch count it cannot run) is
    left out."""
    return dict(iter_baselines(costs, cluster, num_microbatches, num_devices=num_devices))


def baselines_order() -> Iterator[str]:
    """Every baseline's key, "<family>/<partition>", in `baselines`' order."""
    return (f"{name}/{partition}" for name in NAMES for partition in PARTITIONS)


def iter_baselines(
    costs: CostTable, cluster: ClusterSpec, num_microbatches: int, *, num_devices: int | None = None,
    first: Sequence[str] = (),
) -> Iterator[tuple[str, PipelinePlan]]:
    """`baselines`' plans one at a time, each built when asked for: the families in `first`, then
    the others, in `NAMES` order (so a caller short of time can stop after those it needs most)."""
    for name in [*first, *(name for name in NAMES if name not in first)]:
        for partition in PARTITIONS:
            try:
                plan = build(name, costs, cluster, num_microbatches, num_devices=num_devices, partition=partition)
            except PlanError:
                continue
            yield f"{name}/{partition}", plan
