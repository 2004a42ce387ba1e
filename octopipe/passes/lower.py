"""lower: PipelinePlan -> one RankProgram per device, with sends and receives in a safe order.

Consumes a validated plan, the stage `links` (which stages exchange tensors) and the tied
parameters; produces the instruction lists `runtime/engine.py` runs and `passes/verify.py` checks.
Glossary: *rank* = device; a *message* is the activations of stage p for consumer c on one
microbatch (`act`, sent right after F(p, m)) or their gradients (`grad`, sent right after B(c, m));
a *pair* is two ranks.

Ordering scheme (why no transport can deadlock or mismatch):

1. Simulate the plan once with unit-ish op durations (F=1, full B=2, split B=1, W=1, transfers
   free). Every message gets a send time; sort all messages by (send time, sender rank, sender's
   position). Call this order S.
2. A sender issues its sends right after the producing compute, which is S order per pair
   (send times grow along a device's program).
3. A receiver posts the receive of message x from rank q (a) before the compute that needs x,
   (b) before its own next send to q that follows x in S, (c) after its sends to q that precede
   x in S, and (d) after the receives from q that precede x in S; within that window, `prefetch`
   computes ahead of the reader (default 1: the transfer overlaps the compute before it; a gloo
   send only moves data once the receive is posted). The window is never empty: if the compute
   needing x came before a send y that precedes x in S, y would be sent after x arrived, so x
   would precede y.

So on every pair the two ranks issue their sends and receives in the same total order S, in both
directions. An order-matching transport (NCCL; gloo with any tags) therefore pairs each receive with
the right send, and even a transport that serializes a pair's operations on one stream (NCCL's
per-pair communicator) cannot deadlock, because S is a linear extension of the plan's
happens-before order. Receives are non-blocking posts; a compute waits only for its own inputs.

A transport that matches by tag (gloo: `serialized_pairs=False`) needs only (a) and (d): a
receive's place is then set by `prefetch` alone, so `compile` posts all of a step's receives when
it starts. On gloo that matters: a send moves its data only once the receive is posted, and a
receive posted after its send waited 10-35 ms on a 2-core CPU (the sender's I/O thread has to get
a core while both ranks compute) against 0.3 ms when posted first.

Tied parameters: `reduce_tied` goes after the last gradient-producing compute (B or W) on each rank
of the group, moved later where needed so that no rank waits at it for something another group
rank produces after its own `reduce_tied` (a fixpoint on the plan DAG; at the latest it lands just
before `step`). Tied reductions run in the order of `tied` on every rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from octopipe.errors import PlanError
from octopipe.ir.plan import Op, OpKind, PipelinePlan, render_grid
from octopipe.ir.program import InstrKind, Instruction, RankProgram

NAME = "lower"

Link = tuple[int, int]

_DURATION = {OpKind.F: 1, OpKind.W: 1}
_FULL_BACKWARD = 2
_SPLIT_BACKWARD = 1


def chain_links(num_stages: int) -> frozenset[Link]:
    return frozenset((s, s + 1) for s in range(num_stages - 1))


def check_links(plan: PipelinePlan, links: Iterable[Link] | None) -> frozenset[Link]:
    """The links to use: the chain s -> s+1 when None; otherwise checked (producer < consumer)."""
    if links is None:
        return chain_links(plan.num_stages)
    result = frozenset((int(p), int(c)) for p, c in links)
    for p, c in sorted(result):
        if not (0 <= p < c < plan.num_stages):
            raise PlanError(
                f"link ({p}, {c}) is invalid: links are (producer stage, consumer stage) with "
                f"0 <= producer < consumer < {plan.num_stages}"
            )
    return result


def op_dependencies(op: Op, producers: dict[int, list[int]], consumers: dict[int, list[int]]) -> list[Op]:
    """The ops whose results `op` needs (the plan DAG's data edges)."""
    s, m = op.stage, op.microbatch
    if op.kind is OpKind.F:
        return [Op(p, OpKind.F, m) for p in producers[s]]
    if op.kind is OpKind.B:
        return [Op(s, OpKind.F, m), *(Op(c, OpKind.B, m) for c in consumers[s])]
    return [Op(s, OpKind.B, m)]


def _simulate(plan: PipelinePlan, producers: dict[int, list[int]], consumers: dict[int, list[int]]) -> dict[Op, int]:
    """Finish time of every op when each device runs its ops in order as soon as inputs are there."""
    split = plan.split_backward()
    finish: dict[Op, int] = {}
    device_free = [0] * plan.num_devices
    position = [0] * plan.num_devices
    remaining = plan.num_ops()
    while remaining:
        progressed = False
        for device, ops in enumerate(plan.device_ops):
            while position[device] < len(ops):
                op = ops[position[device]]
                deps = op_dependencies(op, producers, consumers)
                if any(dep not in finish for dep in deps):
                    break
                start = max([device_free[device], *(finish[dep] for dep in deps)])
                if op.kind is OpKind.B:
                    duration = _SPLIT_BACKWARD if (op.stage, op.microbatch) in split else _FULL_BACKWARD
                else:
                    duration = _DURATION[op.kind]
                finish[op] = device_free[device] = start + duration
                position[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [(d, position[d]) for d in range(plan.num_devices) if position[d] < len(plan.device_ops[d])]
            device, step = stuck[0]
            blocked = ", ".join(f"device {d} at {plan.device_ops[d][i]}" for d, i in stuck)
            raise PlanError(
                f"plan order cannot execute: every device waits for an op another device runs later "
                f"({blocked}); reorder the ops so each one's inputs come first\n"
                + render_grid(plan.device_ops, mark=(device, step))
            )
    return finish


def _tied_positions(plan: PipelinePlan, tied: Sequence[tuple[str, tuple[int, ...]]],
                    producers: dict[int, list[int]], consumers: dict[int, list[int]]) -> list[dict[int, int]]:
    """For each tied parameter, per rank of its group: how many of the rank's ops run before its
    reduce_tied. Starts after the rank's last B/W and moves later until the barrier cannot close a
    dependency cycle (no op before it, on any group rank, depends on an op after it)."""
    preds: dict[object, list[object]] = {}
    where: dict[Op, tuple[int, int]] = {}
    for device, ops in enumerate(plan.device_ops):
        for index, op in enumerate(ops):
            where[op] = (device, index)
            preds[op] = list(op_dependencies(op, producers, consumers))
            if index:
                preds[op].append(ops[index - 1])
    placed: list[dict[int, int]] = []
    for number, (name, ranks) in enumerate(tied):
        position: dict[int, int] = {}
        for rank in ranks:
            ops = plan.device_ops[rank]
            last = max((i + 1 for i, op in enumerate(ops) if op.kind is not OpKind.F), default=0)
            earlier = [p[rank] for p in placed if rank in p]
            position[rank] = max([last, *earlier])
        while True:
            frontier: deque[object] = deque(
                plan.device_ops[r][i] for r in ranks for i in range(position[r]))
            seen = set(frontier)
            moved = False
            while frontier:
                node = frontier.popleft()
                if isinstance(node, Op):
                    device, index = where[node]
                    if device in position and index >= position[device]:
                        position[device] = index + 1
                        moved = True
                for pred in preds.get(node, ()):
                    if pred not in seen:
                        seen.add(pred)
                        frontier.append(pred)
            if not moved:
                break
        barrier = ("reduce_tied", number, name)
        preds[barrier] = [plan.device_ops[r][position[r] - 1] for r in ranks if position[r] > 0]
        for r in ranks:
            if position[r] < len(plan.device_ops[r]):
                preds[plan.device_ops[r][position[r]]].append(barrier)
        placed.append(position)
    return placed


def lower(
    plan: PipelinePlan,
    links: set[Link] | frozenset[Link] | None = None,
    tied: tuple[tuple[str, tuple[int, ...]], ...] = (),
    *,
    prefetch: int = 1,
    serialized_pairs: bool = True,
) -> tuple[RankProgram, ...]:
    """One RankProgram per device: computes in plan order, sends right after the producing
    compute, receives posted ahead in the pair order S (module docstring), reduce_tied, step.
    `prefetch`: how many computes ahead of its reader a receive is posted where the order allows
    (0: just before the reader; more overlap costs more receive buffers alive at once).
    `serialized_pairs=False` (a transport that matches by tag, like gloo): receives keep S order
    only among those from one peer, not relative to the receiver's own sends to it (rules (b) and
    (c)), so `prefetch` alone sets how early they are posted."""
    plan.validate()
    links = check_links(plan, links)
    device_of = plan.placement
    producers: dict[int, list[int]] = {s: [] for s in range(plan.num_stages)}
    consumers: dict[int, list[int]] = {s: [] for s in range(plan.num_stages)}
    for p, c in sorted(links):
        producers[c].append(p)
        consumers[p].append(c)
    split = plan.split_backward()
    for name, ranks in tied:
        for rank in ranks:
            if not 0 <= rank < plan.num_devices or not plan.stages_of(rank):
                raise PlanError(f"tied parameter {name!r} names rank {rank}, which holds no stage of this plan")
        if len(set(ranks)) != len(ranks) or len(ranks) < 2:
            raise PlanError(f"tied parameter {name!r} needs two or more distinct ranks, got {ranks}")
    finish = _simulate(plan, producers, consumers)
    position = {op: (d, i) for d, ops in enumerate(plan.device_ops) for i, op in enumerate(ops)}

    # Every cross-device message: (send time, sender, sender position, sub-index) orders S.
    # A message is (kind, producer stage, consumer stage, microbatch).
    messages: list[tuple[tuple[int, int, int, int], tuple[str, int, int, int], int, int]] = []
    for (p, c) in links:
        if device_of[p] == device_of[c]:
            continue
        for m in range(plan.num_microbatches):
            forward, backward = Op(p, OpKind.F, m), Op(c, OpKind.B, m)
            s_key = (finish[forward], device_of[p], position[forward][1], consumers[p].index(c))
            messages.append((s_key, ("act", p, c, m), device_of[p], device_of[c]))
            s_key = (finish[backward], device_of[c], position[backward][1], producers[c].index(p))
            messages.append((s_key, ("grad", p, c, m), device_of[c], device_of[p]))
    messages.sort()

    # Sort keys of instructions within a rank: (compute index, phase, sub, S index), phases:
    # 0 receives before the compute, 1 the compute, 2 its sends (receives may sit between them at
    # even subs), 3 reduce_tied after it.
    keyed: list[list[tuple[tuple[int, int, int, int], Instruction]]] = [[] for _ in range(plan.num_devices)]
    for device, ops in enumerate(plan.device_ops):
        for k, op in enumerate(ops):
            s, m = op.stage, op.microbatch
            if op.kind is OpKind.F:
                kind = InstrKind.FORWARD
            elif op.kind is OpKind.W:
                kind = InstrKind.BACKWARD_WEIGHT
            else:
                kind = InstrKind.BACKWARD_INPUT if (s, m) in split else InstrKind.BACKWARD
            keyed[device].append(((k, 1, 0, 0), Instruction(kind, stage=s, microbatch=m)))

    def send_key(kind: str, p: int, c: int, m: int) -> tuple[int, int, int]:
        if kind == "act":
            k = position[Op(p, OpKind.F, m)][1]
            return (k, 2, 2 * consumers[p].index(c) + 1)
        k = position[Op(c, OpKind.B, m)][1]
        return (k, 2, 2 * producers[c].index(p) + 1)

    def need_key(kind: str, p: int, c: int, m: int) -> tuple[int, int, int]:
        op = Op(c, OpKind.F, m) if kind == "act" else Op(p, OpKind.B, m)
        return (position[op][1], 0, 0)

    # Per receiving rank and sender: the messages in S order, with their deadlines.
    INF = (1 << 60, 0, 0)
    pending_next_send: dict[tuple[int, int], tuple[int, int, int]] = {}
    deadlines: dict[int, tuple[int, int, int]] = {}
    inbox: dict[tuple[int, int], list[int]] = {}
    for index in range(len(messages) - 1, -1, -1):  # backwards: "next send of the receiver after x"
        _, (message_kind, p, c, m), src, dst = messages[index]
        # receiver dst's next send to src that follows x in S
        deadline = need_key(message_kind, p, c, m)
        if serialized_pairs:
            deadline = min(deadline, pending_next_send.get((dst, src), INF))
        deadlines[index] = deadline
        inbox.setdefault((dst, src), []).append(index)
        k, phase, sub = send_key(message_kind, p, c, m)
        pending_next_send[(src, dst)] = (k, phase, sub - 1)  # the slot just before that send
    for indices in inbox.values():
        running = INF
        for index in indices:  # reverse S order: suffix minimum keeps receives in S order
            running = min(running, deadlines[index])
            deadlines[index] = running
    # Prefetch: move each receive up to `prefetch` computes earlier than its reader, so the
    # transfer overlaps the computes in between, but never before the receiver's last send to that
    # peer that precedes it in S (the pair order) and never past its deadline.
    if prefetch > 0:
        after_last_send: dict[tuple[int, int], tuple[int, int, int]] = {}
        for index, (_, (message_kind, p, c, m), src, dst) in enumerate(messages):
            k, phase, sub = send_key(message_kind, p, c, m)
            after_last_send[(src, dst)] = (k, phase, sub + 1)
            need = need_key(message_kind, p, c, m)
            early = (max(need[0] - prefetch, -1), 0, 0)
            if serialized_pairs:
                early = max(after_last_send.get((dst, src), (-1, 0, 0)), early)
            deadlines[index] = min(early, deadlines[index])
        for indices in inbox.values():
            running = INF
            for index in indices:
                running = min(running, deadlines[index])
                deadlines[index] = running

    for index, (_, (message_kind, p, c, m), src, dst) in enumerate(messages):
        if message_kind == "act":
            keyed[src].append(((*send_key(message_kind, p, c, m), 0),
                               Instruction(InstrKind.SEND_ACT, stage=p, microbatch=m, peer=dst, peer_stage=c)))
            keyed[dst].append(((*deadlines[index], index),
                               Instruction(InstrKind.RECV_ACT, stage=c, microbatch=m, peer=src, peer_stage=p)))
        else:
            keyed[src].append(((*send_key(message_kind, p, c, m), 0),
                               Instruction(InstrKind.SEND_GRAD, stage=c, microbatch=m, peer=dst, peer_stage=p)))
            keyed[dst].append(((*deadlines[index], index),
                               Instruction(InstrKind.RECV_GRAD, stage=p, microbatch=m, peer=src, peer_stage=c)))

    for number, ((name, ranks), placed) in enumerate(zip(tied, _tied_positions(plan, tied, producers, consumers))):
        for rank in ranks:
            keyed[rank].append(((placed[rank] - 1, 3, number, 0),
                                Instruction(InstrKind.REDUCE_TIED, param=name, ranks=tuple(sorted(ranks)))))

    programs = []
    for device in range(plan.num_devices):
        instructions = [instruction for _, instruction in sorted(keyed[device], key=lambda item: item[0])]
        instructions.append(Instruction(InstrKind.STEP))
        programs.append(RankProgram(device, plan.num_devices, tuple(instructions)))
    return tuple(programs)
