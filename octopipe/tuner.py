"""Iterative bubble-aware tuner: joint search over partition, placement and op order.

Consumes a CostTable, a ClusterSpec and a microbatch count; produces the best PipelinePlan it
finds (simulated by `octopipe.simulator`, the shared contract) that fits the memory limits, and
a log of what it tried.

Glossary: a *structure* is a partition (stage layer ranges) plus a placement (stage -> device);
an *order* is each device's op sequence; a *lap* is a run of p consecutive stages of a looped or
zigzag placement (each visits every device once); a *policy* is a set of knobs of the list
scheduler. The tuner

1. builds candidate structures: every baseline's, and looped and zigzag placements of p, 2p,
   3p, ... stages (up to one layer per stage) whose boundaries balance the devices' loads three
   ways: the busiest device's load (`schedules.balanced_partition`), equal stages, and
   *release-aware* (`solver.balanced_structure`): a device cannot start before microbatch 0
   reaches its first layer, so devices that start late should carry less; and, where a
   placement leaves one device more than 5% over the mean load, that placement *rebalanced* by
   one and by two moves: a stage of the busiest device moved to (or swapped with) the device that
   lowers it most (when layers do not divide evenly over the laps, a zigzag's heavy last stage
   lands on a device that already holds a full stage while others sit idle; a few moves keep the
   shape, more scramble the stage order across devices);
2. orders each structure with the bubble-aware list scheduler (below) under the memory limit with
   a few screening policies, then the best structures with every policy;
3. improves the best few by hill climbing on (memory overshoot, iteration time): a boundary moved
   by one or two layers, two stages of a lap swapping devices, a stage of the busiest device moved
   to a light one, each re-ordered by the list scheduler with the structure's best policies; a
   boundary moved under the current order (the baselines' orders are templates, and a baseline
   slightly over the memory limit is repaired this way); and policy neighbours (warm-up depth,
   when W runs, waiting for an imminent B); and,
   at a local optimum, activation recomputation toggled (off per stage; where it is worth it,
   on per stage or for all stages of the device whose activations fill most of its budget, or
   everywhere; the same for selective recomputation where the costs know it, and a fully
   recomputing stage made selective);
4. iterated local search: perturbs the best structure by a few random moves and climbs again,
   until several rounds in a row find nothing better;
5. fills the largest idle gaps of the best plan by moving a later op (a W, an F) into them.

Where memory binds the fastest baseline, the baselines with every stage recomputing its
activations (as their users would run them; and, where the costs say what selective
recomputation keeps and costs, with every stage recomputing selectively) are starts too; where
one of those beats every start that fits without it, recomputation is worth the search's work
(else those starts and their work are dropped, and the rest is the search without it): those
structures list-scheduled with every stage recomputing, the best screened structures so where
memory binds them, and the recomputation moves of step 3 (otherwise only moves that turn it off). The search without
recomputation then runs too, exactly as `recompute=False` runs it (its own budget, in the time
left), and the faster plan wins: allowing recomputation never returns a slower plan than
forbidding it. A recomputing stage's B takes one more F, and between F and B the stage holds
only its inputs (see `simulator`).

Under an activation limit a second search runs beside the main one, with its own quarter of the
budget: every structure list-scheduled with more microbatches in flight than its round trips ask
for (`DEEPER_POLICIES`; the budget still caps them), a climb from the fastest that fits, and step
5 on its best. Round-trip caps can leave a device's activation budget unused while it idles,
where its stages' round trips are long (the early stages of a V placement: DeepSeek's analytic
table on 16 devices, 477 -> 452 ms); the main search's policies (slack 0-3) do not reach that far.
Its plan is taken in only where faster, so it never makes a plan slower.

Two more searches run after it, each taken in only where faster. Where a message costs at least
FEWER_DEVICES_SHARE of a layer's work (CPU processes sending tens of MB), pipelines on fewer
devices: the moves keep the number of devices a plan uses, and on such a link the fewest
boundaries win. And where recomputation was not worth trying from the baselines, climbs with the
recomputation moves from the fastest shapes and from the fastest structures over the limit: a
partition the baselines do not have can fit only by recomputing. Without these a looser memory
limit could plan slower than a tighter one (stop 37's fuzz: 28 of 105 random tables, up to 3x).
Last, step 4 again from the fastest plan of another shape (`plan_shape`), on a tenth more work,
taken in only where faster: step 4 perturbs only the best plan, so it settles in the basin of the
start that climbed furthest first (on stop 37's fuzz tables at effort 0.05, 28 of 630 plans up to
3.8% faster).

Only strict improvements that fit the memory limits are kept. The search is deterministic for a
given input and seed: its budget counts work (ops scheduled and simulated), not seconds;
`time_limit_s` only cuts it short (and `TuneResult.cut_short` says so).

The list scheduler replays the simulator's timing rules event by event: whenever a device is free
it runs the best op that is ready — an input-gradient B first (it is on the critical path and frees
memory), then a forward if the stage's in-flight microbatches and the device's activation budget
allow, then a pending W (weight gradients fill gaps; they also run first when too many wait).
Each stage keeps at most `cap` microbatches in flight, `cap` from the time a microbatch needs
to come back (its round trip) over the device's per-microbatch load, like 1F1B's p - i.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush

from octopipe.cluster import ClusterSpec
from octopipe.errors import PlanError
from octopipe.ir.costs import CostTable
from octopipe.ir.plan import Op, OpKind, PipelinePlan, Stage
from octopipe.simulator import (
    LinkQueues,
    MemoryModel,
    SimResult,
    StageCosts,
    iteration_time,
    message_host_ms,
    sent_outputs,
    simulate,
    static_memory,
)

FEWER_DEVICES_SHARE = 0.05
"""Where sending a layer's output costs at least this share of a layer's F and B
(`message_share`), the tuner also starts from pipelines on fewer devices. On the GPU presets a
paper-size layer's message costs well under 1% of its work; on CPU processes exchanging
activations of tens of MB over gloo, several layers' work."""

RUNNER_UP_MARGIN = 0.10
"""How much slower than the chosen plan (predicted) a runner-up may be: about the simulator's
largest error measured on CPU (benchmarks/fidelity.py). The search keeps the fastest plan of each
shape; a move whose `solver.order_bound` rules out both beating the current plan and coming
within this margin of the best is skipped."""

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W

DEFAULT_WORK = 9_000_000
"""Work budget of one tuning run at effort 1: ops list-scheduled plus ops simulated. About 3 us
of one core each, so roughly 30 s on the 2-core CI VM; small inputs converge long before (the
iterated local search stops after `patience` rounds without a better plan). Stop 28 tripled it
from 3,000,000: 27 of plan_vs_baselines' 54 plans got faster, by up to 3.5%, none slower;
planning took 6-45 s per case, 18.5 s at 8 devices x 64 microbatches (the planner is allowed 60)."""


@dataclass(frozen=True, slots=True)
class Structure:
    """Partition (layer boundaries [0, b1, ..., L]), placement (stage -> device) and which stages
    recompute their activations (empty: none)."""

    boundaries: tuple[int, ...]
    placement: tuple[int, ...]
    num_devices: int
    recompute: tuple[bool, ...] = ()
    selective: tuple[bool, ...] = ()
    """Per stage: selective recomputation (empty: none; never on a stage that recomputes)."""

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def recomputes(self, stage: int) -> bool:
        return bool(self.recompute) and self.recompute[stage]

    def selects(self, stage: int) -> bool:
        return bool(self.selective) and self.selective[stage]

    @property
    def recomputing(self) -> bool:
        """Whether any stage recomputes its activations, fully or selectively."""
        return self.recomputed > 0

    @property
    def recomputed(self) -> int:
        """How much recomputes: 2 per stage recomputing fully, 1 per stage selectively."""
        return 2 * sum(self.recompute) + sum(self.selective)

    def with_recompute(self, flags: Sequence[bool]) -> Structure:
        """This structure with these per-stage recompute flags (all off is stored as none); a
        stage that recomputes does not recompute selectively too."""
        selective = [self.selects(s) and not flag for s, flag in enumerate(flags)]
        return replace(self, recompute=tuple(bool(f) for f in flags) if any(flags) else (),
                       selective=tuple(selective) if any(selective) else ())

    def with_selective(self, flags: Sequence[bool]) -> Structure:
        """This structure with these per-stage selective recomputation flags (a stage so set no
        longer recomputes fully)."""
        recompute = [self.recomputes(s) and not flag for s, flag in enumerate(flags)]
        return replace(self, recompute=tuple(recompute) if any(recompute) else (),
                       selective=tuple(bool(f) for f in flags) if any(flags) else ())

    def stage_loads(self, costs: CostTable) -> list[float]:
        """F + B (full) per stage; a recomputing stage's B includes its second F (`StageCosts`)."""
        sc = StageCosts.of(self.boundaries, costs, self.recompute, self.selective)
        return [f + b for f, b in zip(sc.forward, sc.backward_full)]

    def device_loads(self, costs: CostTable) -> list[float]:
        loads = [0.0] * self.num_devices
        for stage, load in enumerate(self.stage_loads(costs)):
            loads[self.placement[stage]] += load
        return loads

    def stages(self) -> tuple[Stage, ...]:
        return tuple(Stage(i, a, b, self.placement[i], self.recomputes(i), self.selects(i))
                     for i, (a, b) in enumerate(zip(self.boundaries[:-1], self.boundaries[1:])))

    @classmethod
    def of(cls, plan: PipelinePlan) -> Structure:
        structure = cls(plan.boundaries, plan.placement, plan.num_devices)
        return structure.with_selective(plan.selective).with_recompute(plan.recompute)


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the list scheduler."""

    split_backward: bool = True
    """Run B as input gradient only and W separately (zero-bubble style)."""
    depth_first: bool = True
    """Among ready forwards prefer the deepest stage (microbatches reach the end sooner)."""
    inflight_slack: int = 0
    """Microbatches in flight per stage beyond the round-trip estimate (can be negative; each stage
    keeps at least one)."""
    max_pending_w: int = 1 << 30
    """Per stage, W ops allowed to wait; at the limit the oldest W runs before new forwards."""
    roundtrip_caps: bool = True
    """Cap each stage's in-flight microbatches by its round trip; else only memory limits them."""
    reserve: int = 1
    """Microbatches of activation memory a forward must leave free for each deeper stage on the
    same device (without it the first stage can fill the budget and starve the later ones)."""
    lookahead: float = 0.0
    """Wait for a B that arrives within this fraction of the F or W the device would start
    instead (a long F started just before a gradient arrives delays the whole backward chain)."""
    shallow_first: bool = False
    """Among ready forwards prefer the shallowest stage (new microbatches enter the pipeline at
    the rate it drains them; with several stages per device depth-first can starve stage 0)."""
    pending_w_by_depth: bool = False
    """Let each stage keep at most as many W waiting as its device's rank (by first stage): the
    zero-bubble H1 pattern, in which device i runs W i steps after its B."""
    lazy_w: bool = False
    """Keep W ops for the drain: run one only when memory holds a forward back, too many wait,
    or the device has issued all its forwards (then the backward chain of the last microbatches
    leaves gaps that only W can fill)."""


def _stage_arrays(structure: Structure, costs: CostTable, split: bool) -> tuple[StageCosts, list[float], list[float]]:
    """The structure's stage costs, and per stage the B and W durations under `split`. (What a
    stage sends its successor, `output`, moves with skip tensors; their own messages to later
    stages are the simulator's, not this scheduler's, to time.)"""
    sc = StageCosts.of(structure.boundaries, costs, structure.recompute, structure.selective)
    backward = list(sc.backward_input if split else sc.backward_full)
    weight = list(sc.weight) if split else [0.0] * structure.num_stages
    return sc, backward, weight


def inflight_caps(structure: Structure, costs: CostTable, cluster: ClusterSpec, num_microbatches: int,
                  policy: Policy, activation_budget: Sequence[float] | None) -> list[int]:
    """Microbatches each stage may hold between its F and its B."""
    sc, backward, weight = _stage_arrays(structure, costs, policy.split_backward)
    forward, output = sc.forward, sc.output
    num_stages = structure.num_stages
    placement = structure.placement
    if not policy.roundtrip_caps:
        return [num_microbatches] * num_stages
    load = [0.0] * structure.num_devices
    for s in range(num_stages):
        load[placement[s]] += forward[s] + backward[s] + weight[s]
    caps = []
    for s in range(num_stages):
        trip = forward[s]
        for t in range(s + 1, num_stages):
            trip += forward[t] + backward[t]
            if placement[t] != placement[t - 1]:
                trip += 2 * cluster.transfer_ms(output[t - 1], placement[t - 1], placement[t])
        cycle = max(load[placement[s]], 1e-9)
        caps.append(max(1, min(num_microbatches, math.ceil(trip / cycle - 1e-9) + policy.inflight_slack)))
    if activation_budget is not None:
        for device in range(structure.num_devices):
            stages = [s for s in range(num_stages) if placement[s] == device]
            while sum(caps[s] * sc.held[s] for s in stages) > activation_budget[device] + 1e-6:
                reducible = [s for s in stages if caps[s] > 1]
                if not reducible:
                    break
                s = max(reducible, key=lambda s: (caps[s] * sc.held[s], -s))
                caps[s] -= 1
    return caps


@functools.lru_cache(maxsize=32)
def op_grid(num_stages: int, num_microbatches: int) -> tuple[tuple[tuple[Op, ...], ...], ...]:
    """Every op of `num_stages` stages x `num_microbatches`, as [kind F, B, W][stage][microbatch]:
    the list scheduler hands out these shared (immutable) ops instead of building new ones."""
    return tuple(tuple(tuple(Op(s, kind, mb) for mb in range(num_microbatches)) for s in range(num_stages))
                 for kind in (_F, _B, _W))


def list_schedule(
    structure: Structure,
    costs: CostTable,
    cluster: ClusterSpec,
    num_microbatches: int,
    policy: Policy = Policy(),
    activation_budget: Sequence[float] | None = None,
    memory: MemoryModel = MemoryModel(),
) -> PipelinePlan:
    """Order every device's ops for `structure` by bubble-aware list scheduling (see module doc).
    The result satisfies the per-device activation budget whenever one microbatch in flight per
    stage fits it, with what a forward sends on (held at its end until sent, or until the next
    stage's forward on the same device). Raises PlanError when the budget leaves no device anything to run."""
    sc, backward, weight = _stage_arrays(structure, costs, policy.split_backward)
    forward, activation, held, output = list(sc.forward), sc.activation, sc.held, sc.output
    num_stages, num_devices, m = structure.num_stages, structure.num_devices, num_microbatches
    placement = structure.placement
    # where messages cost the host time (gloo on CPU), an F or B takes that much longer, as the
    # simulator charges it; none on the GPU presets
    if cluster.hosts_pay_for_messages:
        posting, _ = message_host_ms(sc, placement, cluster)
        forward = [f + extra for f, extra in zip(forward, posting)]
        backward = [b + extra for b, extra in zip(backward, posting)]
    caps = inflight_caps(structure, costs, cluster, m, policy, activation_budget)
    # what a B leaves for its W, held until the W (nothing without a split)
    stash = sc.weight_stash(memory.weight_memory_fraction) if policy.split_backward else (0.0,) * structure.num_stages
    # what an F sends on, held at its end until sent (or what it leaves the next stage's F on
    # its device, until that F takes it over as its input)
    sent, taken, left = sent_outputs(sc, placement)
    budget = list(activation_budget) if activation_budget is not None else [math.inf] * num_devices
    stages_of = [[s for s in range(num_stages) if placement[s] == d] for d in range(num_devices)]
    # a recomputing stage's B takes its activations back at its start: a forward must leave room
    # for the largest such B on its device (none where every stage holds at least its activations
    # from F to B: a selective stage can hold more, its inputs and outputs beside what it keeps)
    regrow = [max([0.0] + [activation[s] - held[s] for s in stages_of[d]]) for d in range(num_devices)]
    # an F needs room for what it holds and, at its end, what it sends on (or later that B);
    # it keeps what it holds, less the input the previous stage left on this device, and what it
    # leaves the next stage's F here
    f_need = [held[s] + max(sent[s], regrow[placement[s]]) for s in range(num_stages)]
    f_keeps = [held[s] - taken[s] + left[s] for s in range(num_stages)]
    # W ops a stage may keep waiting: a global limit, or (zero-bubble H1 style) as many as its
    # device's rank in the pipeline, so the devices that finish last keep W for their drain
    rank_of = sorted(range(num_devices), key=lambda d: (stages_of[d][0] if stages_of[d] else num_stages, d))
    depth_rank = {d: r for r, d in enumerate(rank_of)}
    pending_limit = [min(policy.max_pending_w, depth_rank[placement[s]]) if policy.pending_w_by_depth
                     else policy.max_pending_w for s in range(num_stages)]
    if policy.depth_first:
        stages_of = [list(reversed(ss)) for ss in stages_of]
    # per stage: next microbatch for F, B, W; arrival time of each microbatch's input / gradient
    next_f = [0] * num_stages
    next_b = [0] * num_stages
    next_w = [0] * num_stages
    f_arrival = [[0.0] * m if s == 0 else [-1.0] * m for s in range(num_stages)]
    g_arrival = [[-1.0] * m for _ in range(num_stages)]
    f_end = [[-1.0] * m for _ in range(num_stages)]
    b_end = [[-1.0] * m for _ in range(num_stages)]
    clock = [0.0] * num_devices
    live = [0.0] * num_devices
    links = LinkQueues(cluster)
    orders: list[list[Op]] = [[] for _ in range(num_devices)]
    remaining = [len(stages_of[d]) * m * (3 if policy.split_backward else 2) for d in range(num_devices)]
    split, lazy_w, reserve, lookahead = policy.split_backward, policy.lazy_w, policy.reserve, policy.lookahead
    last_stage = num_stages - 1
    recomputing = [held[s] != activation[s] for s in range(num_stages)]
    # an op's priority as one integer, smaller first: (class, microbatch, stage term) with class
    # B 0, urgent W 1 (3 when W is lazy: after forwards), F 2; the stage term s or
    # num_stages - s (deeper first) keeps ties in stage order
    width = num_stages + 1
    per_class = (m + 1) * width
    urgent_w_class = (3 if lazy_w else 1) * per_class
    f_mb_width = 0 if policy.shallow_first or policy.depth_first else width
    f_rank = [2 * per_class + (num_stages - s if policy.depth_first and not policy.shallow_first else s)
              for s in range(num_stages)]
    nothing = 4 * per_class
    ops_f, ops_b, ops_w = op_grid(num_stages, m)

    idle_since: list[float | None] = [None] * num_devices
    """When a device found nothing to run: it then sleeps until its next known input arrives, and a
    new input produced for it wakes it earlier (at the arrival, not before it went idle)."""

    # the device to run next is the unfinished one with the earliest finite clock (the lowest
    # number on a tie): a heap of (clock, device) with an entry pushed at every change; an entry
    # whose device finished or whose clock has moved since is dropped when it surfaces
    heap = [(0.0, d) for d in range(num_devices) if remaining[d]]
    unfinished = len(heap)
    waiting_w: set[int] = set()  # devices that hold back a lazy W while they wait
    forced: set[int] = set()  # ... and must run it after all: nothing else can happen
    while unfinished:
        device = -1
        while heap:
            soonest, d = heappop(heap)
            if remaining[d] and clock[d] == soonest:
                device = d
                break
        if device < 0 and waiting_w:
            for d in sorted(waiting_w):
                clock[d] = idle_since[d] if idle_since[d] is not None else 0.0
                heappush(heap, (clock[d], d))
                forced.add(d)
            waiting_w.clear()
            continue
        if device < 0:
            stuck = next(d for d in range(num_devices) if remaining[d])
            raise PlanError(
                f"list scheduler stalled: no device can run an op (device {stuck}; in-flight caps {caps}, activation "
                f"budget {budget[stuck]:.4g} bytes); raise the memory limit or use more stages"
            )
        now = clock[device]
        on_device = stages_of[device]
        room = budget[device] + 1e-6
        best_rank, best_kind, best_s, best_ready = nothing, None, -1, 0.0
        filler_rank, filler_s, filler_ready = nothing, -1, 0.0  # the W to run when nothing else is ready
        f_blocked = False  # a forward is ready but the budget or its cap holds it back
        b_blocked = False  # a recomputing B is ready but needs the memory a waiting W holds
        earliest = earliest_b = math.inf
        for s in on_device:
            # B: oldest microbatch whose F is done and whose gradient has arrived
            nb = next_b[s]
            nf = next_f[s]
            if nb < nf:
                ready = g_arrival[s][nb] if s < last_stage else f_end[s][nb]
                if ready >= 0:
                    if ready > now:
                        if ready < earliest:
                            earliest = ready
                        if ready < earliest_b:
                            earliest_b = ready
                    elif (recomputing[s] and split and live[device] + max(activation[s], stash[s]) - held[s] > room
                          and any(next_w[t] < next_b[t] for t in on_device)):
                        b_blocked = True  # (only recomputing stages get here: no cost to the others)
                    else:
                        rank = nb * width + num_stages - s
                        if rank < best_rank:
                            best_rank, best_kind, best_s, best_ready = rank, _B, s, ready
            # W: weight gradients fill gaps; urgent when too many wait
            if split:
                mb = next_w[s]
                if mb < nb:
                    ready = b_end[s][mb]
                    if ready <= now:
                        rank = mb * width + num_stages - s
                        if nb - mb > pending_limit[s]:
                            # eager: an urgent W goes before forwards; lazy: right after them
                            if urgent_w_class + rank < best_rank:
                                best_rank, best_kind, best_s, best_ready = urgent_w_class + rank, _W, s, ready
                        elif rank < filler_rank:
                            filler_rank, filler_s, filler_ready = rank, s, ready
                    elif ready < earliest:
                        earliest = ready
            # F: within the stage's in-flight cap and the device's activation budget
            if nf < m:
                ready = f_arrival[s][nf]
                if nf - nb < caps[s]:
                    if ready >= 0:
                        if ready <= now:
                            need = live[device] + f_need[s]
                            if reserve:
                                for t in on_device:
                                    if t > s and next_f[t] < m:
                                        waiting = next_f[t] - next_w[t] if split else next_f[t] - next_b[t]
                                        if waiting < reserve:
                                            need += held[t] * (reserve - waiting)
                            if need <= room or live[device] <= 1e-9:
                                rank = f_rank[s] + nf * f_mb_width
                                if rank < best_rank:
                                    best_rank, best_kind, best_s, best_ready = rank, _F, s, ready
                            else:
                                f_blocked = True
                        elif ready < earliest:
                            earliest = ready
                elif 0 <= ready <= now:
                    f_blocked = True
        if best_kind is None and filler_s >= 0:
            # a lazy W waits for the drain (when the device has issued all its forwards) or for
            # memory to run out: the drain's gaps are where nothing else can fill in
            if (not lazy_w or f_blocked or b_blocked or device in forced
                    or all(next_f[t] >= m for t in on_device)):
                best_kind, best_s, best_ready = _W, filler_s, filler_ready
        if best_kind is None:
            if idle_since[device] is None:
                idle_since[device] = now
            clock[device] = earliest
            if earliest < math.inf:
                heappush(heap, (earliest, device))
            if filler_s >= 0:
                waiting_w.add(device)
            continue
        if waiting_w:
            waiting_w.discard(device)
        if forced:
            forced.discard(device)
        if lookahead and best_kind is not _B and earliest_b < math.inf:
            length = forward[best_s] if best_kind is _F else weight[best_s]
            if earliest_b - now < lookahead * length:
                if idle_since[device] is None:
                    idle_since[device] = now
                clock[device] = earliest_b
                heappush(heap, (earliest_b, device))
                continue
        idle_since[device] = None
        s = best_s
        start = now if now > best_ready else best_ready
        target = -1
        if best_kind is _F:
            mb = next_f[s]
            op = ops_f[s][mb]
            finish = start + forward[s]
            next_f[s] = mb + 1
            f_end[s][mb] = finish
            live[device] += f_keeps[s]
            if s < last_stage:
                target, size, arrivals = placement[s + 1], output[s], f_arrival[s + 1]
        elif best_kind is _B:
            mb = next_b[s]
            op = ops_b[s][mb]
            finish = start + backward[s]
            next_b[s] = mb + 1
            b_end[s][mb] = finish
            live[device] += stash[s] - held[s]
            if s > 0:
                target, size, arrivals = placement[s - 1], output[s - 1], g_arrival[s - 1]
        else:
            mb = next_w[s]
            op = ops_w[s][mb]
            finish = start + weight[s]
            next_w[s] = mb + 1
            live[device] -= stash[s]
        if target >= 0:
            # the message to the neighbouring stage: queued on the link after the op ends; it wakes
            # an idle target at its arrival (not before the target went idle)
            if target == device:
                arrivals[mb] = finish
            else:
                _, arrive = links.send(device, target, size, finish)
                arrivals[mb] = arrive
                idle = idle_since[target]
                if idle is not None and clock[target] > arrive:
                    clock[target] = wake = arrive if arrive > idle else idle
                    heappush(heap, (wake, target))
        orders[device].append(op)
        clock[device] = finish
        remaining[device] -= 1
        if remaining[device]:
            heappush(heap, (finish, device))
        else:
            unfinished -= 1
    return PipelinePlan(num_devices, m, structure.stages(), tuple(tuple(ops) for ops in orders))


# -- policies -------------------------------------------------------------------------------------

POLICIES: tuple[Policy, ...] = tuple(
    Policy(split_backward=split, depth_first=depth, inflight_slack=slack, max_pending_w=pending,
           roundtrip_caps=caps, reserve=reserve)
    for split in (True, False)
    for depth in (True, False)
    for caps, slack, reserve in ((True, 0, 0), (True, 1, 0), (True, 2, 0), (True, 3, 0), (False, 0, 0), (False, 0, 1))
    for pending in ((1 << 30, 2) if split else (1 << 30,))
)
"""Every policy the tuner tries on its most promising structures."""

SCREEN_POLICIES: tuple[Policy, ...] = (
    Policy(roundtrip_caps=False, reserve=1),
    Policy(roundtrip_caps=False, reserve=0),
    Policy(roundtrip_caps=True, inflight_slack=2, reserve=0),
    Policy(roundtrip_caps=True, inflight_slack=0, reserve=0),
    Policy(roundtrip_caps=False, reserve=1, lookahead=0.2),
    Policy(roundtrip_caps=False, reserve=1, max_pending_w=2),
)
"""The policies that win most often, tried on every candidate structure first."""

DEEPER_POLICIES: tuple[Policy, ...] = tuple(
    Policy(roundtrip_caps=True, inflight_slack=slack, reserve=0, lookahead=0.2) for slack in (5, 8, 11))
"""More microbatches in flight per stage than its round trip asks for (the activation budget still
caps them): what `_add_deeper_search` tries on every structure under an activation limit."""

DEEPER_WORK_SHARE = 0.25
"""The work budget of `_add_deeper_search`, as a share of the main search's."""

FEWER_WORK_SHARE = 0.1
"""The work budget of `_add_fewer_devices_search`, as a share of the main search's."""

RUNNER_UP_WORK_SHARE = 0.1
"""The work budget of `_add_runner_up_search`, as a share of the main search's."""

REPAIRS = 4
"""How many structures over the memory limit `_repair_by_recomputation` tries to make fit."""

REPAIR_WORK_SHARE = 0.1
"""The work budget of `_repair_by_recomputation`, as a share of the main search's."""


def _policy_neighbours(policy: Policy) -> list[Policy]:
    neighbours = [
        replace(policy, inflight_slack=policy.inflight_slack + 1),
        replace(policy, roundtrip_caps=not policy.roundtrip_caps),
        replace(policy, inflight_slack=max(-2, policy.inflight_slack - 1)),
        replace(policy, reserve=1 - min(policy.reserve, 1)),
        replace(policy, lookahead=0.2 if policy.lookahead == 0 else 0.0),
        replace(policy, depth_first=not policy.depth_first),
        replace(policy, split_backward=not policy.split_backward),
        replace(policy, max_pending_w=2 if policy.max_pending_w > 2 else 1 << 30),
        replace(policy, max_pending_w=1),
        replace(policy, pending_w_by_depth=not policy.pending_w_by_depth),
        replace(policy, lazy_w=not policy.lazy_w),
        replace(policy, shallow_first=not policy.shallow_first),
    ]
    return [p for p in neighbours if p != policy]


# -- search state ---------------------------------------------------------------------------------

def plan_shape(structure: Structure) -> tuple:
    """What tells plans apart for measured selection: the order in which the pipeline visits
    devices (the placement with neighbouring stages on one device merged, the devices numbered by
    first visit) and how many stages recompute. Plans of one shape differ in where the stage
    boundaries fall, in which device plays which part, and in their op order: by less than a
    measurement on a busy machine can tell. (0, 1), (1, 0) and (0, 0, 1, 1) are one shape;
    (0, 1, 1, 0) and (0, 1, 0, 1) are others."""
    visits: list[int] = []
    for device in structure.placement:
        if not visits or visits[-1] != device:
            visits.append(device)
    number: dict[int, int] = {}
    for device in visits:
        number.setdefault(device, len(number))
    return (tuple(number[device] for device in visits), sum(map(bool, structure.recompute)),
            sum(map(bool, structure.selective)))


@dataclass(frozen=True)
class Candidate:
    plan: PipelinePlan
    iteration_ms: float
    peak_activation: tuple[float, ...]
    peak_memory: tuple[float, ...]
    overshoot: float
    """How far the plan exceeds the memory limits (0 = fits): max over devices of need / limit - 1."""
    origin: str
    structure: Structure
    policy: Policy | None

    @property
    def feasible(self) -> bool:
        return self.overshoot <= 1e-9

    @property
    def score(self) -> tuple[float, float]:
        return (self.overshoot, self.iteration_ms)


@dataclass
class TuneResult:
    best: Candidate
    history: list[tuple[float, float, str]] = field(default_factory=list)
    """(seconds since start, iteration ms, what improved) for every kept improvement."""
    evaluations: int = 0
    work: int = 0
    """Ops list-scheduled and simulated: the deterministic measure of the search's effort."""
    cut_short: bool = False
    """The wall-clock limit stopped the search before its work budget did."""
    seconds: float = 0.0
    structures: int = 0
    runners_up: tuple[Candidate, ...] = ()
    """The fastest plan found of each shape (`plan_shape`) other than the best plan's that fits
    the limits, fastest first: alternatives for measured selection (`PlanResult.runners_up`)."""
    ruled_out: int = 0
    """Hill-climbing moves skipped unscheduled: `solver.order_bound` proved no order of theirs
    could be kept (see `RUNNER_UP_MARGIN`)."""
    plain: Candidate | None = None
    """Where recomputation was tried: the best plan of the search without it that ran beside
    (what `recompute=False` returns), None otherwise or when no plan fits without it."""


class _Search:
    """Shared state of one tuning run: evaluation with memoisation, budgets, the best feasible plan."""

    def __init__(self, costs: CostTable, cluster: ClusterSpec, num_microbatches: int, num_devices: int,
                 activation_budget: Sequence[float] | None, memory_limit_bytes: float | None, memory: MemoryModel,
                 work_limit: int, deadline: float, progress: Callable[[str], None] | None, started: float,
                 recompute: bool = True) -> None:
        self.costs, self.cluster, self.m, self.p = costs, cluster, num_microbatches, num_devices
        self.recompute = recompute
        """Whether structures may recompute activations."""
        self.try_recompute = False
        """Whether the search spends work on recomputation: set when a baseline with every stage
        recomputing beats every start that fits without it."""
        self.selective = recompute and costs.has_selective_info
        """Whether recomputation may be selective (the costs say what it holds and costs)."""
        self.activation_budget = list(activation_budget) if activation_budget is not None else None
        self.memory_limit = memory_limit_bytes
        self.memory = memory
        self.work_limit = work_limit
        self.deadline = deadline
        self.progress = progress
        self.started = started
        self.evaluations = 0
        self.work = 0
        self.work_beside = 0
        """Work of the searches `tune` ran beside this one (without recomputation; deeper in flight)."""
        self.cut_short = False
        self.best: Candidate | None = None
        self.best_of_shape: dict[tuple, Candidate] = {}
        """The fastest feasible candidate of each shape (see `plan_shape`)."""
        self.history: list[tuple[float, float, str]] = []
        self.scheduled: dict[tuple[Structure, Policy], Candidate | None] = {}
        self.seen_orders: set[int] = set()
        self.ruled_out = 0
        """Moves skipped because no order of theirs could be kept (`ruled_out`)."""
        self.plain_best: Candidate | None = None
        """The best plan of the search without recomputation run beside this one, if any."""

    def exhausted(self) -> bool:
        """True when the work budget or the wall clock is spent. The search is one fixed sequence
        of steps that the budget only truncates, so a larger budget never finds a worse plan."""
        if self.work >= self.work_limit:
            return True
        if time.perf_counter() >= self.deadline:
            self.cut_short = True
            return True
        return False

    def budget_for(self, structure: Structure) -> list[float] | None:
        """Per-device activation budget: the explicit one, and what the memory limit leaves after
        weights, gradients and optimizer state."""
        budget = list(self.activation_budget) if self.activation_budget is not None else None
        if self.memory_limit is not None:
            room = [self.memory_limit - x for x in self.static_memory(structure)]
            budget = room if budget is None else [min(a, b) for a, b in zip(budget, room)]
        return budget

    def static_memory(self, structure: Structure) -> list[float]:
        """Weights, gradients and state per device, as the simulator counts them (tied once)."""
        return static_memory(self.costs, structure.boundaries, structure.placement, self.p, self.memory)

    def overshoot(self, peak_activation: Sequence[float], peak_memory: Sequence[float]) -> float:
        worst = 0.0
        if self.activation_budget is not None:
            for need, have in zip(peak_activation, self.activation_budget):
                if need > have * (1 + 1e-9) + 1e-6:
                    worst = max(worst, need / max(have, 1e-9) - 1)
        if self.memory_limit is not None and max(peak_memory) > self.memory_limit * (1 + 1e-9):
            worst = max(worst, max(peak_memory) / self.memory_limit - 1)
        return worst

    def evaluate(self, plan: PipelinePlan, origin: str, structure: Structure, policy: Policy | None,
                 simulated: SimResult | None = None) -> Candidate | None:
        """`plan` simulated and kept where it is the best yet (`simulated`: its simulation, where
        the caller has it; counted as the same work, so the search's course does not change)."""
        if not self.selectable(structure):
            return None
        self.evaluations += 1
        self.work += plan.num_ops()
        if simulated is not None:
            ms, peak_memory = simulated.iteration_ms, simulated.peak_memory_bytes
        else:
            try:
                ms, peak_memory = iteration_time(plan, self.costs, self.cluster, memory=self.memory)
            except PlanError:
                return None
        static = self.static_memory(structure)
        peak_activation = tuple(max(0.0, total - fixed) for total, fixed in zip(peak_memory, static))
        candidate = Candidate(plan, ms, peak_activation, peak_memory, self.overshoot(peak_activation, peak_memory),
                              origin, structure, policy)
        if not candidate.feasible:
            return candidate
        self.keep_if_best_of_shape(candidate)
        if self.best is None or candidate.iteration_ms < self.best.iteration_ms - 1e-9:
            self.best = candidate
            elapsed = time.perf_counter() - self.started
            self.history.append((elapsed, candidate.iteration_ms, origin))
            if self.progress:
                self.progress(f"[{elapsed:6.1f}s] {candidate.iteration_ms:10.3f} ms  {origin}")
        return candidate

    def keep_if_best_of_shape(self, candidate: Candidate) -> None:
        """Keep feasible `candidate` as its shape's runner-up if it is the fastest of it so far."""
        shape = plan_shape(candidate.structure)
        known = self.best_of_shape.get(shape)
        if known is None or candidate.iteration_ms < known.iteration_ms - 1e-9:
            self.best_of_shape[shape] = candidate

    def selectable(self, structure: Structure) -> bool:
        """Whether the costs know selective recomputation on every stage `structure` recomputes
        selectively (the analysis leaves out the layers it cannot run: such a move is no plan)."""
        return not structure.selective or all(
            not flag or self.costs.selective_unknown(a, b) is None
            for flag, a, b in zip(structure.selective, structure.boundaries, structure.boundaries[1:]))

    def schedule(self, structure: Structure, policy: Policy, origin: str) -> Candidate | None:
        key = (structure, policy)
        if key in self.scheduled:
            return self.scheduled[key]
        if not self.selectable(structure):
            self.scheduled[key] = None
            return None
        self.work += structure.num_stages * self.m * (3 if policy.split_backward else 2)
        try:
            plan = list_schedule(structure, self.costs, self.cluster, self.m, policy, self.budget_for(structure),
                                 self.memory)
            candidate = self.evaluate(plan, origin, structure, policy)
        except PlanError:
            candidate = None
        self.scheduled[key] = candidate
        return candidate

    def best_policy(self, structure: Structure, origin: str, policies: Sequence[Policy]) -> Candidate | None:
        best = None
        for policy in policies:
            if self.exhausted():
                break
            candidate = self.schedule(structure, policy, origin)
            if candidate is not None and (best is None or candidate.score < best.score):
                best = candidate
        return best

    def scheduled_best(self, structure: Structure) -> Candidate | None:
        found = [c for (s, _), c in self.scheduled.items() if s == structure and c is not None]
        return min(found, key=lambda c: c.score) if found else None

    def memory_bound(self, candidate: Candidate | None, share: float = 0.95) -> bool:
        """Whether `candidate` misses the memory limits or fills `share` of a device's activation room."""
        if candidate is None or not candidate.feasible:
            return True
        budget = self.budget_for(candidate.structure)
        return budget is not None and any(a >= share * b for a, b in zip(candidate.peak_activation, budget))

    def rules_out(self, structure: Structure, current: Candidate) -> bool:
        """Whether no order of `structure` within the memory limits can beat `current` (which
        fits them) or come within RUNNER_UP_MARGIN of the best plan: `solver.order_bound`. Such a
        move would be scheduled and simulated only to be dropped, so the climb skips it; what it
        keeps is the same, at less work."""
        if not current.feasible or self.best is None:
            return False
        bound = structure_order_bound(structure, self.costs, self.m, self.budget_for(structure), self.memory)
        if bound < max(current.iteration_ms, self.best.iteration_ms * (1 + RUNNER_UP_MARGIN)) * (1 + 1e-9):
            return False
        self.ruled_out += 1
        return True

    def top_policies(self, structure: Structure, count: int) -> list[Policy]:
        """The `count` best policies tried so far on `structure`."""
        tried = [(c.score, i, policy) for i, ((s, policy), c) in enumerate(self.scheduled.items())
                 if s == structure and c is not None]
        return [policy for _, _, policy in sorted(tried)[:count]]


# -- structures -----------------------------------------------------------------------------------

def structure_order_bound(structure: Structure, costs: CostTable, num_microbatches: int,
                          activation_budget: Sequence[float] | None, memory: MemoryModel) -> float:
    """`solver.order_bound` of `structure` (partition, placement, recomputation): no op order of
    it whose activations stay within `activation_budget` per device is faster."""
    from octopipe.solver import order_bound

    sc = StageCosts.of(structure.boundaries, costs, structure.recompute, structure.selective)
    return order_bound(sc, structure.placement, num_microbatches, activation_budget,
                       sc.weight_stash(memory.weight_memory_fraction))


def placements(num_devices: int, num_stages: int) -> dict[str, tuple[int, ...]]:
    """Named stage -> device maps for `num_stages` stages: looped (s mod p) and zigzag (V:
    down the devices and back up, so the first and last stage share device 0)."""
    p = num_devices
    result = {"looped": tuple(s % p for s in range(num_stages))}
    zigzag = []
    for s in range(num_stages):
        lap, position = divmod(s, p)
        zigzag.append(position if lap % 2 == 0 else p - 1 - position)
    result["zigzag"] = tuple(zigzag)
    return result


def rebalanced_placement(stage_loads: Sequence[float], placement: Sequence[int], num_devices: int, *,
                         max_moves: int, tolerance: float = 0.05) -> tuple[int, ...] | None:
    """`placement` after up to `max_moves` moves, each the move of a stage of the busiest device
    to another device, or its swap with a stage there, that lowers the pair's larger load most;
    only while the busiest device is more than `tolerance` over the mean load and a move strictly
    lowers it. None when nothing moves. Greedy and deterministic: a candidate, not an optimum."""
    place = list(placement)
    load = [0.0] * num_devices
    for stage, device in enumerate(place):
        load[device] += stage_loads[stage]
    mean = sum(load) / num_devices
    changed = False
    for _ in range(max_moves):
        if max(load) <= (1 + tolerance) * mean:
            break
        busiest = max(range(num_devices), key=lambda d: (load[d], -d))
        peak = load[busiest]
        best: tuple[float, int, int, int] | None = None  # (new peak of the pair, stage, target, swapped stage)
        for stage in (s for s, d in enumerate(place) if d == busiest):
            for target in range(num_devices):
                if target == busiest:
                    continue
                for other in [-1, *(s for s, d in enumerate(place) if d == target)]:
                    back = stage_loads[other] if other >= 0 else 0.0
                    pair_peak = max(peak - stage_loads[stage] + back, load[target] + stage_loads[stage] - back)
                    if pair_peak < peak - 1e-9 and (best is None or pair_peak < best[0] - 1e-12):
                        best = (pair_peak, stage, target, other)
        if best is None:
            break
        _, stage, target, other = best
        place[stage] = target
        load[busiest] -= stage_loads[stage]
        load[target] += stage_loads[stage]
        if other >= 0:
            place[other] = busiest
            load[target] -= stage_loads[other]
            load[busiest] += stage_loads[other]
        changed = True
    return tuple(place) if changed else None


def stage_counts(num_devices: int, num_layers: int, max_laps: int = 8) -> list[int]:
    """p, 2p, 3p, ... stages up to `max_laps` laps and one layer per stage, and the layer count
    itself (one layer per stage) when it is not a multiple of p."""
    counts = [num_devices * laps for laps in range(1, max_laps + 1) if num_devices * laps <= num_layers]
    if num_layers not in counts and num_layers <= num_devices * max_laps and num_layers > num_devices:
        counts.append(num_layers)
    return counts or [min(num_devices, num_layers)]


def message_share(costs: CostTable, cluster: ClusterSpec) -> float:
    """What sending a layer's output to the next device costs (the link, and the host time where
    hosts pay for messages: posting and copying at both ends), over what a layer's F and B cost:
    both averaged over the layers."""
    loads = [layer.forward_ms + layer.backward_ms for layer in costs.layers]
    if not loads or sum(loads) <= 0 or cluster.num_devices < 2:
        return 0.0
    sizes = [layer.output_bytes or 0.0 for layer in costs.layers]  # (None: not known, sent as nothing)
    size = sum(sizes) / len(sizes)
    host = 2 * cluster.message_overhead_ms
    if cluster.message_copy_bandwidth:
        host += 2 * size / cluster.message_copy_bandwidth * 1e3
    return (cluster.transfer_ms(size, 0, 1) + host) / (sum(loads) / len(loads))


def fewer_device_structures(costs: CostTable, num_devices: int) -> list[tuple[Structure, str]]:
    """Contiguous pipelines on the first 1 .. p-1 devices, one device-balanced stage each (the
    rest idle): where a message costs as much as a layer's work, the fewer the boundaries, the
    fewer messages (3 layers sending 64 MB over the `cpux2` preset's 2 GB/s link, each end
    copying it: 339 ms on three devices, 47 ms on one, simulated; the moves between structures keep
    the device count, so a search from the baselines alone found such plans at some limits and not
    at others)."""
    from octopipe.schedules import balanced_boundaries
    from octopipe.solver import layer_loads

    loads = layer_loads(costs)
    found = []
    for used in range(1, min(num_devices, len(costs) + 1)):
        bounds = balanced_boundaries(loads, used)
        found.append((Structure(tuple(bounds), tuple(range(used)), num_devices), f"{used} of {num_devices} devices"))
    return found


def candidate_structures(costs: CostTable, num_devices: int, num_microbatches: int, *, seed: int = 0,
                         structure_work: float = 0.3, deadline: float | None = None) -> list[tuple[Structure, str]]:
    """Looped and zigzag placements of every stage count in `stage_counts`, each with device-
    balanced, stage-balanced and release-aware boundaries (see the module doc), de-duplicated.
    The release-aware ones come from CP-SAT (`structure_work` deterministic seconds each); past
    `deadline` (time.perf_counter()) they are left out and each solve is cut at it."""
    from octopipe.schedules import balanced_boundaries, balanced_partition, uniform_boundaries
    from octopipe.solver import balanced_structure, layer_loads

    p, num_layers = num_devices, len(costs)
    loads = layer_loads(costs)
    found: dict[Structure, str] = {}
    for count in stage_counts(p, num_layers):
        for label, placement in placements(p, count).items():
            if count == p and label == "zigzag":
                continue
            options = [
                ("device-balanced", balanced_partition(loads, placement, start=uniform_boundaries(num_layers, count))),
                ("stage-balanced", balanced_boundaries(loads, count)),
            ]
            left = _seconds_left(deadline)
            released = None if left <= 0 else balanced_structure(
                costs, p, count, placement, num_microbatches=num_microbatches, work=structure_work, seed=seed,
                hint=options[0][1], time_limit_s=None if deadline is None else left)
            if released is not None:
                options.append(("release-aware", released[0]))
            for how, bounds in options:
                structure = Structure(tuple(bounds), placement, p)
                found.setdefault(structure, f"{count} stages {label} {how}")
                if count > p:
                    for moves in (1, 2):
                        moved = rebalanced_placement(structure.stage_loads(costs), placement, p, max_moves=moves)
                        if moved is not None:
                            found.setdefault(Structure(tuple(bounds), moved, p),
                                             f"{count} stages {label} {how} rebalanced ({moves})")
        if p < count <= 3 * p and _seconds_left(deadline) > 0:
            free = balanced_structure(costs, p, count, None, num_microbatches=num_microbatches, work=structure_work,
                                      seed=seed, time_limit_s=None if deadline is None else _seconds_left(deadline))
            if free is not None:
                found.setdefault(Structure(free[0], free[1], p), f"{count} stages free placement release-aware")
    return list(found.items())


def _seconds_left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.perf_counter()


# -- the search -----------------------------------------------------------------------------------

def tune(
    costs: CostTable,
    cluster: ClusterSpec,
    num_microbatches: int,
    *,
    num_devices: int | None = None,
    time_limit_s: float = 60.0,
    effort: float = 1.0,
    activation_budget: Sequence[float] | None = None,
    memory_limit_bytes: float | None = None,
    memory: MemoryModel = MemoryModel(),
    seed: int = 0,
    start_plans: dict[str, PipelinePlan] | None = None,
    progress: Callable[[str], None] | None = None,
    patience: int = 8,
    recompute: bool = True,
    start_sims: dict[str, SimResult] | None = None,
) -> TuneResult:
    """Search partition, placement and order; return the best plan that fits the memory limits.

    `effort` scales the work budget (`DEFAULT_WORK` ops scheduled or simulated): the result is a
    function of the input, `effort` and `seed` alone unless `time_limit_s` runs out first
    (`TuneResult.cut_short`). The search is one fixed sequence of steps that the budget only
    truncates, so more effort never returns a slower plan. `recompute`: whether stages may
    recompute their activations (tried where memory binds; kept only where it makes the plan
    faster or makes it fit; where it is tried, the search without it runs as well, so its plan is
    never slower than recompute=False's, at up to twice the work). Under an activation limit a
    search beside it runs every structure with more microbatches in flight than the round trips
    ask for (`_add_deeper_search`, a quarter more work), taken in only where faster; last, the
    iterated local search again from the fastest plan of another shape (`_add_runner_up_search`, a
    tenth more work), taken in only where faster. The start
    plans are all evaluated however short the time limit (`start_sims`: the simulations of those
    the caller has run, by name, used instead of running them again). Raises PlanError when no
    plan it tried fits the limits."""
    started = time.perf_counter()
    p = num_devices or cluster.num_devices
    work_limit = int(DEFAULT_WORK * effort)
    search = _Search(costs, cluster, num_microbatches, p, activation_budget, memory_limit_bytes, memory,
                     work_limit, started + time_limit_s, progress, started, recompute)
    rng = random.Random(seed)
    starts: list[Candidate] = []
    # 1. every baseline as given (its order is a template even where it needs too much memory)
    structures: list[tuple[Structure, str]] = []
    for name, plan in sorted((start_plans or {}).items()):
        candidate = search.evaluate(plan, f"baseline {name}", Structure.of(plan), None, (start_sims or {}).get(name))
        if candidate is not None:
            starts.append(candidate)
        structures.append((Structure.of(plan), f"{name} structure"))
    # where memory binds the fastest start, the baselines with every stage recomputing (what their
    # users turn on when memory runs out); where one of them beats every start that fits without
    # it, recomputation is worth the search's time: their structures so, list-scheduled (under a
    # tight limit the first plans that overlap microbatches at all), and the moves below
    search.try_recompute = False
    if search.recompute and starts and search.memory_bound(min(starts, key=lambda c: c.iteration_ms)):
        plain = min((c.iteration_ms for c in starts if c.feasible), default=math.inf)
        recomputing, spent = [], search.work
        for name, plan in sorted((start_plans or {}).items()):
            for again, how in _recomputing(plan, search.selective):
                if search.exhausted():
                    break
                candidate = search.evaluate(again, f"baseline {name}, {how}", Structure.of(again), None)
                if candidate is not None:
                    recomputing.append(candidate)
                    search.try_recompute |= candidate.feasible and candidate.iteration_ms < plain
        if search.try_recompute:
            starts += recomputing
        else:  # not worth it: the rest of the search is recompute=False's, with its whole budget
            search.work = spent
    if search.try_recompute:
        for structure, label in dict(structures).items():
            for again, how in _recomputing_structures(structure, search.selective):
                if search.exhausted():
                    break
                candidate = search.best_policy(again, f"{label}, {how}", SCREEN_POLICIES[:3])
                if candidate is not None:
                    starts.append(candidate)
    # 2. candidate structures, screened with a few policies, the best with all of them
    structures += candidate_structures(costs, p, num_microbatches, seed=seed, deadline=search.deadline)
    unique: dict[Structure, str] = {}
    for structure, label in structures:
        unique.setdefault(structure, label)
    screened: list[tuple[tuple[float, float], int, Structure, str]] = []
    for index, (structure, label) in enumerate(unique.items()):
        if search.exhausted():
            break
        candidate = search.best_policy(structure, label, SCREEN_POLICIES)
        if candidate is not None:
            screened.append((candidate.score, index, structure, label))
    screened.sort()
    for _, _, structure, label in screened[:6]:
        if search.exhausted():
            break
        candidate = search.best_policy(structure, label, POLICIES)
        if candidate is not None:
            starts.append(candidate)
    # where memory binds the best of them, the same structures with every stage recomputing
    if search.try_recompute and screened and search.memory_bound(search.scheduled_best(screened[0][2])):
        for _, _, structure, label in screened[:3]:
            for again, how in _recomputing_structures(structure, search.selective):
                if search.exhausted():
                    break
                candidate = search.best_policy(again, f"{label}, {how}", SCREEN_POLICIES)
                if candidate is not None:
                    starts.append(candidate)
    # 3. hill climbing from the most promising distinct starts: the fastest plans that fit, and
    #    the fastest that do not by a little (a baseline's order over the limit is repaired by
    #    moving boundaries under it)
    feasible = sorted((c for c in starts if c.feasible), key=lambda c: (c.iteration_ms, c.origin))
    repairable = sorted((c for c in starts if not c.feasible and c.overshoot <= 0.15),
                        key=lambda c: (c.iteration_ms, c.origin))
    climbed: set[Structure] = set()
    orders_climbed: set[tuple] = set()  # a baseline's own order (no policy) under its structure
    for group, count in ((feasible, 4), (repairable, 2)):
        used = 0
        for candidate in group:
            if used >= count or search.exhausted():
                break
            if candidate.policy is not None and candidate.structure in climbed:
                continue
            # two baselines whose partitions coincide (uniform and balanced often do) are one start
            order = (candidate.structure, candidate.plan.device_ops)
            if candidate.policy is None and order in orders_climbed:
                continue
            climbed.add(candidate.structure)
            orders_climbed.add(order)
            used += 1
            _local_search(search, candidate, rng)
    # 4. iterated local search: perturb the best structure by a few random moves, climb again;
    #    stop after `patience` rounds without a better plan (or when the budget is spent)
    _iterated_local_search(search, rng, patience)
    # 5. order moves on the best plan: W into gaps, F earlier
    if search.best is not None and not search.exhausted():
        _order_moves(search, search.best)
    if search.try_recompute:
        # the search without recomputation too, exactly as recompute=False runs it, in the time
        # left: the better plan wins, so allowing recomputation never returns a slower plan than
        # forbidding it (unless the time limit cuts that search short)
        _add_plain_search(search, costs, cluster, num_microbatches, p, effort, activation_budget, memory_limit_bytes,
                          memory, seed, start_plans, patience, start_sims)
    if activation_budget is not None:
        _add_deeper_search(search, list(unique.items()), effort, seed)
    fewer_devices = message_share(costs, cluster) >= FEWER_DEVICES_SHARE
    if fewer_devices:
        _add_fewer_devices_search(search, effort, seed)
    # the runner-up search starts from where recompute=False's search stands now: the searches
    # that only recompute=True runs (below) must not move its start, or allowing recomputation
    # could end slower than forbidding it (a fuzz found 0.2% and 2.3%)
    runner_up = _runner_up_start(search)
    if fewer_devices and search.recompute:  # (a pipeline on fewer devices holds more layers' activations per device)
        _add_fewer_devices_search(search, effort, seed, recompute=True)
    if search.recompute and not search.try_recompute:
        _repair_by_recomputation(search, effort, rng)
    _add_runner_up_search(search, runner_up, effort, seed, patience)  # last: nothing above depends on it
    if search.best is None:
        raise PlanError("the tuner found no plan that fits the memory limits")
    winner = plan_shape(search.best.structure)
    others = sorted((c for shape, c in search.best_of_shape.items() if shape != winner), key=lambda c: c.iteration_ms)
    return TuneResult(search.best, search.history, search.evaluations, search.work + search.work_beside, search.cut_short,
                      time.perf_counter() - started, len(unique), tuple(others), search.ruled_out, search.plain_best)


def _iterated_local_search(search: _Search, rng: random.Random, patience: int) -> None:
    """Perturb the search's best structure by a few random moves and climb again; stop after
    `patience` rounds in a row without a better plan (or when the budget is spent)."""
    stale = 0
    while search.best is not None and stale < patience and not search.exhausted():
        before = search.best.iteration_ms
        structure = search.best.structure
        for _ in range(rng.randint(2, 4)):
            moves = _structure_moves(structure, structure.device_loads(search.costs))
            if not moves:
                break
            structure = moves[rng.randrange(len(moves))][0]
        candidate = search.best_policy(structure, f"{search.best.origin}; perturbed", SCREEN_POLICIES[:3])
        if candidate is not None:
            _local_search(search, candidate, rng)
        stale = stale + 1 if search.best.iteration_ms >= before - 1e-9 else 0


def _runner_up_start(search: _Search) -> Candidate | None:
    """The fastest plan of another shape (`plan_shape`) than the best's. Where the search did not
    try recomputation, only plans that do not recompute (the baselines recomputing everywhere,
    evaluated to decide that, are not in recompute=False's search)."""
    best = search.best
    if best is None:
        return None
    winner = plan_shape(best.structure)
    others = [c for shape, c in search.best_of_shape.items()
              if shape != winner and (search.try_recompute or not c.structure.recomputing)]
    return min(others, key=lambda c: (c.iteration_ms, c.origin)) if others else None


def _add_runner_up_search(search: _Search, start: Candidate | None, effort: float, seed: int, patience: int) -> None:
    """The iterated local search again from `start`, the fastest plan of another shape
    (`_runner_up_start`), as a search of its own (its own memo, RUNNER_UP_WORK_SHARE of the work
    budget) whose best plan and runners-up are taken in where faster, so it never makes a plan
    slower. The main search perturbs only its best plan, so it settles in the basin of whichever
    start climbed furthest first: on a random table on 2 devices at 1.25x its 1F1B activation
    limit this finds a plan 2.5% faster. Run after every other search, so none of them changes
    course because of it."""
    if start is None:
        return
    other = _beside(search, effort * RUNNER_UP_WORK_SHARE, "runner-up")
    begun = other.evaluate(start.plan, f"{start.origin} (runner-up shape)", start.structure, start.policy)
    if begun is not None and begun.feasible:
        rng = random.Random(seed)
        _local_search(other, begun, rng)
        _iterated_local_search(other, rng, patience)
        if other.best is not None and not other.exhausted():
            _order_moves(other, other.best)
    _take_in_beside(search, other)


def _add_plain_search(search: _Search, costs: CostTable, cluster: ClusterSpec, num_microbatches: int,
                      num_devices: int, effort: float, activation_budget: Sequence[float] | None,
                      memory_limit_bytes: float | None, memory: MemoryModel, seed: int,
                      start_plans: dict[str, PipelinePlan] | None, patience: int,
                      start_sims: dict[str, SimResult] | None) -> None:
    """Run the search without recomputation (its own full work budget, until `search`'s deadline)
    and take in its best plan (where it is faster), runners-up and work; nothing when no plan fits
    without recomputation."""
    began = time.perf_counter()
    try:
        plain = tune(costs, cluster, num_microbatches, num_devices=num_devices,
                     time_limit_s=max(0.0, search.deadline - began), effort=effort,
                     activation_budget=activation_budget, memory_limit_bytes=memory_limit_bytes, memory=memory,
                     seed=seed, start_plans=start_plans, patience=patience, recompute=False, start_sims=start_sims,
                     progress=(lambda line: search.progress(f"without recomputation: {line}")) if search.progress else None)
    except PlanError:
        return
    _take_in(search, plain.evaluations, plain.ruled_out, plain.work, plain.cut_short, (plain.best, *plain.runners_up))
    best = plain.best
    search.plain_best = best
    search.evaluate(best.plan, f"{best.origin} (without recomputation)", best.structure, best.policy)


def _take_in(search: _Search, evaluations: int, ruled_out: int, work: int, cut_short: bool,
             candidates: Iterable[Candidate]) -> None:
    """Count a search run beside `search` into it, and keep its plans as runners-up where they
    are the fastest of their shape (its best plan is the caller's to take in)."""
    search.evaluations += evaluations
    search.ruled_out += ruled_out
    search.work_beside += work
    search.cut_short |= cut_short
    for candidate in candidates:
        search.keep_if_best_of_shape(candidate)


def _beside(search: _Search, work_share: float, label: str) -> _Search:
    """A search of its own beside `search` (its own memo; `work_share` x DEFAULT_WORK of work, the
    same limits, deadline and recomputation), its progress lines marked `label`."""
    beside = _Search(search.costs, search.cluster, search.m, search.p, search.activation_budget, search.memory_limit,
                     search.memory, int(DEFAULT_WORK * work_share), search.deadline,
                     (lambda line: search.progress(f"{label}: {line}")) if search.progress else None,
                     search.started, search.recompute)
    beside.try_recompute = search.try_recompute
    return beside


def _take_in_beside(search: _Search, beside: _Search, runners_up: bool = True) -> None:
    """Count `beside` into `search` (`_take_in`: its work and, with `runners_up`, its runners-up)
    and take its best plan in where faster. Where that plan recomputes and `search` did not try
    recomputation, `search`'s best so far stays `plain_best` (CP-SAT refines it too), so allowing
    recomputation never makes a plan slower."""
    _take_in(search, beside.evaluations, beside.ruled_out, beside.work, beside.cut_short,
             beside.best_of_shape.values() if runners_up else ())
    best = beside.best
    if best is None or (search.best is not None and best.iteration_ms >= search.best.iteration_ms - 1e-9):
        return
    if best.structure.recomputing and not search.try_recompute and search.plain_best is None:
        search.plain_best = search.best  # the best without recomputation, refined beside it
    search.evaluate(best.plan, best.origin, best.structure, best.policy)


def _add_deeper_search(search: _Search, structures: Sequence[tuple[Structure, str]], effort: float, seed: int) -> None:
    """Every structure again with more microbatches in flight than its round trips ask for
    (`DEEPER_POLICIES`), a climb from the fastest that fits and order moves on its best, as a
    search of its own (its own memo, DEEPER_WORK_SHARE of the work budget): its best plan and
    runners-up are taken in where faster, so the main search's course is unchanged and more effort
    never returns a slower plan. Where a device holds stages with long round trips (the early
    stages of a V placement) the round-trip caps leave its activation budget unused while it idles:
    DeepSeek's analytic table on 16 devices x 32 microbatches, 477 -> 452 ms."""
    deeper = _beside(search, effort * DEEPER_WORK_SHARE, "deeper in flight")
    start: Candidate | None = None
    for structure, label in structures:
        if deeper.exhausted():
            break
        candidate = deeper.best_policy(structure, f"{label}, deeper in flight", DEEPER_POLICIES)
        if candidate is not None and candidate.feasible and (start is None or candidate.score < start.score):
            start = candidate
    if start is not None:
        _local_search(deeper, start, random.Random(seed))
    if deeper.best is not None and not deeper.exhausted():
        _order_moves(deeper, deeper.best)
    _take_in_beside(search, deeper)


def _add_fewer_devices_search(search: _Search, effort: float, seed: int, recompute: bool = False) -> None:
    """Pipelines on fewer devices (`fewer_device_structures`), screened, the best two with every
    policy and a climb from each, then order moves on the best: a search of its own beside the
    main one (its own memo, FEWER_WORK_SHARE of the work budget), whose best plan and runners-up
    are taken in where faster, so the main search's course is unchanged and it never makes a plan
    slower. The moves between structures keep the number of devices a plan uses, so without
    these starts a search from the baselines found such a plan at some limits and not at others.
    `recompute`: the structures also with every stage recomputing, and the recomputation moves on
    (a device holding more layers holds more activations); run after the search without, where
    stages may recompute, so that allowing it never makes a plan slower."""
    fewer = _beside(search, effort * FEWER_WORK_SHARE, "fewer devices")
    fewer.try_recompute |= recompute
    rng = random.Random(seed)
    structures = fewer_device_structures(search.costs, search.p)
    if recompute:
        structures = [(again, f"{label}, {how}") for structure, label in structures
                      for again, how in _recomputing_structures(structure, fewer.selective)] + structures
    screened = []
    for index, (structure, label) in enumerate(structures):
        if fewer.exhausted():
            break
        candidate = fewer.best_policy(structure, label, SCREEN_POLICIES)
        if candidate is not None:
            screened.append((candidate.score, index, structure, label))
    for _, _, structure, label in sorted(screened)[:2]:
        if fewer.exhausted():
            break
        candidate = fewer.best_policy(structure, label, POLICIES)
        if candidate is not None:
            _local_search(fewer, candidate, rng)
    if fewer.best is not None and not fewer.exhausted():
        _order_moves(fewer, fewer.best)
    _take_in_beside(search, fewer)


def _repair_by_recomputation(search: _Search, effort: float, rng: random.Random) -> None:
    """Where recomputation was not worth the search's work (no baseline recomputing beat the
    starts that fit), the search ran as recompute=False runs it. Recomputation can still pay on a
    structure the baselines do not have: a partition whose heavy stage fits only recomputing, or
    one that keeps more microbatches in flight on a device whose activations fill its budget.
    A search beside the main one (a copy of its memo, REPAIR_WORK_SHARE of the work budget) climbs
    with the recomputation moves on from the fastest plan of each of the REPAIRS fastest shapes
    (a plan the list scheduler held back to fit need not fill its budget, so none is left out),
    and from the REPAIRS fastest structures the search scheduled that are over the limit but
    faster than its best (each with the recomputation moves of its device over budget, the climb
    from the one nearest to fitting). Its best plan is taken in where faster, and nothing else:
    a plan that recomputes where it need not is no runner-up worth measuring. The plan without
    recomputation stays `plain_best`, so recomputation still never makes a plan slower. Without
    it a looser limit could plan slower than a tighter one: at the tighter limit nothing fit
    without recomputation, so the search turned it on and found a plan that fits both (3 layers
    on 3 devices whose 64 MB messages cross a 1 GB/s link: 339 ms at the 1F1B limit, 114 ms at
    0.8 of it)."""
    best = search.best
    if best is None or search.exhausted() and search.cut_short:
        return
    fastest: dict[Structure, Candidate] = {}
    for candidate in search.scheduled.values():
        if candidate is None or candidate.feasible or candidate.iteration_ms >= best.iteration_ms - 1e-9:
            continue
        known = fastest.get(candidate.structure)
        if known is None or candidate.iteration_ms < known.iteration_ms:
            fastest[candidate.structure] = candidate
    shapes = sorted(search.best_of_shape.values(), key=lambda c: (c.iteration_ms, c.origin))[:REPAIRS]
    repair = _beside(search, effort * REPAIR_WORK_SHARE, "recomputation")
    repair.try_recompute = True
    repair.scheduled = dict(search.scheduled)  # what the search scheduled: its policies, at no new work
    repair.best = best
    repaired: Candidate | None = None
    for candidate in sorted(fastest.values(), key=lambda c: (c.iteration_ms, c.origin))[:REPAIRS]:
        policies = search.top_policies(candidate.structure, 3)
        for structure, label in _recompute_moves(candidate, search.budget_for(candidate.structure), search.selective):
            if repair.exhausted():
                break
            found = repair.best_policy(structure, f"{candidate.origin}; {label}", policies)
            if (found is not None and found.iteration_ms < best.iteration_ms - 1e-9
                    and (repaired is None or found.score < repaired.score)):
                repaired = found
    for start in ([repaired] if repaired is not None else []) + shapes:
        if repair.exhausted():
            break
        _local_search(repair, start, rng)
    _take_in_beside(search, repair, runners_up=False)


def _local_search(search: _Search, start: Candidate, rng: random.Random) -> Candidate:
    """Hill-climb on (memory overshoot, iteration time): structure moves re-ordered by the list
    scheduler with the structure's best policies, boundary moves under the current order, policy
    neighbours. Only strict improvements are kept; at a local optimum, a climb from a plan that
    recomputes less at the same time (`Structure.recomputed` falls) is kept where it finds the
    search's best plan.
    Moves are tried in a seeded random order."""
    current = start
    while not search.exhausted():
        moves = _structure_moves(current.structure, current.structure.device_loads(search.costs))
        rng.shuffle(moves)
        policies = search.top_policies(current.structure, 3) or [SCREEN_POLICIES[0], SCREEN_POLICIES[2]]
        found = None
        for structure, label, keeps_order in moves:
            if search.exhausted():
                break
            if search.rules_out(structure, current):
                continue
            if keeps_order and current.policy is None:
                plan = PipelinePlan(current.plan.num_devices, current.plan.num_microbatches, structure.stages(),
                                    current.plan.device_ops)
                candidate = search.evaluate(plan, f"{current.origin}; {label}", structure, None)
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
            for policy in policies:
                candidate = search.schedule(structure, policy, f"{current.origin}; {label}")
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
            if found:
                break
        if found is None and current.policy is not None:
            for policy in _policy_neighbours(current.policy):
                if search.exhausted():
                    break
                candidate = search.schedule(current.structure, policy, f"{current.origin}; policy")
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
        if found is None and (search.try_recompute or current.structure.recompute or current.structure.selective):
            # at a local optimum: recomputation off, or on where memory binds
            budget = search.budget_for(current.structure) if search.try_recompute else None
            level = None  # less recomputation at no cost in time
            for structure, label in _recompute_moves(current, budget, search.selective):
                if search.exhausted():
                    break
                if search.rules_out(structure, current):
                    continue
                candidate = search.best_policy(structure, f"{current.origin}; {label}", policies)
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
                if (level is None and candidate is not None and candidate.score <= current.score
                        and candidate.structure.recomputed < current.structure.recomputed):
                    level = candidate
            if found is None and level is not None and not search.exhausted():
                # a stage that recomputes where memory no longer binds can hold back the boundary
                # move that would use its room: climb from the plan without it, and keep where
                # that ends only if it is the search's best; else this climb ends as it would
                # have, its random order and work budget as they were (the look's work is counted
                # beside). (Kept where it ended faster than this climb only, a look that ended
                # short of the best still changed the rest of the search, which on gpt-oss-20B
                # 8x16 at 0.3 x the 1F1B limit ended 2.7% slower.)
                state, spent, best = rng.getstate(), search.work, search.best
                end = _local_search(search, level, rng)
                if end.score < current.score and search.best is not best:
                    found = end
                else:
                    rng.setstate(state)
                    search.work_beside += search.work - spent
                    search.work = spent
        if found is None:
            return current
        current = found
    return current


def _structure_moves(structure: Structure, loads: Sequence[float] | None = None) -> list[tuple[Structure, str, bool]]:
    """(new structure, label, whether the old op order stays valid) for every neighbour: each
    boundary moved by one or two layers; two stages of one lap (p consecutive stages) swapping
    devices (the flow stays regular: a microbatch still visits every device once per lap); with
    the devices' `loads`, a stage of the busiest device moved to a light one."""
    moves = []
    bounds = list(structure.boundaries)
    p = structure.num_devices
    for i in range(1, len(bounds) - 1):
        for delta in (-1, 1, -2, 2):
            new = bounds[i] + delta
            if bounds[i - 1] < new < bounds[i + 1]:
                moved = list(bounds)
                moved[i] = new
                moves.append((replace(structure, boundaries=tuple(moved)), f"boundary {i} {delta:+d}", True))
    placement = structure.placement
    for s in range(structure.num_stages):
        for t in range(s + 1, min(structure.num_stages, (s // p + 1) * p)):
            if placement[s] != placement[t]:
                swapped = list(placement)
                swapped[s], swapped[t] = swapped[t], swapped[s]
                moves.append((replace(structure, placement=tuple(swapped)), f"swap stages {s},{t}", False))
    if loads is not None:
        # a stage of the busiest device to one of the two lightest (devices then hold different
        # numbers of stages: what a heavy layer, like a big-vocabulary head, needs)
        order = sorted(range(p), key=lambda d: (loads[d], d))
        busiest = order[-1]
        for s in range(structure.num_stages):
            if placement[s] != busiest:
                continue
            for target in order[:2]:
                neighbours = {placement[t] for t in (s - 1, s + 1) if 0 <= t < structure.num_stages}
                if target == busiest or target in neighbours:
                    continue
                moved = list(placement)
                moved[s] = target
                moves.append((replace(structure, placement=tuple(moved)), f"stage {s} to device {target}", False))
    return moves


def _recomputing(plan: PipelinePlan, selective: bool) -> list[tuple[PipelinePlan, str]]:
    """`plan` with every stage recomputing its activations, and (where the costs know it,
    `selective`) with every stage recomputing selectively: what a baseline's users turn on when
    memory runs out."""
    n = plan.num_stages
    plans = [(plan.with_recompute([True] * n), "recompute every stage")]
    if selective:
        plans.append((plan.with_recompute([False] * n, [True] * n), "selective recomputation every stage"))
    return plans


def _recomputing_structures(structure: Structure, selective: bool) -> list[tuple[Structure, str]]:
    """`structure` so (see `_recomputing`)."""
    n = structure.num_stages
    structures = [(structure.with_recompute([True] * n), "recompute every stage")]
    if selective:
        structures.append((structure.with_selective([True] * n), "selective recomputation every stage"))
    return structures


def _recompute_moves(candidate: Candidate, budget: Sequence[float] | None,
                     selective: bool = False) -> list[tuple[Structure, str]]:
    """Activation recomputation toggled: off for each stage that recomputes (fully or
    selectively); under a memory limit, on for each stage of the device whose activations fill
    most of its budget, and for all of them at once (recomputation only adds time: it pays where
    memory holds microbatches back). With `selective` (the costs know what it holds and costs),
    the same with selective recomputation, and a fully recomputing stage made selective."""
    structure = candidate.structure
    flags = list(structure.recompute or (False,) * structure.num_stages)
    cheap = list(structure.selective or (False,) * structure.num_stages)
    moves = []
    for s in range(structure.num_stages):
        if flags[s]:
            moves.append((structure.with_recompute(flags[:s] + [False] + flags[s + 1:]), f"no recompute stage {s}"))
            if selective:
                moves.append((structure.with_selective(cheap[:s] + [True] + cheap[s + 1:]), f"selective stage {s}"))
        if cheap[s]:
            moves.append((structure.with_selective(cheap[:s] + [False] + cheap[s + 1:]), f"no selective stage {s}"))
    if budget is not None:
        device = max(range(structure.num_devices),
                     key=lambda d: (candidate.peak_activation[d] / max(budget[d], 1e-9), -d))
        stages = [s for s in range(structure.num_stages) if structure.placement[s] == device and not flags[s]]
        for s in stages:
            moves.append((structure.with_recompute(flags[:s] + [True] + flags[s + 1:]), f"recompute stage {s}"))
            if selective and not cheap[s]:
                moves.append((structure.with_selective(cheap[:s] + [True] + cheap[s + 1:]), f"selective stage {s}"))
        if len(stages) > 1:
            every = [flag or s in stages for s, flag in enumerate(flags)]
            moves.append((structure.with_recompute(every), f"recompute device {device}"))
            if selective:
                every = [flag or s in stages for s, flag in enumerate(cheap)]
                moves.append((structure.with_selective(every), f"selective device {device}"))
        if not all(flags):
            moves.append((structure.with_recompute([True] * structure.num_stages), "recompute every stage"))
        if selective and not all(cheap):
            moves.append((structure.with_selective([True] * structure.num_stages), "selective every stage"))
    return moves


def _order_moves(search: _Search, start: Candidate, max_rounds: int = 200) -> None:
    """Fill the largest idle gaps of the best plan: move a later op of that device (a W, or an F)
    into the gap, re-simulate, keep strict improvements."""
    current = start
    for _ in range(max_rounds):
        if search.exhausted():
            return
        result = simulate(current.plan, search.costs, search.cluster, memory=search.memory, validated=True)
        gaps = []
        for device, ops in enumerate(current.plan.device_ops):
            for index in range(1, len(ops)):
                gap = result.op_start[ops[index]] - result.op_end[ops[index - 1]]
                if gap > 1e-9:
                    gaps.append((gap, device, index))
        gaps.sort(key=lambda g: (-g[0], g[1], g[2]))
        improved = False
        for _, device, index in gaps[:8]:
            ops = list(current.plan.device_ops[device])
            gap_end = result.op_start[ops[index]]
            for later in range(index + 1, min(len(ops), index + 24)):
                op = ops[later]
                if op.kind is OpKind.B:
                    continue
                if op.kind is OpKind.W and result.op_end[Op(op.stage, _B, op.microbatch)] > gap_end:
                    continue
                moved = ops[:index] + [op] + ops[index:later] + ops[later + 1:]
                device_ops = list(current.plan.device_ops)
                device_ops[device] = tuple(moved)
                candidate = search.evaluate(current.plan.with_ops(device_ops), f"{current.origin}; fill gap",
                                            current.structure, current.policy)
                if search.exhausted():
                    return
                if candidate is not None and candidate.score < current.score:
                    current = candidate
                    improved = True
                    break
            if improved:
                break
        if not improved:
            return
