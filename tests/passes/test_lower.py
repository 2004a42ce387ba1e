"""lower: plan text -> rank programs (golden), pair order, tied reductions, random plans verify."""

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octopipe import PipelinePlan, PlanError, VerificationError
from octopipe.ir.program import COMM_KINDS, InstrKind, format_programs, parse_programs
from octopipe.passes.lower import lower
from octopipe.passes.verify import message_of, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from pipeline_helpers import FAMILIES, family_plan, random_plans  # noqa: E402

ONE_F_ONE_B = """plan devices=2 microbatches=3 stages=2
stage 0 layers=0:1 device=0
stage 1 layers=1:2 device=1
device 0: 0F0 0F1 0B0 0F2 0B1 0B2
device 1: 1F0 1B0 1F1 1B1 1F2 1B2
"""

GOLDEN = """program rank=0 ranks=2
  forward stage=0 mb=0
  send_act stage=0 mb=0 peer=1 peer_stage=1
  forward stage=0 mb=1
  send_act stage=0 mb=1 peer=1 peer_stage=1
  recv_grad stage=0 mb=0 peer=1 peer_stage=1
  backward stage=0 mb=0
  forward stage=0 mb=2
  send_act stage=0 mb=2 peer=1 peer_stage=1
  recv_grad stage=0 mb=1 peer=1 peer_stage=1
  recv_grad stage=0 mb=2 peer=1 peer_stage=1
  backward stage=0 mb=1
  backward stage=0 mb=2
  step
program rank=1 ranks=2
  recv_act stage=1 mb=0 peer=0 peer_stage=0
  forward stage=1 mb=0
  recv_act stage=1 mb=1 peer=0 peer_stage=0
  backward stage=1 mb=0
  send_grad stage=1 mb=0 peer=0 peer_stage=0
  forward stage=1 mb=1
  recv_act stage=1 mb=2 peer=0 peer_stage=0
  backward stage=1 mb=1
  send_grad stage=1 mb=1 peer=0 peer_stage=0
  forward stage=1 mb=2
  backward stage=1 mb=2
  send_grad stage=1 mb=2 peer=0 peer_stage=0
  step
"""


def test_one_f_one_b_golden_and_round_trip():
    programs = lower(PipelinePlan.parse(ONE_F_ONE_B))
    assert format_programs(programs) == GOLDEN
    assert parse_programs(GOLDEN) == programs


def test_prefetch_posts_receives_a_compute_early_where_the_pair_order_allows():
    plan = PipelinePlan.parse(ONE_F_ONE_B)
    late = lower(plan, prefetch=0)
    for program in late:  # without prefetch every receive sits right before its reader
        body = program.instructions
        for step, i in enumerate(body):
            if i.is_recv:
                reader = next(j for j in body[step:] if j.is_compute)
                assert (reader.stage, reader.microbatch) == (i.stage, i.microbatch)
    early = lower(plan)
    rank1 = [str(i) for i in early[1].instructions]
    assert rank1.index("recv_act stage=1 mb=1 peer=0 peer_stage=0") < rank1.index("backward stage=1 mb=0")
    for programs in (late, early, lower(plan, prefetch=3)):
        verify(programs, plan, serialized_pairs=True)


def test_tag_matching_transport_posts_receives_without_the_reverse_direction_order():
    plan = PipelinePlan.parse(ONE_F_ONE_B)
    tagged = lower(plan, prefetch=10, serialized_pairs=False)
    for program in tagged:  # every receive before the first compute, in the peer's send order
        body = program.instructions
        first = next(step for step, i in enumerate(body) if i.is_compute)
        assert all(step < first for step, i in enumerate(body) if i.is_recv)
    rank0 = [str(i) for i in tagged[0].instructions]
    assert rank0[:3] == [f"recv_grad stage=0 mb={m} peer=1 peer_stage=1" for m in range(3)]
    verify(tagged, plan)
    with pytest.raises(VerificationError, match="pair order"):
        verify(tagged, plan, serialized_pairs=True)
    # prefetch still bounds how early: with 0 no compute runs between a receive and its reader
    for program in lower(plan, prefetch=0, serialized_pairs=False):
        body = program.instructions
        for step, i in enumerate(body):
            if i.is_recv:
                reader = next(j for j in body[step:] if j.is_compute)
                assert (reader.stage, reader.microbatch) == (i.stage, i.microbatch)


def test_compute_in_plan_order_with_b_w_split():
    plan = PipelinePlan.parse("""plan devices=2 microbatches=1 stages=4
stage 0 layers=0:3 device=0
stage 1 layers=3:7 device=1
stage 2 layers=7:9 device=1
stage 3 layers=9:12 device=0
device 0: 0F0 3F0 3B0 3W0 0B0 0W0
device 1: 1F0 2F0 2B0 1B0 1W0
""")
    programs = lower(plan)
    computes = [[f"{i.kind}:{i.stage}:{i.microbatch}" for i in p.instructions if i.is_compute] for p in programs]
    assert computes[0] == ["forward:0:0", "forward:3:0", "backward_input:3:0", "backward_weight:3:0",
                           "backward_input:0:0", "backward_weight:0:0"]
    # stage 2's B has no W: a full backward; the 1 -> 2 hand-off is local (no instruction)
    assert computes[1] == ["forward:1:0", "forward:2:0", "backward:2:0", "backward_input:1:0", "backward_weight:1:0"]
    assert not any(i.is_send and i.peer_stage == 2 and i.stage == 1 for i in programs[1].instructions)
    verify(programs, plan, serialized_pairs=True)


def test_sends_follow_their_compute_and_receives_precede_it():
    plan = family_plan("interleaved-1f1b", 2, 4)
    for program in lower(plan):
        body = program.instructions
        for step, i in enumerate(body):
            if i.is_send:
                producer = body[step - 1]
                back = 1
                while producer.is_send or producer.is_recv:  # a send follows its compute (maybe other sends first)
                    back += 1
                    producer = body[step - back]
                assert producer.is_compute and producer.stage == i.stage and producer.microbatch == i.microbatch


def test_skip_links_add_messages_and_order_stays_consistent():
    plan = family_plan("1f1b", 4, 4)
    links = {(0, 1), (1, 2), (2, 3), (0, 3)}
    programs = lower(plan, links)
    assert any(i.kind is InstrKind.SEND_ACT and i.stage == 0 and i.peer_stage == 3 for i in programs[0].instructions)
    assert any(i.kind is InstrKind.RECV_GRAD and i.stage == 0 and i.peer_stage == 3 for i in programs[0].instructions)
    verify(programs, plan, links, serialized_pairs=True)


def test_tied_reduction_is_moved_where_it_cannot_deadlock():
    # interleaved: stage 0 (rank 0) and stage 3 (rank 1) share a weight. Rank 1's last B of
    # stage 3 comes before its B of stage 1 that rank 0 still waits for, so a barrier right after
    # it would deadlock; lower moves it.
    plan = family_plan("interleaved-1f1b", 2, 4)
    programs = lower(plan, tied=(("embed.weight", (0, 1)),))
    for program in programs:
        reduce_at = [s for s, i in enumerate(program.instructions) if i.kind is InstrKind.REDUCE_TIED]
        assert len(reduce_at) == 1 and program.instructions[reduce_at[0]].ranks == (0, 1)
    verify(programs, plan, serialized_pairs=True)


def test_tied_rejects_rank_without_stage():
    with pytest.raises(PlanError, match="holds no stage"):
        lower(family_plan("1f1b", 2, 2), tied=(("w", (0, 5)),))


def test_bad_links_and_infeasible_orders_are_plan_errors():
    plan = PipelinePlan.parse(ONE_F_ONE_B)
    with pytest.raises(PlanError, match="link"):
        lower(plan, {(1, 0)})
    stuck = PipelinePlan.parse(ONE_F_ONE_B.replace("device 1: 1F0 1B0", "device 1: 1B0 1F0").replace(
        "device 0: 0F0 0F1 0B0", "device 0: 0B0 0F0 0F1"))
    with pytest.raises(PlanError):
        lower(stuck)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("devices", [2, 3, 4])
def test_every_family_lowers_and_verifies(family, devices):
    plan = family_plan(family, devices, 5)
    verify(lower(plan), plan, serialized_pairs=True)


def _pair_sequences(programs):
    out = {}
    for program in programs:
        for i in program.instructions:
            if i.kind in COMM_KINDS:
                out.setdefault((program.rank, i.peer), []).append(message_of(i))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_plans(), st.integers(0, 3))
def test_random_plans_lower_and_verify(case, prefetch):
    plan, links = case
    programs = lower(plan, links, prefetch=prefetch)
    verify(programs, plan, links, serialized_pairs=True)
    # both ranks of every pair see the same operation sequence (NCCL-safe)
    sequences = _pair_sequences(programs)
    for (a, b), sequence in sequences.items():
        assert sequence == sequences[(b, a)]
    # a tag-matching transport: receives may move ahead of the rank's own sends; still matched
    # per direction and deadlock-free
    verify(lower(plan, links, prefetch=prefetch + 2, serialized_pairs=False), plan, links)
