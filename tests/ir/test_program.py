"""RankProgram / Instruction: text form round trip, parser errors, kinds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe import ParseError, RankProgram
from octopipe.ir.program import InstrKind, Instruction, format_programs, parse_programs

TEXT = """program rank=0 ranks=2
  recv_act stage=3 mb=0 peer=1 peer_stage=2
  forward stage=3 mb=0
  backward_input stage=3 mb=0
  send_grad stage=3 mb=0 peer=1 peer_stage=2
  backward_weight stage=3 mb=0
  reduce_tied param=embed.weight ranks=0,1
  step
program rank=1 ranks=2
  forward stage=2 mb=0
  send_act stage=2 mb=0 peer=0 peer_stage=3
  recv_grad stage=2 mb=0 peer=0 peer_stage=3
  backward stage=2 mb=0
  reduce_tied param=embed.weight ranks=0,1
  step
"""


def test_round_trip_exact():
    programs = parse_programs(TEXT)
    assert len(programs) == 2
    assert format_programs(programs) == TEXT
    assert RankProgram.parse(str(programs[1])) == programs[1]
    tied = programs[0].instructions[5]
    assert tied.kind is InstrKind.REDUCE_TIED and tied.param == "embed.weight" and tied.ranks == (0, 1)


def test_kind_predicates():
    send = Instruction(InstrKind.SEND_ACT, 0, 0, 1, 1)
    recv = Instruction(InstrKind.RECV_GRAD, 0, 0, 1, 1)
    compute = Instruction(InstrKind.BACKWARD_INPUT, 0, 0)
    assert send.is_send and not send.is_recv and not send.is_compute
    assert recv.is_recv and compute.is_compute
    assert str(Instruction(InstrKind.STEP)) == "step"


@pytest.mark.parametrize("text, message", [
    ("forward stage=0 mb=0", "before any 'program"),
    ("program rank=0 ranks=1\n  jump stage=0", "unknown instruction 'jump'"),
    ("program rank=0 ranks=1\n  forward stage=x mb=0", "must be an integer"),
    ("program rank=0 ranks=1\n  forward stage=0 mb=0 color=red", "unknown field"),
    ("program rank=0\n  step", "missing field 'ranks'"),
])
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(ParseError, match=message):
        parse_programs(text)


def test_parse_one_requires_one():
    with pytest.raises(ParseError, match="expected one program"):
        RankProgram.parse(TEXT)


instructions = st.builds(
    Instruction,
    kind=st.sampled_from(list(InstrKind)),
    stage=st.none() | st.integers(0, 50),
    microbatch=st.none() | st.integers(0, 500),
    peer=st.none() | st.integers(0, 16),
    peer_stage=st.none() | st.integers(0, 50),
    param=st.none() | st.from_regex(r"[a-z_][a-z0-9_.]{0,20}", fullmatch=True),
    ranks=st.lists(st.integers(0, 16), max_size=4).map(tuple),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(instructions, max_size=12), st.integers(0, 7))
def test_any_program_round_trips(body, rank):
    program = RankProgram(rank, 8, tuple(body))
    assert RankProgram.parse(str(program)) == program
