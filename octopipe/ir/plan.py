"""Stage, Op and PipelinePlan: partition + placement + per-device op order (IR level 3).

Glossary: a *stage* is a contiguous half-open range of layers run on one device; stages are
numbered in data-flow order (stage s feeds stage s+1). A *device* runs one or more stages (more
stages than devices = looped/interleaved/V placements). A *microbatch* is one equal slice of the
batch. An *op* is `F` (forward), `B` (input gradient; a full backward when the stage/microbatch
has no W op) or `W` (weight gradient) of one stage and microbatch, written `2F0` as in PyTorch.

Text form (exact; `PipelinePlan.parse` is the inverse of `str`):
    plan devices=2 microbatches=4 stages=4
    stage 0 layers=0:3 device=0
    device 0: 0F0 0F1 ...
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from octopipe.errors import ParseError, PlanError


class OpKind(str, Enum):
    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value


_COUNT = r"([0-9]{1,18})"  # an index or count in plan text: ASCII digits, at most 18 (a 64-bit int)
_OP_PATTERN = re.compile(rf"^{_COUNT}([FBW]){_COUNT}$")


@dataclass(frozen=True, slots=True, order=True)
class Op:
    stage: int
    kind: OpKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Op:
        match = _OP_PATTERN.match(text.strip())
        if not match:
            raise ParseError(f"bad op {text!r}: expected <stage><F|B|W><microbatch>, e.g. 2F0")
        return cls(int(match.group(1)), OpKind(match.group(2)), int(match.group(3)))


def F(stage: int, microbatch: int) -> Op:
    return Op(stage, OpKind.F, microbatch)


def B(stage: int, microbatch: int) -> Op:
    return Op(stage, OpKind.B, microbatch)


def W(stage: int, microbatch: int) -> Op:
    return Op(stage, OpKind.W, microbatch)


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    layer_start: int
    layer_end: int
    device: int
    recompute: bool = False
    """Activation recomputation: F keeps only the stage's inputs, B runs
    the forward again first (B costs one more F; between F and B the stage holds those instead of
    its activations)."""
    selective: bool = False
    """Selective recomputation (op-level selective activation checkpointing): F keeps the
    outputs of the compute-heavy ops (matmuls, attention, convolutions) and B recomputes the
    cheap ones (norms, activations, elementwise, embedding lookups) from them first
    (`LayerCost.selective_activation_bytes` held, `selective_recompute_ms` more B). Not with
    `recompute`."""

    def __post_init__(self) -> None:
        if self.recompute and self.selective:
            raise PlanError(f"stage {self.index}: both recompute and selective; a stage recomputes all its "
                            "activations (recompute) or the cheap ones (selective), not both")

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def __str__(self) -> str:
        text = f"stage {self.index} layers={self.layer_start}:{self.layer_end} device={self.device}"
        return text + (" recompute" if self.recompute else " selective" if self.selective else "")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_flags(name: str, flags: object) -> None:
    """Per-stage flags are a sequence of booleans (a string or None is a mistake)."""
    if not isinstance(flags, Sequence) or isinstance(flags, str) or not all(isinstance(f, (bool, int)) for f in flags):
        raise PlanError(f"with_recompute: {name} must be a list of per-stage booleans, got {flags!r:.60}")


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    num_devices: int
    num_microbatches: int
    stages: tuple[Stage, ...]
    device_ops: tuple[tuple[Op, ...], ...]
    """device_ops[d] = the ops device d runs, in order."""
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "device_ops", tuple(tuple(ops) for ops in self.device_ops))
        if len(self.device_ops) != self.num_devices:
            raise PlanError(f"plan has {len(self.device_ops)} device op lists for devices={self.num_devices}")

    @classmethod
    def build(
        cls,
        num_microbatches: int,
        partition: Sequence[int] | Sequence[tuple[int, int]],
        placement: Sequence[int],
        device_ops: Sequence[Iterable[Op]],
        num_devices: int | None = None,
        recompute: Sequence[bool] = (),
        selective: Sequence[bool] = (),
    ) -> PipelinePlan:
        """Convenience constructor. `partition` is either boundaries [0, b1, ..., num_layers] or
        (start, end) pairs; `placement[s]` is stage s's device; `recompute[s]` whether stage s
        recomputes its activations, `selective[s]` whether it recomputes the cheap ones (empty:
        none does)."""
        ranges: list[tuple[int, int]]
        if partition and isinstance(partition[0], tuple):
            ranges = list(cast("Sequence[tuple[int, int]]", partition))
        else:
            bounds = list(cast("Sequence[int]", partition))
            ranges = list(zip(bounds[:-1], bounds[1:]))
        if len(ranges) != len(placement):
            raise PlanError(f"{len(ranges)} stage layer ranges but {len(placement)} stage devices")
        if recompute and len(recompute) != len(ranges):
            raise PlanError(f"{len(ranges)} stage layer ranges but {len(recompute)} recompute flags")
        if selective and len(selective) != len(ranges):
            raise PlanError(f"{len(ranges)} stage layer ranges but {len(selective)} selective flags")
        flags = tuple(bool(r) for r in recompute) or (False,) * len(ranges)
        cheap = tuple(bool(r) for r in selective) or (False,) * len(ranges)
        stages = tuple(Stage(i, a, b, d, r, c)
                       for i, ((a, b), d, r, c) in enumerate(zip(ranges, placement, flags, cheap)))
        devices = num_devices if num_devices is not None else len(device_ops)
        return cls(devices, num_microbatches, stages, tuple(tuple(ops) for ops in device_ops))

    # -- views --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end if self.stages else 0

    @property
    def placement(self) -> tuple[int, ...]:
        return tuple(stage.device for stage in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        return (0, *(stage.layer_end for stage in self.stages))

    @property
    def recompute(self) -> tuple[bool, ...]:
        """Per stage: whether it recomputes its activations at B."""
        return tuple(stage.recompute for stage in self.stages)

    @property
    def selective(self) -> tuple[bool, ...]:
        """Per stage: whether it recomputes its cheap ops' outputs at B (selective recomputation)."""
        return tuple(stage.selective for stage in self.stages)

    def stages_of(self, device: int) -> tuple[int, ...]:
        return tuple(stage.index for stage in self.stages if stage.device == device)

    def split_backward(self) -> frozenset[tuple[int, int]]:
        """(stage, microbatch) pairs that have a separate W op (their B is input-gradient only)."""
        cached = self._cache.get("split")
        if cached is None:
            cached = self._cache["split"] = frozenset(
                (op.stage, op.microbatch) for ops in self.device_ops for op in ops if op.kind is OpKind.W
            )
        return cached

    def num_ops(self) -> int:
        return sum(len(ops) for ops in self.device_ops)

    def with_ops(self, device_ops: Sequence[Iterable[Op]]) -> PipelinePlan:
        return PipelinePlan(self.num_devices, self.num_microbatches, self.stages, tuple(tuple(o) for o in device_ops))

    def with_recompute(self, recompute: Sequence[bool], selective: Sequence[bool] | None = None) -> PipelinePlan:
        """The same plan with these per-stage recomputation flags (and selective ones; None: none
        where `recompute` is set, the plan's own elsewhere)."""
        _check_flags("recompute", recompute)
        if selective is not None:
            _check_flags("selective", selective)
        if len(recompute) != self.num_stages:
            raise PlanError(f"{len(recompute)} recompute flags for a plan of {self.num_stages} stages")
        if selective is None:
            selective = [s.selective and not r for s, r in zip(self.stages, recompute)]
        if len(selective) != self.num_stages:
            raise PlanError(f"{len(selective)} selective flags for a plan of {self.num_stages} stages")
        stages = tuple(Stage(s.index, s.layer_start, s.layer_end, s.device, bool(r), bool(c))
                       for s, r, c in zip(self.stages, recompute, selective))
        return PipelinePlan(self.num_devices, self.num_microbatches, stages, self.device_ops)

    # -- structural check -----------------------------------------------------------------------
    def validate(self, num_layers: int | None = None) -> None:
        """Raise PlanError unless the partition covers the layers in order, every stage sits on an
        existing device, and each (stage, microbatch) has exactly one F and one B, at most one W,
        all on the stage's device, with F before B before W there."""
        for name, value in (("num_devices", self.num_devices), ("num_microbatches", self.num_microbatches)):
            if not _is_int(value):
                raise PlanError(f"plan {name} must be an integer, got {value!r:.40}")
        if self.num_devices < 1 or self.num_microbatches < 1:
            raise PlanError(f"plan needs devices >= 1 and microbatches >= 1, got {self.num_devices}, {self.num_microbatches}")
        if not self.stages:
            raise PlanError("plan has no stages")
        expected_start = 0
        for position, stage in enumerate(self.stages):
            if not isinstance(stage, Stage) or not all(map(_is_int, (stage.index, stage.layer_start, stage.layer_end,
                                                                     stage.device))):
                raise PlanError(f"stage at position {position} must be a Stage of integers (PipelinePlan.build makes "
                                f"them), got {stage!r:.80}")
            if stage.index != position:
                raise PlanError(f"stage at position {position} is numbered {stage.index}; stages must be numbered 0, 1, ...")
            if stage.layer_start != expected_start or stage.layer_end <= stage.layer_start:
                raise PlanError(
                    f"stage {stage.index} has layers {stage.layer_start}:{stage.layer_end}; expected a non-empty range "
                    f"starting at {expected_start} (stages cover the layers contiguously, in order)"
                )
            if not 0 <= stage.device < self.num_devices:
                raise PlanError(f"stage {stage.index} is placed on device {stage.device}; devices are 0..{self.num_devices - 1}")
            expected_start = stage.layer_end
        if num_layers is not None and expected_start != num_layers:
            raise PlanError(f"stages cover layers 0:{expected_start} but the model has {num_layers} layers")
        seen: dict[Op, tuple[int, int]] = {}
        for device, ops in enumerate(self.device_ops):
            for step, op in enumerate(ops):
                if not isinstance(op, Op) or not isinstance(op.kind, OpKind) or not _is_int(op.stage) \
                        or not _is_int(op.microbatch):
                    raise PlanError(f"device {device} step {step}: {op!r:.40} is not an Op (Op.parse('0F0'), or "
                                    "F(stage, microbatch), B(...), W(...))")
                where = (device, step)
                if not 0 <= op.stage < self.num_stages or not 0 <= op.microbatch < self.num_microbatches:
                    raise PlanError(
                        f"device {device} step {step}: op {op} names a stage or microbatch outside "
                        f"stages 0..{self.num_stages - 1}, microbatches 0..{self.num_microbatches - 1}\n"
                        + render_grid(self.device_ops, mark=where)
                    )
                if self.stages[op.stage].device != device:
                    raise PlanError(
                        f"device {device} step {step}: op {op} belongs to stage {op.stage}, which is placed on device "
                        f"{self.stages[op.stage].device}\n" + render_grid(self.device_ops, mark=where)
                    )
                if op in seen:
                    raise PlanError(
                        f"device {device} step {step}: op {op} appears twice (first at device {seen[op][0]} step {seen[op][1]})\n"
                        + render_grid(self.device_ops, mark=where)
                    )
                if op.kind is OpKind.B and F(op.stage, op.microbatch) not in seen:
                    raise PlanError(f"device {device} step {step}: {op} runs before its forward\n" + render_grid(self.device_ops, mark=where))
                if op.kind is OpKind.W and B(op.stage, op.microbatch) not in seen:
                    raise PlanError(f"device {device} step {step}: {op} runs before its B\n" + render_grid(self.device_ops, mark=where))
                seen[op] = where
        for stage_index in range(self.num_stages):
            for microbatch in range(self.num_microbatches):
                for op in (F(stage_index, microbatch), B(stage_index, microbatch)):
                    if op not in seen:
                        raise PlanError(
                            f"op {op} is missing: stage {stage_index} microbatch {microbatch} needs one F and one B on "
                            f"device {self.stages[stage_index].device}\n" + render_grid(self.device_ops)
                        )

    # -- text form ----------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"plan devices={self.num_devices} microbatches={self.num_microbatches} stages={self.num_stages}"]
        lines += [str(stage) for stage in self.stages]
        lines += [f"device {d}: " + " ".join(str(op) for op in ops) for d, ops in enumerate(self.device_ops)]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> PipelinePlan:
        if not isinstance(text, str):
            raise ParseError(f"plan text must be a string (PipelinePlan.parse(path.read_text())), got "
                             f"{type(text).__name__}")
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines:
            raise ParseError("plan text is empty")
        number, head = lines[0]
        match = re.fullmatch(rf"plan devices={_COUNT} microbatches={_COUNT} stages={_COUNT}", head)
        if not match:
            raise ParseError(f"line {number}: expected 'plan devices=N microbatches=M stages=S' (counts of at most 18 "
                             f"digits), got {head!r:.80}")
        num_devices, num_microbatches, num_stages = (int(g) for g in match.groups())
        stages: list[Stage] = []
        device_ops: dict[int, tuple[Op, ...]] = {}
        for number, line in lines[1:]:
            if line.startswith("stage "):
                match = re.fullmatch(rf"stage {_COUNT} layers={_COUNT}:{_COUNT} device={_COUNT}( recompute| selective)?", line)
                if not match:
                    raise ParseError(f"line {number}: expected 'stage S layers=A:B device=D' (and ' recompute' where the "
                                     f"stage recomputes its activations, ' selective' where it recomputes the cheap "
                                     f"ones), got {line!r}")
                index, layer_start, layer_end, stage_device = (int(g) for g in match.groups()[:4])
                stages.append(Stage(index, layer_start, layer_end, stage_device, recompute=match.group(5) == " recompute",
                                    selective=match.group(5) == " selective"))
            elif line.startswith("device "):
                match = re.fullmatch(rf"device {_COUNT}:(.*)", line)
                if not match:
                    raise ParseError(f"line {number}: expected 'device D: ops...', got {line!r}")
                device = int(match.group(1))
                if device in device_ops:
                    raise ParseError(f"line {number}: device {device} listed twice")
                try:
                    device_ops[device] = tuple(Op.parse(token) for token in match.group(2).split())
                except ParseError as exc:
                    raise ParseError(f"line {number}: {exc}") from None
            else:
                raise ParseError(f"line {number}: expected a 'stage' or 'device' line, got {line!r}")
        if len(stages) != num_stages:
            raise ParseError(f"plan header says stages={num_stages}, found {len(stages)} stage lines")
        if len(device_ops) != num_devices or sorted(device_ops) != list(range(num_devices)):
            raise ParseError(f"plan header says devices={num_devices}, found device lines {sorted(device_ops)}")
        return cls(num_devices, num_microbatches, tuple(stages), tuple(device_ops[d] for d in range(num_devices)))

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_devices": self.num_devices,
            "num_microbatches": self.num_microbatches,
            "stages": [{"layers": [s.layer_start, s.layer_end], "device": s.device}
                       | ({"recompute": True} if s.recompute else {}) | ({"selective": True} if s.selective else {})
                       for s in self.stages],
            "device_ops": [[str(op) for op in ops] for ops in self.device_ops],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: Any) -> PipelinePlan:
        """The JSON form: keys num_devices, num_microbatches, stages [{layers: [start, end],
        device, optional recompute, optional selective}], device_ops; anything else (but `planned_with`, what
        `octopipe plan -o` stores beside it) is refused, and numbers must be integers."""
        expected = ("expected keys num_devices, num_microbatches, stages[{layers, device, optional recompute, "
                    "optional selective}], "
                    "device_ops")
        if not isinstance(data, dict):
            raise ParseError(f"plan JSON is a {type(data).__name__}, not an object; {expected}")
        unknown = sorted(set(data) - {"num_devices", "num_microbatches", "stages", "device_ops", "planned_with"})
        if unknown:
            raise ParseError(f"plan JSON has unknown key(s) {unknown}; {expected}")
        try:
            stages = []
            for i, raw in enumerate(data["stages"]):
                where = f"plan JSON stage {i}"
                if not isinstance(raw, dict) or sorted(set(raw) - {"recompute", "selective"}) != ["device", "layers"]:
                    raise ParseError(f"{where}: expected {{layers: [start, end], device, optional recompute, optional "
                                     f"selective}}, got {raw!r}")
                if not isinstance(raw["layers"], list) or len(raw["layers"]) != 2:
                    raise ParseError(f"{where}: layers must be [start, end], got {raw['layers']!r}")
                start, end = (_integer(value, f"{where} layers") for value in raw["layers"])
                stages.append(Stage(i, start, end, _integer(raw["device"], f"{where} device"),
                                    _flag(raw.get("recompute", False)), _flag(raw.get("selective", False))))
            device_ops = tuple(tuple(Op.parse(op) for op in ops) for ops in data["device_ops"])
            return cls(_integer(data["num_devices"], "plan JSON num_devices"),
                       _integer(data["num_microbatches"], "plan JSON num_microbatches"), tuple(stages), device_ops)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            raise ParseError(f"plan JSON is malformed ({type(exc).__name__}: {exc}); {expected}") from None

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ParseError(f"plan JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise ParseError("plan JSON: nested too deeply to read") from None
        return cls.from_dict(data)

    # -- torch.distributed.pipelining interop ---------------------------------------------------
    def to_torch_csv(self) -> str:
        """PyTorch's compute-only schedule CSV: one row per rank, actions `2F0`, `2I0` (input
        gradient), `2W0`, `2B0` (full backward). Our B maps to I when the pair has a W. The CSV
        cannot say that a stage recomputes its activations: such a plan is refused, not exported
        without it."""
        recomputing = [s.index for s in self.stages if s.recompute or s.selective]
        if recomputing:
            raise PlanError(f"stages {recomputing} recompute their activations, which PyTorch's schedule CSV cannot "
                            "express; export plan.with_recompute([False] * plan.num_stages, [False] * plan.num_stages) "
                            "to run it without")
        split = self.split_backward()
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        for ops in self.device_ops:
            row = []
            for op in ops:
                if op.kind is OpKind.B and (op.stage, op.microbatch) in split:
                    row.append(f"{op.stage}I{op.microbatch}")
                else:
                    row.append(str(op))
            writer.writerow(row)
        return buffer.getvalue()

    @classmethod
    def from_torch_csv(cls, text: str, partition: Sequence[int]) -> PipelinePlan:
        """Read PyTorch's compute-only CSV (rows = ranks). `partition` gives the layer boundaries
        [0, b1, ..., num_layers] of its stages; placement comes from the rows."""
        device_ops: list[tuple[Op, ...]] = []
        placement: dict[int, int] = {}
        num_microbatches = 0
        for rank, row in enumerate(csv.reader(io.StringIO(text))):
            ops = []
            for cell in row:
                cell = cell.strip()
                if not cell:
                    continue  # PyTorch writes empty cells for idle steps
                match = re.fullmatch(rf"{_COUNT}([FIBW]){_COUNT}", cell)
                if not match:
                    raise ParseError(f"torch CSV row {rank}: unsupported action {cell!r}; only F, I, B, W compute actions import")
                stage, kind, microbatch = int(match.group(1)), match.group(2), int(match.group(3))
                if placement.setdefault(stage, rank) != rank:
                    raise ParseError(f"torch CSV: stage {stage} appears on ranks {placement[stage]} and {rank}")
                ops.append(Op(stage, OpKind.B if kind == "I" else OpKind(kind), microbatch))
                num_microbatches = max(num_microbatches, microbatch + 1)
            device_ops.append(tuple(ops))
        num_stages = len(partition) - 1
        if sorted(placement) != list(range(num_stages)):
            raise ParseError(f"torch CSV has stages {sorted(placement)} but the partition has {num_stages} stages")
        return cls.build(num_microbatches, partition, [placement[s] for s in range(num_stages)], device_ops)


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParseError(f"{where} must be an integer, got {value!r}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"recompute must be true or false, got {value!r}")
    return value


def render_grid(device_ops: Sequence[Sequence[object]], mark: tuple[int, int] | None = None, max_steps: int = 400) -> str:
    """The device x step grid (rows = steps, one column per device), PyTorch style, with
    `<-- ERROR HERE` after the step that holds the marked (device, step) cell."""
    num_devices = len(device_ops)
    steps = min(max((len(ops) for ops in device_ops), default=0), max_steps)
    cells = [[str(ops[step]) if step < len(ops) else "" for ops in device_ops] for step in range(steps)]
    width = max([len(f"device {num_devices - 1}"), *(len(c) for row in cells for c in row)]) + 1
    header = "step  " + "".join(f"device {d}".ljust(width) for d in range(num_devices))
    lines = [header]
    for step, row in enumerate(cells):
        text = f"{step:<5} " + "".join(
            (("[" + c + "]") if mark == (d, step) else c).ljust(width) for d, c in enumerate(row)
        )
        if mark is not None and mark[1] == step:
            text = text.rstrip() + f"   <-- ERROR HERE (device {mark[0]})"
        lines.append(text.rstrip())
    return "\n".join(lines)
