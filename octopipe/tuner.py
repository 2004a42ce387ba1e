"""Iterative bubble-aware tuner: joint search over partition, placement and op order.

Consumes a CostTable, a ClusterSpec and a microbatch count; produces the best PipelinePlan it
finds (simulated by `octopipe.simulator`, the shared contract) and a log of what it tried.

Glossary: a *structure* is a partition (stage layer ranges) plus a placement (stage -> device);
an *order* is each device's op sequence. The tuner

1. builds candidate structures: every baseline's, and load-balanced ones with p, 2p, 3p, ... stages
   in looped, V-shaped and free placements (partition boundaries chosen so the busiest device's
   per-microbatch load is as small as whole layers allow);
2. orders each structure with a bubble-aware list scheduler (below) under the memory limit,
   trying a few scheduling policies;
3. improves the best by local moves aimed at the bubbles the simulator reports: a layer across a
   stage boundary when device loads are unbalanced, a stage to another device (placement) and a
   different stage count when warm-up/cool-down bubbles dominate, and scheduling-policy changes
   (warm-up depth, when W runs) when residual bubbles dominate. Only strict improvements that fit
   the memory limit are kept; it stops at convergence or `time_limit_s`.

The list scheduler replays the simulator's timing rules event by event: whenever a device is free
it runs the best op that is ready — an input-gradient B first (it is on the critical path and frees
memory), then a forward if the stage's in-flight microbatches and the device's activation budget
allow, then a pending W (weight gradients fill gaps; they also run first when the budget is
full). Each stage keeps at most `cap` microbatches in flight, `cap` from the time a microbatch needs
to come back (its round trip) over the device's per-microbatch load, like 1F1B's p - i.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from octopipe.cluster import ClusterSpec
from octopipe.errors import PlanError
from octopipe.ir.costs import CostTable
from octopipe.ir.plan import Op, OpKind, PipelinePlan, Stage
from octopipe.simulator import MemoryModel, SimResult, iteration_time, simulate

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


@dataclass(frozen=True, slots=True)
class Structure:
    """Partition (layer boundaries [0, b1, ..., L]) and placement (stage -> device)."""

    boundaries: tuple[int, ...]
    placement: tuple[int, ...]
    num_devices: int

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stage_loads(self, costs: CostTable) -> list[float]:
        return [costs.range_sum("forward", a, b) + costs.range_sum("backward_full", a, b)
                for a, b in zip(self.boundaries[:-1], self.boundaries[1:])]

    def device_loads(self, costs: CostTable) -> list[float]:
        loads = [0.0] * self.num_devices
        for stage, load in enumerate(self.stage_loads(costs)):
            loads[self.placement[stage]] += load
        return loads

    @classmethod
    def of(cls, plan: PipelinePlan) -> Structure:
        return cls(plan.boundaries, plan.placement, plan.num_devices)


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of the list scheduler."""

    split_backward: bool = True
    """Run B as input gradient only and W separately (zero-bubble style)."""
    depth_first: bool = True
    """Among ready forwards prefer the deepest stage (microbatches reach the end sooner)."""
    inflight_slack: int = 0
    """Microbatches in flight per stage beyond the round-trip estimate (can be negative)."""
    max_pending_w: int = 1 << 30
    """Per stage, W ops allowed to wait; at the limit the oldest W runs before new forwards."""
    roundtrip_caps: bool = True
    """Cap each stage's in-flight microbatches by its round trip; else only memory limits them."""
    reserve: int = 1
    """Microbatches of activation memory a forward must leave free for each deeper stage on the
    same device (without it the first stage can fill the budget and starve the later ones)."""


def _stage_arrays(structure: Structure, costs: CostTable, split: bool):
    pairs = list(zip(structure.boundaries[:-1], structure.boundaries[1:]))
    forward = [costs.range_sum("forward", a, b) for a, b in pairs]
    full = [costs.range_sum("backward_full", a, b) for a, b in pairs]
    weight = [costs.range_sum("weight", a, b) for a, b in pairs] if split else [0.0] * len(pairs)
    backward = [costs.range_sum("backward_input", a, b) for a, b in pairs] if split else full
    activation = [costs.range_sum("activation", a, b) for a, b in pairs]
    output = [costs.output[b - 1] for _, b in pairs]
    return forward, backward, weight, activation, output


def inflight_caps(structure: Structure, costs: CostTable, cluster: ClusterSpec, num_microbatches: int,
                  policy: Policy, activation_budget: Sequence[float] | None, memory: MemoryModel) -> list[int]:
    """Microbatches each stage may hold between its F and its B."""
    forward, backward, weight, activation, output = _stage_arrays(structure, costs, policy.split_backward)
    num_stages = structure.num_stages
    placement = structure.placement
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
        if policy.roundtrip_caps:
            caps.append(max(1, min(num_microbatches, math.ceil(trip / cycle - 1e-9) + policy.inflight_slack)))
        else:
            caps.append(num_microbatches)
    if activation_budget is not None and policy.roundtrip_caps:
        for device in range(structure.num_devices):
            stages = [s for s in range(num_stages) if placement[s] == device]
            while sum(caps[s] * activation[s] for s in stages) > activation_budget[device] + 1e-6:
                reducible = [s for s in stages if caps[s] > 1]
                if not reducible:
                    break
                s = max(reducible, key=lambda s: (caps[s] * activation[s], -s))
                caps[s] -= 1
    return caps


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
    stage fits it."""
    forward, backward, weight, activation, output = _stage_arrays(structure, costs, policy.split_backward)
    num_stages, num_devices, m = structure.num_stages, structure.num_devices, num_microbatches
    placement = structure.placement
    caps = inflight_caps(structure, costs, cluster, m, policy, activation_budget, memory)
    keep = memory.weight_memory_fraction if policy.split_backward else 0.0
    budget = list(activation_budget) if activation_budget is not None else [math.inf] * num_devices
    stages_of = [[s for s in range(num_stages) if placement[s] == d] for d in range(num_devices)]
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
    link_free: dict[tuple[int, int], float] = {}
    orders: list[list[Op]] = [[] for _ in range(num_devices)]
    remaining = [len(stages_of[d]) * m * (3 if policy.split_backward else 2) for d in range(num_devices)]
    bandwidth = {}
    latency_ms = cluster.latency_s * 1e3

    def send(src: int, dst: int, finish: float, size: float) -> float:
        if src == dst:
            return finish
        link = (src, dst)
        bw = bandwidth.get(link)
        if bw is None:
            bw = bandwidth[link] = cluster.bandwidth(src, dst) / 1e3
        begin = max(finish, link_free.get(link, 0.0))
        arrive = begin + latency_ms + size / bw
        link_free[link] = arrive
        return arrive

    active = set(d for d in range(num_devices) if remaining[d])
    blocked: set[int] = set()  # devices that found nothing to run at their clock since the last op
    while active:
        device = min(active - blocked, key=lambda d: (clock[d], d), default=-1)
        if device < 0:
            stuck = min(active)
            raise PlanError(
                f"list scheduler stalled: no device can run an op (device {stuck} at {clock[stuck]:.3f} ms; "
                f"in-flight caps {caps}, activation budget {budget[stuck]:.4g} bytes); raise the memory limit or "
                "use more stages"
            )
        now = clock[device]
        best = None  # (rank tuple, kind, stage, ready)
        earliest = math.inf
        for s in stages_of[device]:
            # B: oldest microbatch whose F is done and whose gradient has arrived
            mb = next_b[s]
            if mb < next_f[s]:
                ready = g_arrival[s][mb] if s < num_stages - 1 else f_end[s][mb]
                if ready >= 0:
                    if ready <= now:
                        rank = (0, mb, -s)
                        if best is None or rank < best[0]:
                            best = (rank, _B, s, ready)
                    elif ready < earliest:
                        earliest = ready
            # W: weight gradients fill gaps; urgent when too many wait
            mb = next_w[s]
            if policy.split_backward and mb < next_b[s]:
                ready = b_end[s][mb]
                urgent = next_b[s] - mb > policy.max_pending_w
                if ready <= now:
                    rank = (1 if urgent else 3, mb, -s)
                    if best is None or rank < best[0]:
                        best = (rank, _W, s, ready)
                elif ready < earliest:
                    earliest = ready
            # F: within the stage's in-flight cap and the device's activation budget
            mb = next_f[s]
            if mb < m and mb - next_b[s] < caps[s]:
                ready = f_arrival[s][mb]
                if ready >= 0:
                    need = live[device] + activation[s]
                    if policy.reserve:
                        for t in stages_of[device]:
                            if t > s and next_f[t] < m:
                                held = next_f[t] - next_w[t] if policy.split_backward else next_f[t] - next_b[t]
                                if held < policy.reserve:
                                    need += activation[t] * (policy.reserve - held)
                    fits = need <= budget[device] + 1e-6 or live[device] <= 1e-9
                    if ready <= now:
                        if fits:
                            rank = (2, 0, -s) if policy.depth_first else (2, mb, s)
                            if best is None or rank < best[0]:
                                best = (rank, _F, s, ready)
                    elif ready < earliest:
                        earliest = ready
        if best is None:
            later = [clock[d] for d in active if d != device and clock[d] > now]
            wake = min([earliest, *later], default=math.inf)
            if wake == math.inf:
                blocked.add(device)
            else:
                clock[device] = wake
            continue
        blocked.clear()
        _, kind, s, ready = best
        start = max(now, ready)
        if kind is _F:
            mb = next_f[s]
            finish = start + forward[s]
            next_f[s] += 1
            f_end[s][mb] = finish
            live[device] += activation[s]
            if s + 1 < num_stages:
                f_arrival[s + 1][mb] = send(device, placement[s + 1], finish, output[s])
        elif kind is _B:
            mb = next_b[s]
            finish = start + backward[s]
            next_b[s] += 1
            b_end[s][mb] = finish
            live[device] -= activation[s] * (1.0 - keep)
            if s > 0:
                g_arrival[s - 1][mb] = send(device, placement[s - 1], finish, output[s - 1])
        else:
            mb = next_w[s]
            finish = start + weight[s]
            next_w[s] += 1
            live[device] -= activation[s] * keep
        orders[device].append(Op(s, kind, mb))
        clock[device] = finish
        remaining[device] -= 1
        if not remaining[device]:
            active.discard(device)
    stages = tuple(Stage(i, a, b, placement[i]) for i, (a, b) in
                   enumerate(zip(structure.boundaries[:-1], structure.boundaries[1:])))
    return PipelinePlan(num_devices, m, stages, tuple(tuple(ops) for ops in orders))


# -- search ------------------------------------------------------------------------------------

POLICIES: tuple[Policy, ...] = tuple(
    Policy(split_backward=split, depth_first=depth, inflight_slack=slack, max_pending_w=pending)
    for split in (True, False)
    for depth in (True, False)
    for slack in (0, 1, 2, 3)
    for pending in ((1 << 30, 2) if split else (1 << 30,))
)


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
    cut_short: bool = False
    seconds: float = 0.0


class _Search:
    """Shared state of one tuning run: evaluation with memoisation, the best feasible plan."""

    def __init__(self, costs: CostTable, cluster: ClusterSpec, num_microbatches: int, num_devices: int,
                 activation_budget: Sequence[float] | None, memory_limit_bytes: float | None, memory: MemoryModel,
                 deadline: float, progress: Callable[[str], None] | None, started: float) -> None:
        self.costs, self.cluster, self.m, self.p = costs, cluster, num_microbatches, num_devices
        self.activation_budget = list(activation_budget) if activation_budget is not None else None
        self.memory_limit = memory_limit_bytes
        self.memory = memory
        self.deadline = deadline
        self.progress = progress
        self.started = started
        self.evaluations = 0
        self.best: Candidate | None = None
        self.history: list[tuple[float, float, str]] = []
        self.scheduled: dict[tuple[Structure, Policy], Candidate | None] = {}

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def budget_for(self, structure: Structure) -> list[float] | None:
        """Per-device activation budget: the explicit one, and what the memory limit leaves after
        weights, gradients and optimizer state."""
        budget = list(self.activation_budget) if self.activation_budget is not None else None
        if self.memory_limit is not None:
            static = [0.0] * self.p
            for s, (a, b) in enumerate(zip(structure.boundaries[:-1], structure.boundaries[1:])):
                static[structure.placement[s]] += self.costs.range_sum("params", a, b) * self.memory.state_bytes_per_param_byte
            room = [self.memory_limit - x for x in static]
            budget = room if budget is None else [min(a, b) for a, b in zip(budget, room)]
        return budget

    def overshoot(self, peak_activation: Sequence[float], peak_memory: Sequence[float]) -> float:
        worst = 0.0
        if self.activation_budget is not None:
            for need, have in zip(peak_activation, self.activation_budget):
                if need > have + 1e-6:
                    worst = max(worst, need / max(have, 1e-9) - 1)
        if self.memory_limit is not None:
            worst = max(worst, max(peak_memory) / self.memory_limit - 1 if max(peak_memory) > self.memory_limit + 1e-6 else 0.0)
        return worst

    def evaluate(self, plan: PipelinePlan, origin: str, structure: Structure, policy: Policy | None) -> Candidate | None:
        self.evaluations += 1
        try:
            ms, peak_memory, peak_activation = _fast_eval(plan, self.costs, self.cluster, self.memory)
        except PlanError:
            return None
        candidate = Candidate(plan, ms, peak_activation, peak_memory, self.overshoot(peak_activation, peak_memory),
                              origin, structure, policy)
        if candidate.feasible and (self.best is None or candidate.iteration_ms < self.best.iteration_ms - 1e-9):
            self.best = candidate
            elapsed = time.perf_counter() - self.started
            self.history.append((elapsed, candidate.iteration_ms, origin))
            if self.progress:
                self.progress(f"[{elapsed:6.1f}s] {candidate.iteration_ms:10.3f} ms  {origin}")
        return candidate

    def schedule(self, structure: Structure, policy: Policy, origin: str) -> Candidate | None:
        key = (structure, policy)
        if key in self.scheduled:
            return self.scheduled[key]
        try:
            plan = list_schedule(structure, self.costs, self.cluster, self.m, policy, self.budget_for(structure),
                                 self.memory)
            candidate = self.evaluate(plan, origin, structure, policy)
        except PlanError:
            candidate = None
        self.scheduled[key] = candidate
        return candidate

    def best_policy(self, structure: Structure, origin: str, policies: Sequence[Policy] = ()) -> Candidate | None:
        best = None
        for policy in policies or POLICIES:
            if self.out_of_time():
                break
            candidate = self.schedule(structure, policy, origin)
            if candidate is not None and (best is None or candidate.score < best.score):
                best = candidate
        return best


def _fast_eval(plan: PipelinePlan, costs: CostTable, cluster: ClusterSpec, memory: MemoryModel):
    result = simulate(plan, costs, cluster, memory=memory)
    return result.iteration_ms, result.peak_memory_bytes, result.peak_activation_bytes


POLICIES: tuple[Policy, ...] = tuple(
    Policy(split_backward=split, depth_first=depth, inflight_slack=slack, max_pending_w=pending,
           roundtrip_caps=caps, reserve=reserve)
    for split in (True, False)
    for depth in (True, False)
    for caps, slack, reserve in ((True, 0, 0), (True, 1, 0), (True, 2, 0), (True, 3, 0), (False, 0, 0), (False, 0, 1))
    for pending in ((1 << 30, 2) if split else (1 << 30,))
)


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


def stage_counts(num_devices: int, num_layers: int) -> list[int]:
    counts = []
    for numerator in (2, 3, 4, 6, 8):  # p, 1.5p, 2p, 3p, 4p
        count = num_devices * numerator // 2
        if num_devices <= count <= num_layers and count not in counts:
            counts.append(count)
    if not counts:
        counts.append(min(num_devices, num_layers))
    return counts


def tune(
    costs: CostTable,
    cluster: ClusterSpec,
    num_microbatches: int,
    *,
    num_devices: int | None = None,
    time_limit_s: float = 30.0,
    activation_budget: Sequence[float] | None = None,
    memory_limit_bytes: float | None = None,
    memory: MemoryModel = MemoryModel(),
    seed: int = 0,
    start_plans: dict[str, PipelinePlan] | None = None,
    progress: Callable[[str], None] | None = None,
    structure_time_s: float = 1.0,
) -> TuneResult:
    """Search partition, placement and order; return the best plan that fits the memory limits.
    Deterministic for a given input and seed (the time limit can only cut the search shorter)."""
    from octopipe.solver import balanced_structure

    started = time.perf_counter()
    p = num_devices or cluster.num_devices
    search = _Search(costs, cluster, num_microbatches, p, activation_budget, memory_limit_bytes, memory,
                     started + time_limit_s, progress, started)
    rng = random.Random(seed)
    starts: list[Candidate] = []
    # 1. every baseline as given (its order is a good start even where it needs too much memory)
    structures: list[tuple[Structure, str]] = []
    for name, plan in sorted((start_plans or {}).items()):
        candidate = search.evaluate(plan, f"baseline {name}", Structure.of(plan), None)
        if candidate is not None:
            starts.append(candidate)
        structures.append((Structure.of(plan), f"{name} structure"))
    # 2. load-balanced structures: p, 1.5p, 2p, ... stages in looped, zigzag and free placements
    for count in stage_counts(p, len(costs)):
        for label, pattern in placements(p, count).items():
            if search.out_of_time():
                break
            found = balanced_structure(costs, p, count, pattern, time_limit_s=structure_time_s, seed=seed)
            if found:
                structures.append((Structure(found[0], found[1], p), f"balanced {count} stages {label}"))
        if count > p and not search.out_of_time():
            found = balanced_structure(costs, p, count, None, time_limit_s=structure_time_s, seed=seed)
            if found:
                structures.append((Structure(found[0], found[1], p), f"balanced {count} stages free placement"))
    unique: dict[Structure, str] = {}
    for structure, label in structures:
        unique.setdefault(structure, label)
    for structure, label in unique.items():
        if search.out_of_time():
            break
        candidate = search.best_policy(structure, label)
        if candidate is not None:
            starts.append(candidate)
    # 3. local moves from the most promising starts (feasible first, then the fastest repairs)
    starts.sort(key=lambda c: (not c.feasible, c.iteration_ms))
    for candidate in starts[:6]:
        if search.out_of_time():
            break
        _local_search(search, candidate, rng)
    # 4. order moves on the best plan: W into gaps, F earlier
    if search.best is not None and not search.out_of_time():
        _order_moves(search, search.best)
    if search.best is None:
        raise PlanError("the tuner found no plan that fits the memory limits")
    return TuneResult(search.best, search.history, search.evaluations, search.out_of_time(),
                      time.perf_counter() - started)


def _local_search(search: _Search, start: Candidate, rng: random.Random) -> Candidate:
    """Hill-climb on (memory overshoot, iteration time): boundary shifts that keep the op order,
    boundary shifts and stage swaps re-ordered by the list scheduler, policy neighbours. Only
    strict improvements are kept."""
    current = start
    while not search.out_of_time():
        moves = _structure_moves(current.structure, search.costs)
        rng.shuffle(moves)
        found = None
        for structure, label, keeps_order in moves:
            if search.out_of_time():
                break
            if keeps_order:
                plan = PipelinePlan(current.plan.num_devices, current.plan.num_microbatches,
                                    _stages(structure), current.plan.device_ops)
                candidate = search.evaluate(plan, f"{current.origin}; {label}", structure, None)
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
            for policy in _policy_neighbours(current.policy)[:2] if current.policy else (POLICIES[0], POLICIES[4]):
                candidate = search.schedule(structure, policy, f"{current.origin}; {label} + reorder")
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
            if found:
                break
        if found is None and current.policy is not None:
            for policy in _policy_neighbours(current.policy):
                candidate = search.schedule(current.structure, policy, f"{current.origin}; policy")
                if candidate is not None and candidate.score < current.score:
                    found = candidate
                    break
        if found is None:
            return current
        current = found
    return current


def _stages(structure: Structure) -> tuple[Stage, ...]:
    return tuple(Stage(i, a, b, structure.placement[i])
                 for i, (a, b) in enumerate(zip(structure.boundaries[:-1], structure.boundaries[1:])))


def _structure_moves(structure: Structure, costs: CostTable) -> list[tuple[Structure, str, bool]]:
    """(new structure, label, whether the old op order stays valid) for every neighbour."""
    moves = []
    bounds = list(structure.boundaries)
    for i in range(1, len(bounds) - 1):
        for delta in (-1, 1):
            new = bounds[i] + delta
            if bounds[i - 1] < new < bounds[i + 1]:
                moved = list(bounds)
                moved[i] = new
                moves.append((Structure(tuple(moved), structure.placement, structure.num_devices),
                              f"boundary {i} {'-' if delta < 0 else '+'}1", True))
    placement = structure.placement
    loads = structure.device_loads(costs)
    heavy = max(range(structure.num_devices), key=lambda d: loads[d])
    for s in range(structure.num_stages):
        if placement[s] != heavy:
            continue
        for t in range(structure.num_stages):
            if placement[t] == heavy:
                continue
            swapped = list(placement)
            swapped[s], swapped[t] = swapped[t], swapped[s]
            moves.append((Structure(structure.boundaries, tuple(swapped), structure.num_devices),
                          f"swap stages {s},{t}", False))
    return moves


def _policy_neighbours(policy: Policy | None) -> list[Policy]:
    if policy is None:
        return []
    neighbours = [
        replace(policy, inflight_slack=policy.inflight_slack + 1),
        replace(policy, roundtrip_caps=not policy.roundtrip_caps),
        replace(policy, inflight_slack=max(-2, policy.inflight_slack - 1)),
        replace(policy, reserve=1 - min(policy.reserve, 1)),
        replace(policy, depth_first=not policy.depth_first),
        replace(policy, split_backward=not policy.split_backward),
        replace(policy, max_pending_w=2 if policy.max_pending_w > 2 else 1 << 30),
        replace(policy, max_pending_w=1),
    ]
    return [p for p in neighbours if p != policy]


def _order_moves(search: _Search, start: Candidate, max_rounds: int = 200) -> None:
    """Fill the largest idle gaps of the best plan: move a later op of that device (a W, or an F)
    into the gap, re-simulate, keep strict improvements."""
    current = start
    for _ in range(max_rounds):
        if search.out_of_time():
            return
        result = simulate(current.plan, search.costs, search.cluster, memory=search.memory)
        gaps = []
        for device, ops in enumerate(current.plan.device_ops):
            for index in range(1, len(ops)):
                gap = result.op_start[ops[index]] - result.op_end[ops[index - 1]]
                if gap > 1e-9:
                    gaps.append((gap, device, index))
        gaps.sort(reverse=True)
        improved = False
        for gap, device, index in gaps[:8]:
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
                if candidate is not None and candidate.score < current.score:
                    current = candidate
                    improved = True
                    break
            if improved:
                break
        if not improved:
            return
