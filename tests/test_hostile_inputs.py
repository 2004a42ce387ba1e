"""Bad and hostile inputs to the Python API and its file loaders (stop 24's sweep): each is an
OctopipeError that names the problem, quickly, never a raw Python exception or a hang."""

import json
from pathlib import Path

import pytest

import octopipe
from octopipe import ClusterSpec, CostTable, LayerCost, PipelinePlan
from octopipe.errors import ArgumentError, ClusterSpecError, CostTableError, ParseError, PlanError
from octopipe.ir.plan import B, F

PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"
LAYERS = [LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=100, output_bytes=10) for i in range(4)]


@pytest.mark.timeout(60)
def test_files_that_would_exhaust_the_machine_are_refused(tmp_path):
    # YAML aliases ("billion laughs": 368 bytes that expand into 9**9 values)
    laughs = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))
    (tmp_path / "laughs.yaml").write_text(laughs + "weight_fraction: *i\nlayers: [{forward_ms: 1, backward_ms: 1}]\n")
    with pytest.raises(CostTableError, match="aliases"):
        CostTable.load(tmp_path / "laughs.yaml")
    (tmp_path / "laughs_cluster.yaml").write_text(laughs + "name: *i\n")
    with pytest.raises(ClusterSpecError, match="aliases"):
        ClusterSpec.load(tmp_path / "laughs_cluster.yaml")
    # an endless file (a device, or a wrong path's huge log) is not read to the end
    with pytest.raises(CostTableError, match="larger than"):
        CostTable.load("/dev/zero")
    (tmp_path / "list_name.yaml").write_text("name: [1, 2]\nnum_devices: 2\n")
    with pytest.raises(ClusterSpecError, match="name must be a string"):
        ClusterSpec.load(tmp_path / "list_name.yaml")
    # a plan header promising ten billion devices
    (tmp_path / "huge.plan").write_text("plan devices=10000000000 microbatches=1 stages=0\n")
    with pytest.raises(ParseError, match="devices=10000000000"):
        octopipe.api.load_plan(tmp_path / "huge.plan")
    with pytest.raises(ParseError, match="at most 18"):
        PipelinePlan.parse("plan devices=1 microbatches=1 stages=" + "9" * 5000)
    # nesting deeper than Python's parser goes
    deep = "[" * 100000 + "]" * 100000
    for name, load, error in (("c.json", CostTable.load, CostTableError), ("c.yaml", CostTable.load, CostTableError),
                              ("p.json", octopipe.profiles.load_profile, CostTableError),
                              ("plan.json", octopipe.api.load_plan, ParseError)):
        (tmp_path / name).write_text(deep)
        with pytest.raises(error, match="nested too deeply|not valid"):
            load(tmp_path / name)


def test_text_that_is_not_utf8_says_so(tmp_path):
    path = tmp_path / "u16.json"
    path.write_bytes('{"num_devices": 2}'.encode("utf-16"))
    for load, error in ((CostTable.load, CostTableError), (ClusterSpec.load, ClusterSpecError),
                        (octopipe.profiles.load_profile, CostTableError), (octopipe.api.load_plan, ParseError),
                        (octopipe.api.load_saved_plan, ParseError)):
        with pytest.raises(error, match="not UTF-8"):
            load(path)


def test_numbers_too_large_for_a_float_are_refused_where_they_enter(tmp_path):
    layers = [layer.to_dict() for layer in LAYERS]
    layers[1]["activation_bytes"] = 10**400
    (tmp_path / "big.json").write_text(json.dumps({"layers": layers}))
    with pytest.raises(CostTableError, match="below 2\\*\\*62"):
        CostTable.load(tmp_path / "big.json")
    costs = CostTable(LAYERS)
    with pytest.raises(ArgumentError, match="memory_limit_bytes"):
        octopipe.plan(costs, "cpux2", 4, time_limit_s=2, quiet=True, memory_limit_bytes=10**400)
    with pytest.raises(ArgumentError, match="activation_limit"):
        octopipe.plan(costs, "cpux2", 4, time_limit_s=2, quiet=True, activation_limit=10**400)
    with pytest.raises(ClusterSpecError, match="memory_bytes"):
        ClusterSpec(num_devices=2, memory_bytes=10**400)
    with pytest.raises(ArgumentError, match="32-bit"):  # CP-SAT's seed
        octopipe.plan(costs, "cpux2", 4, time_limit_s=2, quiet=True, seed=2**31)


def test_wrong_types_are_typed_errors():
    plan_ = octopipe.schedules.build("1f1b", CostTable(LAYERS), ClusterSpec.preset("cpux2"), 4)
    cases = [
        (lambda: CostTable(LAYERS, weight_fraction="0.5"), CostTableError, "weight_fraction"),
        (lambda: CostTable(None), CostTableError, "list of LayerCost"),
        (lambda: CostTable([{"name": "a", "forward_ms": 1, "backward_ms": 1}]), CostTableError, "LayerCost objects"),
        (lambda: CostTable(LAYERS, tied=[("x", (0, 1), 5)]), CostTableError, "TiedParameter"),
        (lambda: CostTable([LayerCost("a", forward_ms=1, backward_ms=1, formulas={"f": "b"})]), CostTableError,
         "pairs"),
        (lambda: octopipe.simulate(PipelinePlan.build(1, [0, 4], [0], [["0F0", "0B0"]]), CostTable(LAYERS), "cpux1"),
         PlanError, "not an Op"),
        (lambda: octopipe.simulate(PipelinePlan.build(1.0, [0, 4], [0], [[F(0, 0), B(0, 0)]]), CostTable(LAYERS),
                                   "cpux1"), PlanError, "num_microbatches must be an integer"),
        (lambda: octopipe.simulate(PipelinePlan.build(1, [0.0, 4.0], [0], [[F(0, 0), B(0, 0)]]), CostTable(LAYERS),
                                   "cpux1"), PlanError, "Stage of integers"),
        (lambda: plan_.with_recompute(None), PlanError, "per-stage booleans"),
        (lambda: plan_.with_recompute("ab"), PlanError, "per-stage booleans"),
        (lambda: PipelinePlan.parse(None), ParseError, "must be a string"),
        (lambda: ClusterSpec.preset(None), ClusterSpecError, "name like"),
        (lambda: octopipe.plan(CostTable(LAYERS), "cpux2", 4, quiet=True, time_limit_s=1, activation_limit=[1]),
         ArgumentError, "activation_limit"),
        (lambda: octopipe.plan(CostTable(LAYERS), "cpux2", 4, quiet=True, time_limit_s=1, memory=None),
         ArgumentError, "MemoryModel"),
        (lambda: octopipe.plan(CostTable(LAYERS), "cpux2", 4, time_limit_s=1, progress="x"), ArgumentError,
         "progress"),
        (lambda: octopipe.profiles.load_profile(None), CostTableError, "file path"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_profile_fields_are_checked(tmp_path):
    deepseek = json.loads((PROFILES / "deepseek-16B-seq4096.json").read_text())
    path = tmp_path / "profile.json"
    for field, value, message in (("seq_len", "abc", "seq_len"), ("seq_len", 1.7, "seq_len"), ("seq_len", 0, "seq_len"),
                                  ("seq_len", 10**400, "seq_len"), ("kind_legend", [], "kind_legend")):
        path.write_text(json.dumps(deepseek | {field: value}))
        with pytest.raises(CostTableError, match=message):
            octopipe.profiles.load_profile(path)
    with pytest.raises(CostTableError, match="hidden_size"):
        octopipe.profiles.load_profile(PROFILES / "deepseek-16B-seq4096.json", hidden_size=True)
    nemotron = json.loads((PROFILES / "nemotron-nano-v2-9B-seq4096.json").read_text())
    for layer in nemotron["layers"]:
        if layer["kind"] in ("-", "*"):
            layer["forward_ms"] = 0.0
    path.write_text(json.dumps(nemotron))
    with pytest.raises(CostTableError, match="0 ms"):
        octopipe.profiles.load_profile(path)


def test_infeasible_limits_read_in_a_unit_that_shows_them():
    costs = CostTable([LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=100, output_bytes=10,
                                 param_bytes=10) for i in range(4)])
    # (two layers' activations and the 10 B the first device's forward sends on, until sent)
    with pytest.raises(octopipe.InfeasibleError, match=r"Raise activation_limit to 210 B, which always works \(to at least 100 B for any plan"):
        octopipe.plan(costs, "cpux2", 4, quiet=True, time_limit_s=2, activation_limit=1)
    with pytest.raises(octopipe.InfeasibleError, match=r"Raise the memory limit to \d+ B"):
        octopipe.plan(costs, "cpux2", 4, quiet=True, time_limit_s=2, memory_limit_bytes=1)


def test_compile_checks_seq_dims_against_the_model_inputs():
    from octopipe import models

    model = models.build("gemma", "tiny")
    inputs = models.example_inputs("gemma", "tiny", batch_size=8)
    target = models.example_target("gemma", "tiny", batch_size=8)
    for seq_dims, message in (({"inptu_ids": None}, "not inputs of the traced model"),
                              ({"input_ids": 7}, "must be None or a dim"), ([1], "must map input names")):
        with pytest.raises(ArgumentError, match=message):
            octopipe.compile(model, "cpux2", example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                             num_microbatches=4, schedule="1f1b", quiet=True, seq_dims=seq_dims)
    with pytest.raises(octopipe.OctopipeError, match=r"write \['layers.0'\]"):
        octopipe.compile(model, "cpux2", example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                         num_microbatches=4, schedule="1f1b", quiet=True, split_points="layers.0")
