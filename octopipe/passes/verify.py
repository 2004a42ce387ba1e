"""verify: static checks of rank programs before anything runs.

Consumes the RankPrograms of one job (and optionally the plan and stage links they came from);
returns None or raises `VerificationError` whose message names the rule, the rank and step, the
expected vs actual, and prints the rank x step grid with `<-- ERROR HERE`.

Rules:
1. shape: one program per rank, in rank order; `step` last and once; fields each kind needs.
2. per rank: every (stage, microbatch) it runs has one forward and one backward (`backward` or
   `backward_input`), a `backward_weight` exactly when the backward was `backward_input`, in the
   order F, B, W; a stage runs on one rank; sends follow the compute that produces their data and
   receives precede the compute that reads theirs; with a plan, the programs run exactly its ops;
   with links (or a plan: the chain), every input of a compute is received or computed locally
   before it.
3. matching: on every directed rank pair, the k-th send and the k-th receive carry the same message
   (kind, producer stage, consumer stage, microbatch): the transport may match by order (NCCL).
   With `serialized_pairs=True` also: both ranks of a pair issue their sends and receives to each
   other in the same total order (a transport that runs a pair's operations on one stream).
4. no deadlock under the runtime's semantics, by simulation: sends and receive posts never block; a
   compute blocks until each receive it reads has been matched by the peer's send; `reduce_tied`
   blocks until every rank of its group reaches it; `step` until every rank does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

from octopipe.errors import VerificationError
from octopipe.ir.plan import OpKind, PipelinePlan, render_grid
from octopipe.ir.program import COMM_KINDS, COMPUTE_KINDS, InstrKind, Instruction, RankProgram

NAME = "verify"

Message = tuple[str, int, int, int]
"""(kind "act"|"grad", producer stage, consumer stage, microbatch)."""

_LABEL = {
    InstrKind.FORWARD: "F", InstrKind.BACKWARD: "B", InstrKind.BACKWARD_INPUT: "I", InstrKind.BACKWARD_WEIGHT: "W",
}
_BACKWARDS = (InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT)


def label(instruction: Instruction) -> str:
    """Compact grid label: `1F0`, `1I0` (input-grad B), `0SEND_F0->3@r1`, `3RECV_B0<-4@r1`, ..."""
    i = instruction
    if i.kind in _LABEL:
        return f"{i.stage}{_LABEL[i.kind]}{i.microbatch}"
    if i.kind is InstrKind.SEND_ACT:
        return f"{i.stage}SEND_F{i.microbatch}->{i.peer_stage}@r{i.peer}"
    if i.kind is InstrKind.RECV_ACT:
        return f"{i.stage}RECV_F{i.microbatch}<-{i.peer_stage}@r{i.peer}"
    if i.kind is InstrKind.SEND_GRAD:
        return f"{i.stage}SEND_B{i.microbatch}->{i.peer_stage}@r{i.peer}"
    if i.kind is InstrKind.RECV_GRAD:
        return f"{i.stage}RECV_B{i.microbatch}<-{i.peer_stage}@r{i.peer}"
    if i.kind is InstrKind.REDUCE_TIED:
        return f"REDUCE({i.param})"
    return "STEP"


def message_of(instruction: Instruction) -> Message:
    """The message a send or receive carries."""
    i = instruction
    assert i.stage is not None and i.peer_stage is not None and i.microbatch is not None
    if i.kind is InstrKind.SEND_ACT:
        return ("act", i.stage, i.peer_stage, i.microbatch)
    if i.kind is InstrKind.RECV_ACT:
        return ("act", i.peer_stage, i.stage, i.microbatch)
    if i.kind is InstrKind.SEND_GRAD:
        return ("grad", i.peer_stage, i.stage, i.microbatch)
    return ("grad", i.stage, i.peer_stage, i.microbatch)


def describe(message: Message) -> str:
    kind, p, c, m = message
    what = "activations" if kind == "act" else "gradients"
    return f"{what} of stage {p} -> stage {c}, microbatch {m}"


class _Checker:
    def __init__(self, programs: Sequence[RankProgram]) -> None:
        self.programs = programs
        self.grid = [[label(i) for i in p.instructions] for p in programs]

    def fail(self, rank: int | None, step: int | None, rule: str, detail: str) -> NoReturn:
        where = ""
        if rank is not None and step is not None:
            where = f"rank {rank} step {step} ({self.programs[rank].instructions[step]}): "
        mark = (rank, step) if rank is not None and step is not None else None
        raise VerificationError(f"{where}{rule}: {detail}\n{render_grid(self.grid, mark=mark)}")


def verify(
    programs: Sequence[RankProgram],
    plan: PipelinePlan | None = None,
    links: Iterable[tuple[int, int]] | None = None,
    *,
    serialized_pairs: bool = False,
) -> None:
    """Raise VerificationError unless the programs are well-formed, match, and cannot deadlock."""
    programs = tuple(programs)
    check = _Checker(programs)
    num_ranks = len(programs)
    if not programs:
        raise VerificationError("no programs to verify")
    if plan is not None and plan.num_devices != num_ranks:
        check.fail(None, None, "rank count", f"plan has {plan.num_devices} devices, got {num_ranks} programs")
    if plan is not None and links is None:
        links = [(s, s + 1) for s in range(plan.num_stages - 1)]
    link_set = frozenset(links) if links is not None else None

    # -- 1. shape ----------------------------------------------------------------------------------
    for rank, program in enumerate(programs):
        if program.rank != rank or program.num_ranks != num_ranks:
            check.fail(None, None, "program header",
                       f"program {rank} says rank={program.rank} ranks={program.num_ranks}; expected rank={rank} ranks={num_ranks}")
        body = program.instructions
        if not body or body[-1].kind is not InstrKind.STEP:
            check.fail(rank, len(body) - 1 if body else None, "step last", "a program must end with one `step`")
        for step, i in enumerate(body):
            if i.kind is InstrKind.STEP and step != len(body) - 1:
                check.fail(rank, step, "step last", "`step` appears before the end of the program")
            if i.kind in COMPUTE_KINDS or i.kind in COMM_KINDS:
                if i.stage is None or i.microbatch is None:
                    check.fail(rank, step, "fields", f"{i.kind} needs stage and mb")
            if i.kind in COMM_KINDS:
                if i.peer is None or i.peer_stage is None or not 0 <= i.peer < num_ranks or i.peer == rank:
                    check.fail(rank, step, "fields", f"{i.kind} needs peer (another rank of 0..{num_ranks - 1}) and peer_stage")
            if i.kind is InstrKind.REDUCE_TIED:
                if not i.param or rank not in i.ranks or any(not 0 <= r < num_ranks for r in i.ranks):
                    check.fail(rank, step, "fields", f"reduce_tied needs param and ranks including this rank {rank}")

    # -- 2. per-rank order rules ------------------------------------------------------------------
    stage_rank: dict[int, int] = {}
    done_at: list[dict[tuple[InstrKind | str, int, int], int]] = []
    for rank, program in enumerate(programs):
        seen: dict[tuple[InstrKind | str, int, int], int] = {}
        for step, i in enumerate(program.instructions):
            if i.kind not in COMPUTE_KINDS:
                continue
            s, m = i.stage, i.microbatch
            assert s is not None and m is not None
            owner = stage_rank.setdefault(s, rank)
            if owner != rank:
                check.fail(rank, step, "stage placement", f"stage {s} computes on rank {owner} and on rank {rank}")
            kind: InstrKind | str = "B" if i.kind in _BACKWARDS else i.kind
            if (kind, s, m) in seen:
                check.fail(rank, step, "exactly once", f"{label(i)} runs twice (first at step {seen[(kind, s, m)]})")
            if kind == "B" and (InstrKind.FORWARD, s, m) not in seen:
                check.fail(rank, step, "F before B", f"backward of stage {s} microbatch {m} before its forward")
            if i.kind is InstrKind.BACKWARD_WEIGHT:
                b = seen.get(("B", s, m))
                if b is None or program.instructions[b].kind is not InstrKind.BACKWARD_INPUT:
                    check.fail(rank, step, "B before W",
                               f"backward_weight of stage {s} microbatch {m} needs an earlier backward_input")
            seen[(kind, s, m)] = step
        for (kind, s, m), step in seen.items():
            if kind == InstrKind.FORWARD and ("B", s, m) not in seen:
                check.fail(rank, step, "exactly once", f"stage {s} microbatch {m} has a forward but no backward")
            if kind == "B" and program.instructions[step].kind is InstrKind.BACKWARD_INPUT and (InstrKind.BACKWARD_WEIGHT, s, m) not in seen:
                check.fail(rank, step, "B then W", f"backward_input of stage {s} microbatch {m} has no backward_weight")
        done_at.append(seen)

    def compute_step(rank: int, kind: InstrKind | str, stage: int, mb: int) -> int | None:
        return done_at[rank].get((kind, stage, mb))

    for rank, program in enumerate(programs):
        for step, i in enumerate(program.instructions):
            if i.kind not in COMM_KINDS:
                continue
            assert i.stage is not None and i.microbatch is not None and i.peer_stage is not None
            peer_owner = stage_rank.get(i.peer_stage)
            if peer_owner is not None and peer_owner != i.peer:
                check.fail(rank, step, "peer", f"stage {i.peer_stage} runs on rank {peer_owner}, not on peer {i.peer}")
            if stage_rank.get(i.stage) != rank:
                check.fail(rank, step, "stage placement", f"stage {i.stage} does not compute on rank {rank}")
            if i.kind is InstrKind.SEND_ACT or i.kind is InstrKind.SEND_GRAD:
                kind = InstrKind.FORWARD if i.kind is InstrKind.SEND_ACT else "B"
                producer = compute_step(rank, kind, i.stage, i.microbatch)
                if producer is None or producer > step:
                    check.fail(rank, step, "send after compute",
                               f"sends data of {'forward' if kind == InstrKind.FORWARD else 'backward'} of stage "
                               f"{i.stage} microbatch {i.microbatch}, which has not run yet on rank {rank}")
            else:
                kind = InstrKind.FORWARD if i.kind is InstrKind.RECV_ACT else "B"
                reader = compute_step(rank, kind, i.stage, i.microbatch)
                if reader is None or reader < step:
                    check.fail(rank, step, "receive before compute",
                               f"the {'forward' if kind == InstrKind.FORWARD else 'backward'} of stage {i.stage} "
                               f"microbatch {i.microbatch} that reads this message is not later on rank {rank}")

    if plan is not None:
        for rank, program in enumerate(programs):
            expected = plan.device_ops[rank]
            split = plan.split_backward()
            actual = [i for i in program.instructions if i.kind in COMPUTE_KINDS]
            for index in range(max(len(expected), len(actual))):
                want = expected[index] if index < len(expected) else None
                got = actual[index] if index < len(actual) else None
                ok = want is not None and got is not None and got.stage == want.stage and got.microbatch == want.microbatch
                if ok and want is not None and got is not None:
                    if want.kind is OpKind.F:
                        ok = got.kind is InstrKind.FORWARD
                    elif want.kind is OpKind.W:
                        ok = got.kind is InstrKind.BACKWARD_WEIGHT
                    else:
                        split_pair = (want.stage, want.microbatch) in split
                        ok = got.kind is (InstrKind.BACKWARD_INPUT if split_pair else InstrKind.BACKWARD)
                if not ok:
                    step = program.instructions.index(got) if got is not None else len(program.instructions) - 1
                    check.fail(rank, step, "plan order",
                               f"compute #{index} on rank {rank} should be {want} (plan), got {label(got) if got else 'nothing'}")

    if link_set is not None:
        producers: dict[int, list[int]] = {}
        consumers: dict[int, list[int]] = {}
        for p, c in link_set:
            producers.setdefault(c, []).append(p)
            consumers.setdefault(p, []).append(c)
        for rank, program in enumerate(programs):
            posted: set[tuple[InstrKind, int, int, int]] = set()
            for step, i in enumerate(program.instructions):
                if i.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD):
                    assert i.stage is not None and i.peer_stage is not None and i.microbatch is not None  # rule 1
                    posted.add((i.kind, i.stage, i.peer_stage, i.microbatch))
                if i.kind not in (InstrKind.FORWARD, *_BACKWARDS):
                    continue
                s, m = i.stage, i.microbatch
                assert s is not None and m is not None
                forward = i.kind is InstrKind.FORWARD
                for other in (producers if forward else consumers).get(s, ()):
                    other_rank = stage_rank.get(other)
                    if other_rank is None:
                        check.fail(rank, step, "inputs ready", f"stage {other} (linked to stage {s}) runs on no rank")
                    if other_rank == rank:
                        before = compute_step(rank, InstrKind.FORWARD if forward else "B", other, m)
                        if before is None or before > step:
                            check.fail(rank, step, "inputs ready",
                                       f"reads the {'output' if forward else 'input gradient'} of local stage {other} "
                                       f"microbatch {m}, which is computed later (or never) on rank {rank}")
                    else:
                        wanted_recv = (InstrKind.RECV_ACT if forward else InstrKind.RECV_GRAD, s, other, m)
                        if wanted_recv not in posted:
                            check.fail(rank, step, "inputs ready",
                                       f"reads {'activations' if forward else 'gradients'} from stage {other} on rank "
                                       f"{other_rank}, but no {wanted_recv[0]} for stage {s} microbatch {m} was posted "
                                       "before")

    # -- 3. matching per directed pair --------------------------------------------------------------
    sends: dict[tuple[int, int], list[tuple[int, Message]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Message]]] = {}
    for rank, program in enumerate(programs):
        for step, i in enumerate(program.instructions):
            if i.is_send:
                assert i.peer is not None  # rule 1
                sends.setdefault((rank, i.peer), []).append((step, message_of(i)))
            elif i.is_recv:
                assert i.peer is not None  # rule 1
                recvs.setdefault((i.peer, rank), []).append((step, message_of(i)))
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(out), len(into))):
            if k >= len(into):
                step, message = out[k]
                check.fail(src, step, "matching",
                           f"send #{k} from rank {src} to rank {dst} ({describe(message)}) has no receive on rank {dst} "
                           f"(rank {dst} posts {len(into)} receives from rank {src}, rank {src} sends {len(out)})")
            if k >= len(out):
                step, message = into[k]
                check.fail(dst, step, "matching",
                           f"receive #{k} on rank {dst} from rank {src} ({describe(message)}) has no send on rank {src} "
                           f"(rank {src} sends {len(out)} messages to rank {dst}, rank {dst} posts {len(into)} receives)")
            if out[k][1] != into[k][1]:
                check.fail(dst, into[k][0], "matching by order",
                           f"receive #{k} from rank {src} expects {describe(into[k][1])} but send #{k} of rank {src} "
                           f"(step {out[k][0]}) carries {describe(out[k][1])}; receives from one rank must be posted in "
                           f"the order it sends")
    if serialized_pairs:
        _check_pair_order(check, programs)
    _check_tied_groups(check, programs)

    # -- 4. deadlock simulation ---------------------------------------------------------------------
    _simulate(check, programs)


def _check_pair_order(check: _Checker, programs: Sequence[RankProgram]) -> None:
    for a in range(len(programs)):
        for b in range(a + 1, len(programs)):
            side_a = [(step, message_of(i)) for step, i in enumerate(programs[a].instructions) if i.kind in COMM_KINDS and i.peer == b]
            side_b = [(step, message_of(i)) for step, i in enumerate(programs[b].instructions) if i.kind in COMM_KINDS and i.peer == a]
            for k, ((step_a, msg_a), (step_b, msg_b)) in enumerate(zip(side_a, side_b)):
                if msg_a != msg_b:
                    check.fail(a, step_a, "pair order",
                               f"operation #{k} between ranks {a} and {b} is {describe(msg_a)} on rank {a} but "
                               f"{describe(msg_b)} on rank {b} (step {step_b}); a transport that serializes a pair's "
                               "operations on one stream would deadlock")


def _check_tied_groups(check: _Checker, programs: Sequence[RankProgram]) -> None:
    sequences: list[list[tuple[int, tuple[str | None, tuple[int, ...]]]]] = [
        [(step, (i.param, i.ranks)) for step, i in enumerate(p.instructions) if i.kind is InstrKind.REDUCE_TIED]
        for p in programs
    ]
    for rank, sequence in enumerate(sequences):
        for step, (_, ranks) in sequence:
            for other in ranks:
                mine = [key for _, key in sequence if rank in key[1] and other in key[1]]
                theirs = [key for _, key in sequences[other] if rank in key[1] and other in key[1]]
                if mine != theirs:
                    check.fail(rank, step, "tied order",
                               f"ranks {rank} and {other} reduce their shared tied parameters in different orders: "
                               f"{[k[0] for k in mine]} vs {[k[0] for k in theirs]}")


def _simulate(check: _Checker, programs: Sequence[RankProgram]) -> None:
    num_ranks = len(programs)
    # ordinal of each receive on its pair, and the receives each compute reads
    ordinal: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
    posted_count: dict[tuple[int, int], int] = {}
    needs: dict[tuple[int, int], list[int]] = {}  # (rank, compute step) -> steps of the receives it reads
    for rank, program in enumerate(programs):
        open_recvs: dict[tuple[InstrKind, int, int], list[int]] = {}
        for step, i in enumerate(program.instructions):
            if i.is_recv:
                assert i.peer is not None and i.stage is not None and i.microbatch is not None  # rule 1
                pair = (i.peer, rank)
                ordinal[(rank, step)] = (pair, posted_count.get(pair, 0))
                posted_count[pair] = posted_count.get(pair, 0) + 1
                reader = InstrKind.FORWARD if i.kind is InstrKind.RECV_ACT else InstrKind.BACKWARD
                open_recvs.setdefault((reader, i.stage, i.microbatch), []).append(step)
            elif i.kind in (InstrKind.FORWARD, *_BACKWARDS):
                assert i.stage is not None and i.microbatch is not None  # rule 1
                reader = InstrKind.FORWARD if i.kind is InstrKind.FORWARD else InstrKind.BACKWARD
                needs[(rank, step)] = open_recvs.pop((reader, i.stage, i.microbatch), [])

    pc = [0] * num_ranks
    sent: dict[tuple[int, int], int] = {}
    arrived: dict[tuple[str | None, int], set[int]] = {}
    tied_count = [dict[str | None, int]() for _ in range(num_ranks)]
    at_step: set[int] = set()
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            body = program.instructions
            while pc[rank] < len(body):
                step = pc[rank]
                i = body[step]
                if i.is_send:
                    assert i.peer is not None  # rule 1
                    pair = (rank, i.peer)
                    sent[pair] = sent.get(pair, 0) + 1
                elif i.kind in (InstrKind.FORWARD, *_BACKWARDS):
                    if any(sent.get(ordinal[(rank, r)][0], 0) <= ordinal[(rank, r)][1] for r in needs[(rank, step)]):
                        break
                elif i.kind is InstrKind.REDUCE_TIED:
                    occurrence = tied_count[rank].get(i.param, 0)
                    key = (i.param, occurrence)
                    group = arrived.setdefault(key, set())
                    group.add(rank)
                    if not set(i.ranks) <= group:
                        break
                    tied_count[rank][i.param] = occurrence + 1
                elif i.kind is InstrKind.STEP:
                    at_step.add(rank)
                    if len(at_step) < num_ranks:
                        break
                pc[rank] += 1
                progress = True
    if all(pc[rank] == len(p.instructions) for rank, p in enumerate(programs)):
        return
    blocked = []
    for rank, program in enumerate(programs):
        if pc[rank] >= len(program.instructions):
            continue
        i = program.instructions[pc[rank]]
        if i.kind in (InstrKind.FORWARD, *_BACKWARDS):
            missing = [program.instructions[r] for r in needs[(rank, pc[rank])]
                       if sent.get(ordinal[(rank, r)][0], 0) <= ordinal[(rank, r)][1]]
            reason = "waits for " + ", ".join(f"{describe(message_of(m))} from rank {m.peer}" for m in missing)
        elif i.kind is InstrKind.REDUCE_TIED:
            waiting = sorted(set(i.ranks) - arrived.get((i.param, tied_count[rank].get(i.param, 0)), set()))
            reason = f"waits at reduce_tied {i.param} for ranks {waiting}"
        else:
            reason = f"waits at step for ranks {sorted(set(range(num_ranks)) - at_step)}"
        blocked.append((rank, pc[rank], f"rank {rank} step {pc[rank]} {label(i)} {reason}"))
    rank, step, _ = blocked[0]
    check.fail(rank, step, "deadlock",
               "no rank can make progress:\n  " + "\n  ".join(text for _, _, text in blocked))
