"""verify: accepts lowered programs, rejects broken ones, and agrees with an independent threaded
interpreter (one thread per rank, an order-matching transport per directed pair) on which
communication mutations are unsafe."""

import random
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe import PipelinePlan, VerificationError
from octopipe.ir.program import COMM_KINDS, InstrKind, RankProgram
from octopipe.passes.lower import lower
from octopipe.passes.verify import verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from pipeline_helpers import family_plan, random_plan, random_plans  # noqa: E402

# -- the independent interpreter ------------------------------------------------------------------


class Unsafe(Exception):
    """The programs deadlock, mismatch a message, or read data that is not there."""


def run_threaded(programs, plan, links):
    """Run every rank's program in its own thread over an order-matching transport: the k-th
    receive a rank posts from a peer gets the peer's k-th send to it, whatever that carries. Raises
    Unsafe on deadlock (every live thread waits and nothing changed since), on a receive that gets
    another message than it was posted for, on a compute whose data is missing, and on leftovers."""
    producers = {s: [p for p, c in links if c == s] for s in range(plan.num_stages)}
    consumers = {s: [c for p, c in links if p == s] for s in range(plan.num_stages)}
    owner = plan.placement
    cv = threading.Condition()
    state = {"epoch": 0, "alive": len(programs), "failure": None}
    waiting: dict[int, int] = {}
    channel: dict[tuple[int, int], list] = {}
    barrier_arrivals: dict[tuple, set] = {}
    computed = [set() for _ in programs]

    def changed():
        state["epoch"] += 1
        cv.notify_all()

    def fail(text):
        if state["failure"] is None:
            state["failure"] = text
        changed()
        raise Unsafe(text)

    def wait_until(rank, predicate, what):
        while not predicate():
            if state["failure"] is not None:
                raise Unsafe(state["failure"])
            waiting[rank] = state["epoch"]
            if len(waiting) == state["alive"] and all(e == state["epoch"] for e in waiting.values()):
                waiting.pop(rank)
                fail(f"deadlock: rank {rank} waits for {what}")
            cv.wait(timeout=10)
            waiting.pop(rank, None)

    def worker(rank, program):
        posts: dict[tuple, tuple[tuple[int, int], int]] = {}  # expected message -> (pair, ordinal)
        posted = {}
        tied_seen = {}
        try:
            with cv:
                for i in program.instructions:
                    s, m = i.stage, i.microbatch
                    if i.kind is InstrKind.SEND_ACT:
                        if ("F", s, m) not in computed[rank]:
                            fail(f"rank {rank} sends activations of {s}F{m} before computing them")
                        channel.setdefault((rank, i.peer), []).append(("act", s, i.peer_stage, m))
                        changed()
                    elif i.kind is InstrKind.SEND_GRAD:
                        if ("B", s, m) not in computed[rank]:
                            fail(f"rank {rank} sends gradients of {s}B{m} before computing them")
                        channel.setdefault((rank, i.peer), []).append(("grad", i.peer_stage, s, m))
                        changed()
                    elif i.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD):
                        pair = (i.peer, rank)
                        expected = ("act", i.peer_stage, s, m) if i.kind is InstrKind.RECV_ACT else ("grad", s, i.peer_stage, m)
                        posts[expected] = (pair, posted.get(pair, 0))
                        posted[pair] = posted.get(pair, 0) + 1
                    elif i.is_compute:
                        if i.kind is InstrKind.BACKWARD_WEIGHT:
                            if ("I", s, m) not in computed[rank]:
                                fail(f"rank {rank} runs {s}W{m} without its input-gradient B")
                            computed[rank].add(("W", s, m))
                            continue
                        forward = i.kind is InstrKind.FORWARD
                        if not forward and ("F", s, m) not in computed[rank]:
                            fail(f"rank {rank} runs backward {s}B{m} before its forward")
                        for other in (producers if forward else consumers)[s]:
                            if owner[other] == rank:
                                if ((("F" if forward else "B"), other, m)) not in computed[rank]:
                                    fail(f"rank {rank}: local input of {s}{'F' if forward else 'B'}{m} from stage {other} missing")
                                continue
                            expected = ("act", other, s, m) if forward else ("grad", s, other, m)
                            if expected not in posts:
                                fail(f"rank {rank}: {expected} was never posted before its compute")
                            pair, k = posts.pop(expected)
                            wait_until(rank, lambda pair=pair, k=k: len(channel.get(pair, ())) > k, f"{expected}")
                            if channel[pair][k] != expected:
                                fail(f"rank {rank}: receive posted for {expected} got {channel[pair][k]}")
                        computed[rank].add(("F" if forward else "B", s, m))
                        if i.kind is InstrKind.BACKWARD_INPUT:
                            computed[rank].add(("I", s, m))
                    elif i.kind is InstrKind.REDUCE_TIED:
                        count = tied_seen.get(i.param, 0)
                        tied_seen[i.param] = count + 1
                        arrivals = barrier_arrivals.setdefault((i.param, count), set())
                        arrivals.add(rank)
                        changed()
                        wait_until(rank, lambda a=arrivals, r=set(i.ranks): r <= a, f"reduce {i.param}")
                    elif i.kind is InstrKind.STEP:
                        arrivals = barrier_arrivals.setdefault(("step",), set())
                        arrivals.add(rank)
                        changed()
                        wait_until(rank, lambda a=arrivals: len(a) == len(programs), "step")
                for expected, (pair, k) in posts.items():
                    if len(channel.get(pair, ())) <= k or channel[pair][k] != expected:
                        fail(f"rank {rank}: receive for {expected} never matched")
        except Unsafe:
            pass
        finally:
            with cv:
                state["alive"] -= 1
                changed()

    threads = [threading.Thread(target=worker, args=(r, p), daemon=True) for r, p in enumerate(programs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if state["failure"] is not None:
        raise Unsafe(state["failure"])
    for (src, dst), sent in channel.items():
        receives = sum(1 for i in programs[dst].instructions if i.is_recv and i.peer == src)
        if receives != len(sent):
            raise Unsafe(f"{len(sent)} sends from rank {src} to rank {dst}, {receives} receives")
    for s in range(plan.num_stages):
        for m in range(plan.num_microbatches):
            done = computed[owner[s]]
            if ("F", s, m) not in done or ("B", s, m) not in done or (("I", s, m) in done) != (("W", s, m) in done):
                raise Unsafe(f"stage {s} microbatch {m} did not complete")


def is_safe(programs, plan, links):
    try:
        run_threaded(programs, plan, links)
    except Unsafe:
        return False
    return True


def is_accepted(programs, plan, links):
    try:
        verify(programs, plan, links)
    except VerificationError:
        return False
    return True


# -- mutations --------------------------------------------------------------------------------------


def mutate(programs, rng: random.Random, how: str):
    """One communication mutation of one rank's program."""
    programs = list(programs)
    candidates = [r for r, p in enumerate(programs) if any(i.kind in COMM_KINDS for i in p.instructions)]
    if not candidates:
        return None
    rank = rng.choice(candidates)
    body = list(programs[rank].instructions)
    comm = [k for k, i in enumerate(body) if i.kind in COMM_KINDS]
    if how == "drop_recv":
        recvs = [k for k in comm if body[k].is_recv]
        if not recvs:
            return None
        del body[rng.choice(recvs)]
    elif how == "swap_across_dependency":
        # move a receive just after the compute that reads it, or a send just before its compute
        k = rng.choice(comm)
        i = body[k]
        target = next((j for j, c in enumerate(body) if c.is_compute and c.stage == i.stage and c.microbatch == i.microbatch
                       and (c.kind is InstrKind.FORWARD) == (i.kind in (InstrKind.RECV_ACT, InstrKind.SEND_ACT))
                       and c.kind is not InstrKind.BACKWARD_WEIGHT), None)
        if target is None:
            return None
        body.insert(target if i.is_recv else target, body.pop(k))
        if i.is_send:
            body.insert(target - 1 if target > k else target, body.pop(body.index(i)))
    elif how == "reorder_pair":
        # swap two sends (or two receives) of one directed pair
        pairs = {}
        for k in comm:
            pairs.setdefault((body[k].peer, body[k].is_send), []).append(k)
        options = [ks for ks in pairs.values() if len(ks) >= 2]
        if not options:
            return None
        a, b = rng.sample(rng.choice(options), 2)
        body[a], body[b] = body[b], body[a]
    elif how == "random":
        k = rng.choice(comm)
        instruction = body.pop(k)
        if rng.random() < 0.2:
            pass  # dropped
        else:
            body.insert(rng.randrange(len(body)), instruction)
    programs[rank] = RankProgram(rank, programs[rank].num_ranks, tuple(body))
    return tuple(programs)


# -- tests ------------------------------------------------------------------------------------------


def test_error_prints_grid_and_rule():
    plan = family_plan("1f1b", 2, 2)
    programs = list(lower(plan))
    body = [i for i in programs[1].instructions if i.kind is not InstrKind.RECV_ACT or i.microbatch != 1]
    programs[1] = RankProgram(1, 2, tuple(body))
    with pytest.raises(VerificationError) as info:
        verify(programs, plan)
    text = str(info.value)
    assert "<-- ERROR HERE" in text and "step  device 0" in text
    assert "inputs ready" in text or "matching" in text


def test_deadlock_is_reported_with_the_blocked_ranks():
    # both ranks post their receive but send only after computing on what they receive
    text = """program rank=0 ranks=2
  recv_grad stage=0 mb=0 peer=1 peer_stage=1
  forward stage=0 mb=0
  backward stage=0 mb=0
  send_act stage=0 mb=0 peer=1 peer_stage=1
  step
program rank=1 ranks=2
  recv_act stage=1 mb=0 peer=0 peer_stage=0
  forward stage=1 mb=0
  backward stage=1 mb=0
  send_grad stage=1 mb=0 peer=0 peer_stage=0
  step
"""
    from octopipe.ir.program import parse_programs

    with pytest.raises(VerificationError, match="deadlock") as info:
        verify(parse_programs(text))
    assert "waits for" in str(info.value)


def test_wrong_order_on_a_pair_is_a_matching_error():
    plan = family_plan("gpipe", 2, 3)
    programs = list(lower(plan))
    body = list(programs[1].instructions)
    recvs = [k for k, i in enumerate(body) if i.kind is InstrKind.RECV_ACT]
    body.insert(recvs[0], body.pop(recvs[1]))  # post microbatch 1's receive before microbatch 0's
    programs[1] = RankProgram(1, 2, tuple(body))
    with pytest.raises(VerificationError, match="matching by order"):
        verify(programs, plan)
    assert not is_safe(programs, plan, {(0, 1)})


def test_tied_reduce_in_different_orders_is_rejected():
    plan = family_plan("1f1b", 2, 2)
    programs = lower(plan, tied=(("a", (0, 1)), ("b", (0, 1))))
    body = list(programs[1].instructions)
    k = [j for j, i in enumerate(body) if i.kind is InstrKind.REDUCE_TIED]
    body[k[0]], body[k[1]] = body[k[1]], body[k[0]]
    with pytest.raises(VerificationError, match="tied order"):
        verify([programs[0], RankProgram(1, 2, tuple(body))], plan)


def test_lowered_programs_pass_the_threaded_interpreter():
    for seed in range(40):
        rng = random.Random(seed)
        plan, links = random_plan(rng, rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 3), rng.randint(0, 2))
        programs = lower(plan, links)
        verify(programs, plan, links)
        run_threaded(programs, plan, links)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_plans(max_devices=3, max_stages=5, max_microbatches=3),
       st.sampled_from(["drop_recv", "swap_across_dependency", "reorder_pair"]), st.integers(0, 10**6))
def test_targeted_mutations_are_rejected_and_genuinely_unsafe(case, how, seed):
    plan, links = case
    mutated = mutate(lower(plan, links), random.Random(seed), how)
    if mutated is None or mutated == lower(plan, links):
        return
    if how == "reorder_pair":
        # two messages of one pair traded places: unsafe unless they were the same message
        pass
    assert not is_accepted(mutated, plan, links)
    assert not is_safe(mutated, plan, links)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_plans(max_devices=3, max_stages=5, max_microbatches=3), st.integers(0, 10**6))
def test_verify_agrees_with_the_interpreter_on_random_mutations(case, seed):
    """Soundness and completeness relative to the independent interpreter: a random move or drop of
    a communication instruction is rejected exactly when it deadlocks, mismatches or loses data."""
    plan, links = case
    mutated = mutate(lower(plan, links), random.Random(seed), "random")
    if mutated is None:
        return
    assert is_accepted(mutated, plan, links) == is_safe(mutated, plan, links)


def test_plan_mismatch_is_rejected():
    plan = family_plan("1f1b", 2, 2)
    other = PipelinePlan.parse(str(plan).replace("device 1: 1F0 1B0 1F1 1B1", "device 1: 1F0 1F1 1B0 1B1"))
    with pytest.raises(VerificationError, match="plan order"):
        verify(lower(other), plan)
