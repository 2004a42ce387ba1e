"""Selective recomputation in the planner: the plan's and the cost table's text and JSON forms, the
simulator's time and memory rules for a selective stage, the analytic and profiled costs of it
(what PyTorch's selective checkpoint keeps), and the search choosing it where memory holds
microbatches back and it costs less than recomputing everything (never where told not to, or
where the costs do not know it)."""

from dataclasses import replace

import pytest
import torch

import octopipe
from octopipe import ClusterSpec, CostTable, LayerCost, PipelinePlan, PlanError, models
from octopipe.errors import CostTableError, ParseError
from octopipe.passes.costs import analytic_costs
from octopipe.passes.profile import _KeptOutputs, layer_modules
from octopipe.passes.trace import trace
from octopipe.simulator import StageCosts, simulate

FREE = ClusterSpec(num_devices=4, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30, latency_s=0.0)
MiB = 2**20

TWO_STAGE = """plan devices=2 microbatches=2 stages=2
stage 0 layers=0:2 device=0 selective
stage 1 layers=2:3 device=1 recompute
device 0: 0F0 0F1 0B0 0B1
device 1: 1F0 1B0 1F1 1B1
"""


def table(n, forward=1.0, backward=2.0, activation=10 * MiB, output=MiB, kept=4 * MiB, recompute_ms=0.25):
    return CostTable([LayerCost(f"l{i}", forward_ms=forward, backward_ms=backward, activation_bytes=activation,
                                output_bytes=output, selective_activation_bytes=kept, selective_recompute_ms=recompute_ms)
                      for i in range(n)])


def test_plan_and_cost_forms_carry_selective_recomputation(tmp_path):
    plan = PipelinePlan.parse(TWO_STAGE)
    assert plan.selective == (True, False) and plan.recompute == (False, True)
    assert str(plan) == TWO_STAGE
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert plan.to_dict()["stages"][0] == {"layers": [0, 2], "device": 0, "selective": True}
    # turning full recomputation on clears selective on that stage; the rest keep theirs
    assert plan.with_recompute([True, False]).selective == (False, False)
    assert plan.with_recompute([False, False]).selective == (True, False)
    built = PipelinePlan.build(2, [0, 2, 3], [0, 1], plan.device_ops, recompute=[False, True], selective=[True, False])
    assert built == plan
    with pytest.raises(PlanError, match="both recompute and selective"):
        plan.with_recompute([True, True], [True, False])
    data = plan.to_dict()
    data["stages"][1]["selective"] = True
    with pytest.raises(PlanError, match="stage 1: both recompute and selective"):
        PipelinePlan.from_dict(data)
    with pytest.raises(ParseError, match="' selective' where it recomputes the cheap ones"):
        PipelinePlan.parse(TWO_STAGE.replace("device=0 selective", "device=0 selective recompute"))
    with pytest.raises(PlanError, match=r"stages \[0, 1\] recompute"):
        plan.to_torch_csv()
    costs = replace(table(3), model="t")
    assert CostTable.parse(str(costs)) == costs
    costs.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == costs
    assert costs.has_selective_info and not table(3, kept=None).has_selective_info
    with pytest.raises(CostTableError, match="'selective_activation_bytes' must be a non-negative integer"):
        CostTable.from_dict({"layers": [{"forward_ms": 1, "backward_ms": 2, "selective_activation_bytes": -1}]})


def test_a_selective_stage_holds_its_kept_outputs_and_pays_its_recomputation_at_b():
    costs = table(3)
    plan = PipelinePlan.parse(TWO_STAGE).with_recompute([False, False])  # stage 0 selective only
    sc = StageCosts.of(plan.boundaries, costs, plan.recompute, plan.selective)
    # stage 0: two layers' kept outputs (it reads the batch, and what it sends is held only until
    # sent); stage 1 everything
    assert sc.held == (2 * 4 * MiB, 10 * MiB)
    assert sc.backward_full == (4.5, 2.0) and sc.backward_input[0] == pytest.approx(4.5 - sc.weight[0])
    plain = simulate(plan.with_recompute([False, False], [False, False]), costs, FREE)
    cheap = simulate(plan, costs, FREE)
    assert cheap.iteration_ms == pytest.approx(plain.iteration_ms + 2 * 0.5)  # stage 0's two B's
    assert plain.peak_activation_bytes[0] == 41 * MiB  # two microbatches' 20 MiB at once, and F1's output
    assert cheap.peak_activation_bytes[0] == 8 * MiB + 20 * MiB  # one held, then one B's whole 20 MiB
    # a table that does not say what selective recomputation keeps cannot price the plan
    with pytest.raises(PlanError, match="recompute selectively, but the cost table"):
        simulate(plan, table(3, kept=None, recompute_ms=None), FREE)


class _Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _Net(torch.nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("name", ["mlp", "llama", "gemma", "multimodal"])
def test_analytic_selective_bytes_are_what_the_selective_checkpoint_keeps(name):
    # the analytic pass and the runtime's policy split the ops the same way: per layer, the bytes
    # priced as kept equal the outputs of SELECTIVE_SAVED_OPS in a real forward (fp32 here);
    # recomputing costs some but not all of the forward, and keeps less than the whole activation.
    # (Dense models: the pass prices MoE experts as routed, k of E, where the tiny built-in
    # DeepSeek runs every expert's einsum, for its kept bytes as for all its others.)
    torch.manual_seed(0)
    if name == "mlp":
        model, inputs = _Net(), (torch.randn(2, 8, 16),)
        graph = trace(model, inputs)
    else:
        model, inputs = models.build(name), models.example_inputs(name, batch_size=2)
        graph = trace(model, inputs)
    costs = analytic_costs(graph, ClusterSpec.preset("h100x8"), batch_size=2, dtype_bytes=4)
    values = {}
    from octopipe.passes.profile import _capture
    from octopipe.runtime import amp

    captured = _capture(graph.module, inputs, graph, lambda: amp.autocast(None, torch.device("cpu")))
    for layer, sub, cost in zip(graph.layers, layer_modules(graph), costs):
        args = [captured[n].detach().requires_grad_(captured[n].is_floating_point()) if isinstance(captured[n], torch.Tensor)
                else captured[n] for n in sub.inputs]
        with _KeptOutputs() as kept:
            sub.module(*args)
        values[layer.name] = (cost.selective_activation_bytes, kept.bytes)
        if layer.kind == "block":
            assert 0 < cost.selective_recompute_ms < cost.forward_ms, layer.name
            assert cost.selective_activation_bytes < cost.activation_bytes, layer.name
    for layer_name, (priced, measured) in values.items():
        # SDPA's kept log-sum-exp (fp32, b x heads x s) is the only output the pricing leaves out
        assert priced <= measured <= priced * 1.1 + 4096, (layer_name, priced, measured)


@pytest.mark.parametrize("depth_first", [False, True])
def test_list_schedule_keeps_a_selective_stage_that_holds_more_than_its_activations_within_budget(depth_first):
    # stage 0 keeps nothing of its own but holds the output it sent (1 MiB) from F to B: more
    # than its activation bytes (0). The scheduler's room for a recomputing B's regrowth went
    # negative there and let a second F in over a budget that holds one
    from octopipe.tuner import Policy, Structure, list_schedule

    costs = CostTable([LayerCost("l0", forward_ms=1.0, backward_ms=2.0, activation_bytes=0, output_bytes=MiB,
                                 selective_activation_bytes=0, selective_recompute_ms=0.1),
                       LayerCost("l1", forward_ms=1.0, backward_ms=2.0, activation_bytes=8 * MiB, output_bytes=MiB,
                                 selective_activation_bytes=4 * MiB, selective_recompute_ms=0.1)])
    cluster = ClusterSpec.preset("h100x2")
    structure = Structure((0, 1, 2), (0, 1), 2, selective=(True, False))
    budget = [1.5 * MiB, 16 * MiB]
    plan = list_schedule(structure, costs, cluster, 4, Policy(depth_first=depth_first, roundtrip_caps=False), budget)
    peaks = simulate(plan, costs, cluster).peak_activation_bytes
    assert all(peak <= room for peak, room in zip(peaks, budget)), peaks


def test_the_search_recomputes_selectively_where_it_is_cheaper_than_recomputing_everything():
    # 8 layers on 4 devices under a tight activation limit: selective recomputation keeps a
    # quarter of the activations for an eighth of a forward, so it beats full recomputation
    costs = table(8, activation=64 * MiB, kept=16 * MiB, recompute_ms=0.125)
    cluster = ClusterSpec.preset("h100x8").with_devices(4)
    limit = 1.5 * 2 * 64 * MiB
    options = dict(time_limit_s=20, activation_limit=limit, quiet=True, effort=0.2)
    chosen = octopipe.plan(costs, cluster, 8, **options)
    unknown = octopipe.plan(table(8, activation=64 * MiB, kept=None, recompute_ms=None), cluster, 8, **options)
    never = octopipe.plan(costs, cluster, 8, recompute=False, **options)
    assert any(chosen.plan.selective) and not any(unknown.plan.selective) and not any(never.plan.selective)
    assert not any(never.plan.recompute)
    assert chosen.report.iteration_ms < unknown.report.iteration_ms < never.report.iteration_ms
    for result in (chosen, unknown, never):
        sim = simulate(result.plan, costs, cluster)
        assert sim.iteration_ms == pytest.approx(result.report.iteration_ms)
        assert max(sim.peak_activation_bytes) <= limit * (1 + 1e-9)
    assert "selective recomputation on stage" in str(chosen.report)


def test_the_search_never_recomputes_selectively_a_stage_holding_a_layer_whose_costs_do_not_say():
    # layer 1's costs leave selective recomputation out (the analysis does where it cannot run:
    # an in-place op, a recurrent module); priced as keeping everything, the old search still put
    # it in selective stages beside layers that gain, which compile then had to undo
    layers = [LayerCost(f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=1000 if i != 1 else 50,
                        output_bytes=10, selective_activation_bytes=100 if i != 1 else None,
                        selective_recompute_ms=0.1 if i != 1 else None) for i in range(8)]
    costs = CostTable(layers, model="one unknown")
    cluster = ClusterSpec.preset("cpu", num_devices=2)
    for limit in (4000, 3000):
        chosen = octopipe.plan(costs, cluster, 8, activation_limit=limit, quiet=True, time_limit_s=20,
                              effort=0.2).plan
        assert any(chosen.selective)  # the others still gain from it
        assert not any(s.selective and s.layer_start <= 1 < s.layer_end for s in chosen.stages), chosen
    given = PipelinePlan.parse(TWO_STAGE.replace("layers=2:3", "layers=2:8"))
    with pytest.raises(PlanError, match=r"stage 0 recomputes selectively.*its layer 1 \('l1'"):
        simulate(given, costs, cluster)


def test_compile_runs_a_selective_plan_from_analytic_costs():
    torch.manual_seed(0)
    model = _Net()
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    common = dict(example_inputs=(x,), example_target=y, loss_fn=torch.nn.functional.mse_loss, num_microbatches=4,
                  costs="analytic", quiet=True)
    cluster = ClusterSpec.preset("cpu", num_devices=1)
    plain = octopipe.compile(model, cluster, schedule="1f1b", **common)
    n = plain.plan.num_stages
    cheap = octopipe.compile(model, cluster, plan=plain.plan.with_recompute([False] * n, [True] * n), **common)
    assert all(stage.selective for stage in cheap.stages)
    assert cheap.simulation.iteration_ms > plain.simulation.iteration_ms  # priced: B recomputes the cheap ops
    losses = []
    for pipe in (plain, cheap):
        engine = pipe.engine(0, timeout_s=30)
        engine.zero_grad()  # the pipelines share the model's parameters
        losses.append((engine.step((x,), y), {k: p.grad.clone() for k, p in engine.named_parameters()}))
    assert losses[0][0] == losses[1][0]
    assert all(torch.equal(g, losses[1][1][k]) for k, g in losses[0][1].items())
