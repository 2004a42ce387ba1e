"""RankProgram: the instruction list one rank executes (IR level 4).

Produced by `passes/lower.py` from a PipelinePlan; checked by `passes/verify.py`; run by
`runtime/engine.py`. Instructions, each naming stage, microbatch and (for communication) the peer
rank and the peer's stage:

    recv_act        post a receive of the activations stage `stage` needs from `peer_stage`
    forward         run stage `stage` forward on microbatch `microbatch`
    send_act        send stage `stage`'s outputs that `peer_stage` reads
    recv_grad       post a receive of the gradients of stage `stage`'s outputs from `peer_stage`
    backward        full backward (input and weight gradients)
    backward_input  input gradients only (zero-bubble B)
    backward_weight weight gradients only (zero-bubble W)
    send_grad       send the gradients of stage `stage`'s inputs that came from `peer_stage`
    reduce_tied     all-reduce the gradient of tied parameter `param` among `ranks`
    step            end of the iteration (loss reduction)

Text form: `program rank=R ranks=N` then one instruction per line, `kind key=value ...`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from octopipe.errors import ParseError
from octopipe.ir.text import FieldReader, format_fields, parse_fields, record


class InstrKind(str, Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_GRAD = "send_grad"
    REDUCE_TIED = "reduce_tied"
    STEP = "step"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({InstrKind.FORWARD, InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT})
SEND_KINDS = frozenset({InstrKind.SEND_ACT, InstrKind.SEND_GRAD})
RECV_KINDS = frozenset({InstrKind.RECV_ACT, InstrKind.RECV_GRAD})
COMM_KINDS = SEND_KINDS | RECV_KINDS


@dataclass(frozen=True, slots=True)
class Instruction:
    kind: InstrKind
    stage: int | None = None
    microbatch: int | None = None
    peer: int | None = None
    """The other rank of a send or receive."""
    peer_stage: int | None = None
    """The stage on the other rank whose tensors this message carries."""
    param: str | None = None
    """reduce_tied: the tied parameter's qualified name."""
    ranks: tuple[int, ...] = ()
    """reduce_tied: the ranks that hold a copy of it."""

    def __str__(self) -> str:
        fields: list[tuple[str, object]] = []
        if self.stage is not None:
            fields.append(("stage", self.stage))
        if self.microbatch is not None:
            fields.append(("mb", self.microbatch))
        if self.peer is not None:
            fields.append(("peer", self.peer))
        if self.peer_stage is not None:
            fields.append(("peer_stage", self.peer_stage))
        if self.param is not None:
            fields.append(("param", self.param))
        if self.ranks:
            fields.append(("ranks", ",".join(map(str, self.ranks))))
        return f"{self.kind.value} {format_fields(fields)}".rstrip()

    @classmethod
    def parse(cls, line: str, number: int = 0) -> Instruction:
        keyword, tokens, where = record("instruction", line, number)
        try:
            kind = InstrKind(keyword)
        except ValueError:
            raise ParseError(f"{where}: unknown instruction {keyword!r}; expected one of {[k.value for k in InstrKind]}") from None
        r = FieldReader(parse_fields(tokens, where), where)
        instruction = cls(
            kind,
            stage=r.optional_int("stage"),
            microbatch=r.optional_int("mb"),
            peer=r.optional_int("peer"),
            peer_stage=r.optional_int("peer_stage"),
            param=r.str("param", required=False) or None,
            ranks=r.ints("ranks"),
        )
        r.done()
        return instruction

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS


@dataclass(frozen=True, slots=True)
class RankProgram:
    rank: int
    num_ranks: int
    instructions: tuple[Instruction, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "instructions", tuple(self.instructions))

    def __str__(self) -> str:
        lines = [f"program rank={self.rank} ranks={self.num_ranks}"]
        lines += [f"  {instruction}" for instruction in self.instructions]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> RankProgram:
        programs = parse_programs(text)
        if len(programs) != 1:
            raise ParseError(f"expected one program, found {len(programs)}")
        return programs[0]


def format_programs(programs: Iterable[RankProgram]) -> str:
    return "".join(str(program) for program in programs)


def parse_programs(text: str) -> tuple[RankProgram, ...]:
    """Parse one or more `program rank=...` blocks."""
    programs: list[RankProgram] = []
    header: tuple[int, int] | None = None
    body: list[Instruction] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("program "):
            if header is not None:
                programs.append(RankProgram(header[0], header[1], tuple(body)))
            where = f"line {number}"
            r = FieldReader(parse_fields(line.split()[1:], where), where)
            header, body = (r.int("rank"), r.int("ranks")), []
            r.done()
        else:
            if header is None:
                raise ParseError(f"line {number}: instruction before any 'program rank=R ranks=N' header")
            body.append(Instruction.parse(line, number))
    if header is not None:
        programs.append(RankProgram(header[0], header[1], tuple(body)))
    return tuple(programs)
