"""PipelinePlan / Op / Stage: text form, parser, JSON, torch CSV, structural validation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe import ParseError, PipelinePlan, PlanError
from octopipe.ir.plan import B, F, Op, OpKind, W, render_grid

DESIGN_EXAMPLE = """plan devices=2 microbatches=1 stages=4
stage 0 layers=0:3 device=0
stage 1 layers=3:7 device=1
stage 2 layers=7:9 device=1
stage 3 layers=9:12 device=0
device 0: 0F0 3F0 3B0 3W0 0B0 0W0
device 1: 1F0 2F0 2B0 1B0 1W0
"""


def test_design_example_round_trips_exactly():
    plan = PipelinePlan.parse(DESIGN_EXAMPLE)
    assert str(plan) == DESIGN_EXAMPLE
    assert plan.placement == (0, 1, 1, 0)
    assert plan.boundaries == (0, 3, 7, 9, 12)
    assert plan.stages_of(1) == (1, 2)
    assert plan.split_backward() == {(3, 0), (0, 0), (1, 0)}
    plan.validate(num_layers=12)


def test_op_text_is_pytorch_action_notation():
    assert str(Op(2, OpKind.F, 0)) == "2F0"
    assert Op.parse("12W34") == W(12, 34)
    with pytest.raises(ParseError, match="expected <stage><F|B|W><microbatch>"):
        Op.parse("2I0")


@st.composite
def plans(draw):
    num_devices = draw(st.integers(1, 5))
    num_micro = draw(st.integers(1, 6))
    num_stages = draw(st.integers(1, 7))
    sizes = draw(st.lists(st.integers(1, 4), min_size=num_stages, max_size=num_stages))
    placement = draw(st.lists(st.integers(0, num_devices - 1), min_size=num_stages, max_size=num_stages))
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    device_ops = [[] for _ in range(num_devices)]
    for s in range(num_stages):
        for m in range(num_micro):
            for op in (F(s, m), B(s, m)) + ((W(s, m),) if draw(st.booleans()) else ()):
                device_ops[placement[s]].append(op)
    return PipelinePlan.build(num_micro, bounds, placement, device_ops, num_devices=num_devices)


@given(plans())
@settings(max_examples=200, deadline=None)
def test_text_and_json_round_trip(plan):
    assert PipelinePlan.parse(str(plan)) == plan
    assert PipelinePlan.from_json(plan.to_json()) == plan


@given(plans())
@settings(max_examples=100, deadline=None)
def test_torch_csv_round_trip(plan):
    if any(not ops for ops in plan.device_ops):
        return  # a device with no stage has no row content; torch infers placement from rows
    text = plan.to_torch_csv()
    assert PipelinePlan.from_torch_csv(text, plan.boundaries) == plan
    # B of a split pair is PyTorch's I (input gradient); a full backward stays B
    for row, ops in zip(text.splitlines(), plan.device_ops):
        for cell, op in zip(row.split(","), ops):
            if op.kind is OpKind.B:
                assert cell[len(str(op.stage))] == ("I" if (op.stage, op.microbatch) in plan.split_backward() else "B")


def test_parse_errors_name_the_line():
    with pytest.raises(ParseError, match="line 1"):
        PipelinePlan.parse("plan devices=x")
    with pytest.raises(ParseError, match="line 2: expected 'stage S layers=A:B device=D'"):
        PipelinePlan.parse("plan devices=1 microbatches=1 stages=1\nstage zero\n")
    with pytest.raises(ParseError, match="stages=2, found 1"):
        PipelinePlan.parse("plan devices=1 microbatches=1 stages=2\nstage 0 layers=0:1 device=0\ndevice 0: 0F0 0B0\n")
    with pytest.raises(ParseError, match="line 3: bad op"):
        PipelinePlan.parse("plan devices=1 microbatches=1 stages=1\nstage 0 layers=0:1 device=0\ndevice 0: 0F0 0X0\n")
    with pytest.raises(ParseError, match="malformed"):
        PipelinePlan.from_json('{"num_devices": 1}')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stage 0 layers=0:2 device=0\nstage 1 layers=3:4 device=1", "expected a non-empty range starting at 2"),
        ("stage 0 layers=0:2 device=0\nstage 1 layers=2:4 device=5", "devices are 0..1"),
    ],
)
def test_validate_partition(text, message):
    plan = PipelinePlan.parse(f"plan devices=2 microbatches=1 stages=2\n{text}\ndevice 0: 0F0 0B0\ndevice 1: 1F0 1B0\n")
    with pytest.raises(PlanError, match=message):
        plan.validate()


def test_validate_ops_marks_the_failing_step():
    head = "plan devices=2 microbatches=1 stages=2\nstage 0 layers=0:2 device=0\nstage 1 layers=2:4 device=1\n"
    wrong_device = PipelinePlan.parse(head + "device 0: 0F0 1F0 0B0\ndevice 1: 1B0\n")
    with pytest.raises(PlanError, match=r"device 0 step 1: op 1F0 belongs to stage 1, which is placed on device 1") as info:
        wrong_device.validate()
    assert "<-- ERROR HERE" in str(info.value)
    with pytest.raises(PlanError, match="runs before its forward"):
        PipelinePlan.parse(head + "device 0: 0B0 0F0\ndevice 1: 1F0 1B0\n").validate()
    with pytest.raises(PlanError, match="op 1B0 is missing"):
        PipelinePlan.parse(head + "device 0: 0F0 0B0\ndevice 1: 1F0\n").validate()
    with pytest.raises(PlanError, match="appears twice"):
        PipelinePlan.parse(head + "device 0: 0F0 0B0 0B0\ndevice 1: 1F0 1B0\n").validate()
    with pytest.raises(PlanError, match="model has 5 layers"):
        PipelinePlan.parse(head + "device 0: 0F0 0B0\ndevice 1: 1F0 1B0\n").validate(num_layers=5)


def test_render_grid_is_device_columns_step_rows():
    grid = render_grid(((F(0, 0), B(0, 0)), (F(1, 0),)), mark=(1, 0))
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "device", "0", "device", "1"]
    assert "[1F0]" in lines[1] and lines[1].endswith("<-- ERROR HERE (device 1)")
    assert lines[2].split() == ["1", "0B0"]


def test_a_hand_edited_json_plan_is_refused_not_coerced(tmp_path):
    # found by a CLI sweep: int() truncated 1.5 to 1, a third boundary was dropped, "1" and 2.0
    # were taken as numbers and unknown keys were ignored
    import json

    from octopipe.api import load_plan

    good = {"num_devices": 2, "num_microbatches": 1, "stages": [{"layers": [0, 1], "device": 0},
                                                                 {"layers": [1, 2], "device": 1}],
            "device_ops": [["0F0", "0B0"], ["1F0", "1B0"]]}
    assert PipelinePlan.from_dict(good).num_stages == 2
    for change, expected in (
        (lambda d: d["stages"][0].update(layers=[0, 1.5]), "layers must be an integer, got 1.5"),
        (lambda d: d["stages"][0].update(layers=[0, 1, 2]), r"layers must be \[start, end\]"),
        (lambda d: d["stages"][1].update(device="1"), "device must be an integer, got '1'"),
        (lambda d: d.update(num_microbatches=1.0), "num_microbatches must be an integer, got 1.0"),
        (lambda d: d.update(colour="red"), r"unknown key\(s\) \['colour'\]"),
        (lambda d: d["stages"][0].update(dev=0), "stage 0: expected"),
    ):
        data = json.loads(json.dumps(good))
        change(data)
        with pytest.raises(ParseError, match=expected):
            PipelinePlan.from_dict(data)
    # a .json file that is not JSON says so (it was read as the text form)
    path = tmp_path / "plan.json"
    path.write_text("[1, 2]")
    with pytest.raises(ParseError, match=r"plan.json: plan JSON is a list"):
        load_plan(path)
