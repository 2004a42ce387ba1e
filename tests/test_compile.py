"""octopipe.compile: the pass pipeline, the Pipeline object, IR dumps, saved plans, errors.
(Exactness of training under every schedule family is tested in tests/runtime.)"""

import copy
import warnings

import pytest
import torch

import octopipe
from octopipe import ClusterSpec, OctopipeError, PipelinePlan, VerificationError, models
from octopipe.ir.program import parse_programs
from octopipe.passes.verify import verify
from octopipe.runtime import launch

CLUSTER = ClusterSpec.preset("cpux2")


def _tiny(name="gemma", batch=8):
    torch.manual_seed(0)
    model = models.build(name, "tiny")
    return model, models.example_inputs(name, "tiny", batch_size=batch), models.example_target(name, "tiny", batch_size=batch)


def test_every_ir_level_is_inspectable_and_round_trips(tmp_path):
    model, x, y = _tiny()
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                            num_microbatches=4, schedule="zb-h1")
    assert octopipe.LayerGraph.parse(pipe.dump("graph")) == pipe.graph
    assert octopipe.CostTable.parse(pipe.dump("costs")) == pipe.costs
    assert PipelinePlan.parse(pipe.dump("plan")) == pipe.plan
    assert parse_programs(pipe.dump("program")) == pipe.programs
    assert "stage 0" in pipe.dump("stages")
    assert set(pipe.pass_seconds) == {"trace", "costs", "plan", "simulate", "codegen", "lower", "verify"}
    assert len(pipe.dump_all(tmp_path)) == 5
    with pytest.raises(OctopipeError, match="unknown IR level 'ast'"):
        pipe.dump("ast")
    # the tied embedding/head of gemma is reduced across the two ranks that hold it
    if pipe.plan.stages[0].device != pipe.plan.stages[-1].device:
        assert "reduce_tied param=embed.weight" in pipe.dump("program")


def test_the_simulator_times_the_messages_the_programs_send_skip_tensors_included():
    # multimodal: the projector's image features skip to every cross-attention layer
    from octopipe import schedules
    from octopipe.simulator import stage_costs

    model, x, y = _tiny("multimodal")
    cluster = ClusterSpec.preset("cpu", num_devices=4)
    common = dict(example_inputs=x, example_target=y, loss_fn=models.lm_loss, num_microbatches=2, costs="analytic")
    costs = octopipe.compile(model, cluster, schedule="1f1b", **common).costs
    (skip,) = costs.skips
    # cut between the producer and its first reader, and again between its readers: stage 1 sends
    # the features to stage 2 with its output and to stage 3 directly
    first, last = skip.consumers[0], skip.consumers[-1]
    boundaries = [0, skip.producer, first, last, len(costs)]
    plan = octopipe.PipelinePlan.build(2, boundaries, [0, 1, 2, 3], schedules.device_orders("1f1b", 4, 2),
                                       num_devices=4)
    pipe = octopipe.compile(model, cluster, plan=plan, **common)
    assert stage_costs(pipe.plan, pipe.costs).skips == ((1, 3, float(skip.bytes)),)
    sent = {(i.kind.value, program.rank, i.peer) for program in pipe.programs for i in program.instructions if i.is_send}
    simulated = {(f"send_{t.kind}", t.src, t.dst) for t in pipe.simulation.transfers}
    assert simulated == sent
    sends = sum(i.is_send for program in pipe.programs for i in program.instructions)
    assert len(pipe.simulation.transfers) == sends  # one simulated transfer per message


def test_saved_plan_skips_the_search_and_gives_the_same_programs(tmp_path):
    model, x, y = _tiny("llama")
    first = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                             num_microbatches=4, time_limit_s=3, quiet=True)
    assert first.report is not None and first.report.iteration_ms == pytest.approx(first.simulation.iteration_ms)
    for name in ("plan.json", "plan.txt"):
        first.save(tmp_path / name)
        again = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                                 num_microbatches=4, plan=tmp_path / name)
        assert again.plan == first.plan and again.programs == first.programs and again.report is None


def test_target_shape_is_inferred_when_no_example_target_is_given():
    model, x, _ = _tiny("llama")
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=models.lm_loss, num_microbatches=2,
                            schedule="1f1b")
    assert pipe.graph.layers[-1].kind == "loss" and pipe.stages[-1].is_loss
    mse = lambda out, target: ((out - target) ** 2).mean()
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=mse, num_microbatches=2, schedule="1f1b")
    assert pipe.stages[-1].is_loss
    with pytest.raises(OctopipeError, match="pass example_target="):
        octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=lambda out, t: out.sum() + t["x"],
                         num_microbatches=2, schedule="1f1b")


def _step(rank, world, pipe, x, y):
    engine = pipe.engine(rank)
    return engine.step(x, y), {n: p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["gemma", "multimodal"])
def test_pipeline_travels_to_spawned_processes(name):
    # what launch does where CUDA is initialized (spawn: the pipeline is pickled): the stages come
    # back with their split linears still calls (W still deferred) and train exactly as before
    from octopipe.passes.split_backward import split_linear

    model, x, y = _tiny(name)
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                            num_microbatches=4, schedule="zb-v", quiet=True)
    splits = [sum(n.target is split_linear for n in stage.module.graph.nodes) for stage in pipe.stages]
    assert sum(splits) > 0
    spawned = launch(_step, 2, args=(pipe, x, y), start_method="spawn")
    forked = launch(_step, 2, args=(pipe, x, y))
    for (loss, grads), (forked_loss, forked_grads) in zip(spawned, forked):
        assert loss == forked_loss
        assert grads.keys() == forked_grads.keys()
        assert all(torch.equal(grads[n], forked_grads[n]) for n in grads)
    import pickle

    back = pickle.loads(pickle.dumps(pipe))
    assert [sum(n.target is split_linear for n in stage.module.graph.nodes) for stage in back.stages] == splits
    # the traced module stays behind in a pickle only; copies keep it
    import copy

    assert back.graph == pipe.graph and back.graph.module is None
    assert copy.copy(pipe.graph).module is pipe.graph.module
    deep = copy.deepcopy(pipe.graph)
    assert deep == pipe.graph and deep.module is not None and deep.module is not pipe.graph.module


@pytest.mark.timeout(180)
def test_planned_pipeline_trains_exactly():
    model, x, y = _tiny("deepseek")
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                            num_microbatches=4, costs="profile", time_limit_s=3, quiet=True)
    results = launch(_step, 2, args=(pipe, x, y))
    reference = models.lm_loss(model(*x), y)
    reference.backward()
    grads = {}
    for loss, rank_grads in results:
        assert loss == pytest.approx(reference.item(), abs=1e-6)
        grads.update(rank_grads)
    assert set(grads) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5)


def test_bad_arguments_are_clear_errors(tmp_path):
    model, x, y = _tiny("llama")
    with pytest.raises(OctopipeError, match="not both"):
        octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=models.lm_loss, plan="p.json", schedule="1f1b")
    with pytest.raises(OctopipeError, match="cannot read plan"):
        octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=models.lm_loss, plan=tmp_path / "none.json")
    with pytest.raises(OctopipeError, match="costs must be"):
        octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=models.lm_loss, costs="guess", schedule="1f1b")
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                            num_microbatches=4, schedule="1f1b")
    pipe.save(tmp_path / "four.json")
    with pytest.raises(octopipe.ArgumentError, match="plan has 4 microbatches but num_microbatches=2"):
        octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                         num_microbatches=2, plan=tmp_path / "four.json")
    with pytest.raises(OctopipeError, match="rank must be an integer in 0..1"):
        pipe.engine(5)
    for effort in (0, -1.0, float("nan"), "3"):
        with pytest.raises(octopipe.ArgumentError, match="effort must be a positive number"):
            octopipe.compile(model, CLUSTER, example_inputs=x, loss_fn=models.lm_loss, effort=effort)


def test_effort_scales_compiles_search_as_plans():
    # compile's search is plan's: the same work budget for the same effort, and more for more
    model, x, y = _tiny("llama")

    def steps(effort):
        pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                                num_microbatches=4, effort=effort, quiet=True, time_limit_s=120)
        note = next(line for line in pipe.report.notes if line.startswith("tuner:"))
        return int(note.split("(")[1].split(" op-steps")[0]), pipe

    small, pipe = steps(0.002)  # (budgets below where this small search converges by itself)
    larger, _ = steps(0.005)
    assert small < larger
    again = octopipe.plan(pipe.costs, CLUSTER, 4, effort=0.002, quiet=True, time_limit_s=120)
    assert again.plan == pipe.plan and f"({small} op-steps" in "\n".join(again.report.notes)


def _receive_positions(pipe):
    """(rank, instruction text) -> position of each receive in its rank's program."""
    return {(program.rank, str(instruction)): position for program in pipe.programs
            for position, instruction in enumerate(program.instructions) if instruction.is_recv}


def test_receives_are_posted_at_the_step_start_on_gloo_and_one_compute_ahead_in_pair_order_on_nccl():
    model, x, y = _tiny("llama")
    gpu_like = ClusterSpec.preset("h100x8", num_devices=2)
    assert CLUSTER.backend == "gloo" and gpu_like.backend == "nccl"
    common = dict(example_inputs=x, example_target=y, loss_fn=models.lm_loss, num_microbatches=4, schedule="1f1b")
    gloo = octopipe.compile(model, CLUSTER, **common)
    nccl = octopipe.compile(model, gpu_like, **common)
    near = octopipe.compile(model, CLUSTER, receive_ahead=1, **common)
    early, late, one = _receive_positions(gloo), _receive_positions(nccl), _receive_positions(near)
    assert early.keys() == late.keys() == one.keys()

    def computes_before(pipe, rank, position):
        return sum(i.is_compute for i in pipe.programs[rank].instructions[:position])

    def computes_to_reader(pipe, rank, position):
        instruction = pipe.programs[rank].instructions[position]
        body = pipe.programs[rank].instructions[position:]
        reader = next(k for k, i in enumerate(body) if i.is_compute and i.stage == instruction.stage
                      and i.microbatch == instruction.microbatch)
        return sum(i.is_compute for i in body[:reader])

    # gloo (matches by tag): every receive before the first compute; with receive_ahead=1 at
    # most one compute ahead of its reader
    assert all(computes_before(gloo, rank, position) == 0 for (rank, _), position in early.items())
    assert all(computes_to_reader(near, rank, position) <= 1 for (rank, _), position in one.items())
    # NCCL: both ranks of the pair in one order (a pair's operations run on one stream)
    verify(nccl.programs, nccl.plan, serialized_pairs=True)
    with pytest.raises(VerificationError, match="pair order"):
        verify(gloo.programs, gloo.plan, serialized_pairs=True)
    verify(gloo.programs, gloo.plan)
    with pytest.raises(octopipe.ArgumentError, match="receive_ahead must be a non-negative integer"):
        octopipe.compile(model, CLUSTER, receive_ahead=-1, **common)


def test_cluster_by_name_a_non_scalar_loss_and_a_feature_dim_equal_to_the_batch():
    # found by a bad-input sweep: compile(cluster="cpux2") raised AttributeError, a per-sample
    # loss was accepted, and a [batch, features] input whose feature count equals the batch size
    # had its features taken for a sequence (costs error, fake-tensor log noise)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = octopipe.compile(model, "cpux2", example_inputs=(x,), example_target=y, num_microbatches=4,
                            loss_fn=torch.nn.functional.mse_loss, schedule="1f1b")
    assert pipe.cluster == CLUSTER
    assert not any("s" in text for layer in pipe.costs for key, text in layer.formulas if key == "forward_flops")
    with pytest.raises(octopipe.ClusterSpecError, match="expected a ClusterSpec, a preset name"):
        octopipe.compile(model, 2, example_inputs=(x,), example_target=y, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(octopipe.TraceError, match=r"must return a scalar .*got \(8, 4\)"):
        octopipe.compile(model, CLUSTER, example_inputs=(x,), example_target=y, loss_fn=lambda o, t: (o - t) ** 2,
                         schedule="1f1b")
    with pytest.raises(octopipe.ArgumentError, match="num_microbatches must be a positive integer"):
        octopipe.compile(model, CLUSTER, example_inputs=(x,), example_target=y, num_microbatches=0,
                         loss_fn=torch.nn.functional.mse_loss)


def test_a_step_on_a_batch_unlike_the_example_is_refused_before_anything_runs():
    # found by a bad-input sweep: a wrong batch size failed inside gloo, a missing target with
    # an IndexError
    model, x, y = _tiny("llama")
    pipe = octopipe.compile(model, ClusterSpec.preset("cpu", num_devices=1), example_inputs=x, example_target=y,
                            loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b")
    engine = pipe.engine(0, device="cpu")
    with pytest.raises(octopipe.ArgumentError, match=r"input 0 is \(16, 32\) .*compiled for \(8, 32\)"):
        engine.step((torch.cat([x[0], x[0]]),), torch.cat([y, y]))
    with pytest.raises(octopipe.ArgumentError, match="the target is .*torch.int32"):
        engine.step(x, y.to(torch.int32))
    with pytest.raises(octopipe.ArgumentError, match=r"call step\(inputs, target\)"):
        engine.step(x, None)
    assert engine.step(x, y) > 0


class _Counted(torch.nn.Module):
    """A block that counts its forwards in a buffer, two ways, and reads the count."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("average", torch.zeros(8))

    def forward(self, x):
        self.calls.add_(1)
        self.average = 0.5 * self.average + 0.5 * x.detach().mean(0)  # reassigned, as EMA code does
        return torch.tanh(self.linear(x)) / self.calls


def test_buffers_a_forward_updates_are_kept_and_compile_leaves_the_model_as_it_was():
    # found by an API sweep: torch.fx ran `buffer.add_(1)` once on the real buffer while tracing
    # and left it out of the graph (the pipeline never updated it: the loss drifted from plain
    # training from the second step), `self.average = ...` was lost the same way, and compile's
    # own example runs moved the model's buffers (a BatchNorm's running statistics) before any step
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Counted(), _Counted())
    plain = torch.nn.Sequential(_Counted(), _Counted())
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = octopipe.compile(model, ClusterSpec.preset("cpu", num_devices=1), example_inputs=(x,), example_target=y,
                            loss_fn=torch.nn.functional.mse_loss, num_microbatches=1, schedule="1f1b")
    assert model[0].calls.item() == 0 and not model[0].average.any()  # compile ran it, and undid that
    engine = pipe.engine(0, device="cpu")
    for _ in range(3):
        assert engine.step((x,), y) == pytest.approx(torch.nn.functional.mse_loss(plain(x), y).item(), rel=1e-6)
    assert model[1].calls.item() == plain[1].calls.item() == 3
    torch.testing.assert_close(model[1].average, plain[1].average)
    # with microbatches the forward runs once per microbatch: said at compile
    norm = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8))
    with pytest.warns(octopipe.OctopipeWarning) as caught:
        octopipe.compile(torch.nn.Sequential(_Counted(), norm), CLUSTER, example_inputs=(x,), example_target=y,
                         loss_fn=torch.nn.functional.mse_loss, num_microbatches=2, schedule="1f1b")
    messages = " ".join(str(w.message) for w in caught)
    assert "batch statistics" in messages and "once per microbatch" in messages
    assert norm[1].num_batches_tracked.item() == 0


def test_a_buffer_a_leaf_module_updates_in_place_is_said_at_compile_as_the_graphs_own_are():
    # found by fuzzing: a spectral norm's power iteration (a parametrization, or the old forward
    # pre-hook) updates its buffers inside the Linear's one call, which the graph does not show
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    new_style = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8))
    old_style = torch.nn.utils.spectral_norm(torch.nn.Linear(8, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), new_style, old_style, torch.nn.Linear(8, 8))
    with pytest.warns(octopipe.OctopipeWarning, match="once per microbatch") as caught:
        octopipe.compile(model, CLUSTER, example_inputs=(x,), example_target=y, loss_fn=torch.nn.functional.mse_loss,
                         num_microbatches=2, schedule="1f1b")
    message = next(str(w.message) for w in caught if "updates buffer" in str(w.message))
    assert "1.parametrizations.weight.0._u" in message and "1.parametrizations.weight.0._v" in message
    assert "2.weight_u" in message and "2.weight_v" in message
    # in eval mode the power iteration does not run: nothing to say
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", octopipe.OctopipeWarning)
        octopipe.compile(model, CLUSTER, example_inputs=(x,), example_target=y, loss_fn=torch.nn.functional.mse_loss,
                         num_microbatches=2, schedule="1f1b")


class _TwoOutputs(torch.nn.Module):
    def __init__(self, as_dict=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.as_dict = as_dict

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"logits": x, "aux": x.sum()} if self.as_dict else (x, x.sum())


def test_outputs_the_pipeline_cannot_pass_on_and_inputs_it_cannot_cut_are_refused():
    # found by an API sweep: with a tuple output the loss silently read its first element (a
    # loss_fn written for the tuple, out[0], took the first row), a loss_fn written for a dict
    # failed with advice about control flow, a 0-d input and a batch-sized tensor held by loss_fn
    # were raw IndexError / RuntimeError, and mse_loss without example_target had class indices
    # guessed as its target (they broadcast when the features equal the batch)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    mse = torch.nn.functional.mse_loss
    with pytest.raises(octopipe.TraceError, match="returns a tuple of 2 values"):
        octopipe.compile(_TwoOutputs(), CLUSTER, example_inputs=(x,), example_target=y, num_microbatches=2,
                         loss_fn=lambda out, t: mse(out[0], t), schedule="1f1b")
    with pytest.raises(octopipe.TraceError, match=r"is given the tensor the model's output holds \(dict: its logits\)"):
        octopipe.compile(_TwoOutputs(as_dict=True), CLUSTER, example_inputs=(x,), example_target=y, num_microbatches=2,
                         loss_fn=lambda out, t: mse(out["logits"], t), schedule="1f1b")
    with pytest.raises(octopipe.ArgumentError, match="batch tensor 1 is a 0-d tensor"):
        octopipe.compile(_Scaled(), CLUSTER,
                         example_inputs=(x, torch.tensor(2.0)), example_target=y, num_microbatches=2, loss_fn=mse,
                         schedule="1f1b")
    weights = torch.rand(8, 1)
    with pytest.raises(octopipe.TraceError, match="loss_fn must not hold batch-sized tensors"):
        octopipe.compile(_TwoOutputs(as_dict=True), CLUSTER, example_inputs=(x,), example_target=y, num_microbatches=2,
                         loss_fn=lambda out, t: (weights * (out - t) ** 2).mean(), schedule="1f1b")
    pipe = octopipe.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), CLUSTER,
                            example_inputs=(x,), loss_fn=mse, num_microbatches=2, schedule="1f1b")
    assert pipe.stages[-1].inputs[-1].spec.shape == (4, 8)  # the target: shaped like the output


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, scale):
        for layer in self.layers:
            x = layer(x) * scale
        return x


def test_analytic_costs_count_the_gradient_accumulation_of_the_step():
    from octopipe.passes.costs import analytic_costs

    model, x, y = _tiny("llama")
    pipe = octopipe.compile(model, "h100x8", num_devices=2, example_inputs=x, example_target=y,
                            loss_fn=models.lm_loss, num_microbatches=4, schedule="1f1b", quiet=True)
    batch = x[0].shape[0] // 4 if isinstance(x, tuple) else x.shape[0] // 4
    # (floats at 4 bytes: the model's fp32 weights, no autocast)
    assert pipe.costs == analytic_costs(pipe.graph, pipe.cluster, batch_size=batch, num_microbatches=4, dtype_bytes=4)
    assert pipe.costs != analytic_costs(pipe.graph, pipe.cluster, batch_size=batch, dtype_bytes=4)


def test_analytic_costs_count_floats_at_the_runs_size():
    # compile's analytic costs count what the run holds: the weights' dtype, or autocast's
    model, x, y = _tiny("llama")

    def costs(model, **options):
        return octopipe.compile(model, "h100x8", num_devices=2, example_inputs=x, example_target=y,
                                loss_fn=models.lm_loss, num_microbatches=4, schedule="1f1b", quiet=True,
                                **options).costs

    fp32, under_bf16 = costs(model), costs(model, autocast="bf16")
    bf16_weights = costs(copy.deepcopy(model).bfloat16())
    assert [c.param_bytes for c in fp32] == [2 * c.param_bytes for c in under_bf16]
    # (the embedding's saved token ids and the loss's fp32 log-softmax keep their size)
    blocks = [i for i, c in enumerate(fp32) if c.kind == "block"]
    assert blocks and all(fp32[i].activation_bytes == 2 * under_bf16[i].activation_bytes > 0 for i in blocks)
    assert [c.activation_bytes for c in bf16_weights] == [c.activation_bytes for c in under_bf16]


def test_what_a_second_user_audit_found_is_fixed(tmp_path):
    # stop 28's second audit: each a silent wrong answer, a lost setting or a raw exception before
    from octopipe.api import load_saved_plan

    model, x, y = _tiny("gemma")
    ids = x[0] if isinstance(x, tuple) else x
    pipe = octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                            num_microbatches=4, schedule="1f1b")
    # one tensor too many was taken as the target on the loss's rank (a silently wrong loss): every rank refuses it
    for rank in (0, 1):
        with pytest.raises(octopipe.ArgumentError, match=r"got 2 input tensor\(s\) and a target, but the pipeline was "
                                                         r"compiled for 1 input"):
            pipe.engine(rank).step((ids, ids), y)
        with pytest.raises(octopipe.ArgumentError, match="no target"):
            pipe.engine(rank).step((ids,))
        with pytest.raises(octopipe.ArgumentError, match="must be a tensor or a tuple of tensors"):
            pipe.engine(rank).step(None, y)
        with pytest.raises(octopipe.ArgumentError, match="input 0 must be a torch.Tensor"):
            pipe.engine(rank).step((ids.numpy(),), y)
    # a target of another shape: refused on rank 0 too, which does not read it (it would wait for rank 1)
    assert not any(src.is_batch and src.index == 1 for stage in pipe.stages if pipe.plan.stages[stage.index].device == 0
                   for src in stage.inputs)
    with pytest.raises(octopipe.ArgumentError, match=r"the target is \(8, 31\) torch.int64, but the pipeline was "
                                                     r"compiled for \(8, 32\)"):
        pipe.engine(0).step((ids,), y[:, :-1])
    for bad in ("0", 0.0, True):
        with pytest.raises(octopipe.ArgumentError, match="rank must be an integer"):
            pipe.engine(bad)
    with pytest.raises(octopipe.ArgumentError, match=r"unknown option\(s\) \['foo'\]"):
        pipe.engine(0, foo=1)
    engine = pipe.engine(0)
    with pytest.raises(octopipe.ArgumentError, match="load_state_dict takes"):
        engine.load_state_dict({"foo": 1})
    with pytest.raises(octopipe.ExecutionError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "missing.pt")
    # Pipeline.save keeps the microbatch size (compile then warns on another) and a replica's count
    pipe.save(tmp_path / "p.json")
    assert load_saved_plan(tmp_path / "p.json").microbatch_size == 2
    with pytest.warns(octopipe.OctopipeWarning, match="planned for microbatches of 2 samples"):
        octopipe.compile(model, CLUSTER, example_inputs=torch.cat([ids, ids]), example_target=torch.cat([y, y]),
                         loss_fn=models.lm_loss, num_microbatches=4, plan=tmp_path / "p.json")
    replicas = octopipe.compile(model, "cpux4", example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                                num_microbatches=4, schedule="1f1b", data_parallel=2)
    replicas.save(tmp_path / "dp.json")
    saved = load_saved_plan(tmp_path / "dp.json").cluster
    assert saved.data_parallel == 2 and saved.num_devices == 2
    # a local cluster takes any replica count that divides its processes
    assert octopipe.ClusterSpec.preset("cpux6").replica(3).num_devices == 2
    # a loss that is not a function of (output, target) is refused before tracing
    for loss in ("ce", lambda output: output.sum()):
        with pytest.raises(octopipe.ArgumentError, match=r"loss_fn must be a function loss_fn\(output, target\)"):
            octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=loss, schedule="1f1b")
    # a plan of another layer count: the error alone, not first a warning that it runs
    deep, dx, dy = _tiny("nemotron-h")
    other = octopipe.compile(deep, CLUSTER, example_inputs=dx, example_target=dy, loss_fn=models.lm_loss,
                             schedule="1f1b")
    assert len(other.costs) != len(pipe.costs)
    other.save(tmp_path / "other.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error", octopipe.OctopipeWarning)
        with pytest.raises(octopipe.OctopipeError, match="layers"):
            octopipe.compile(model, CLUSTER, example_inputs=x, example_target=y, loss_fn=models.lm_loss,
                             plan=tmp_path / "other.json")
    with pytest.raises(octopipe.ArgumentError, match="has no rows"):
        octopipe.compile(model, CLUSTER, example_inputs=(ids[:0],), example_target=y[:0], loss_fn=models.lm_loss)
    # output paths: a missing folder or a file where a folder goes is a clear error
    with pytest.raises(octopipe.ArgumentError, match="does not exist"):
        pipe.save(tmp_path / "no" / "p.json")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(octopipe.ArgumentError, match="cannot write there"):
        pipe.dump_all(tmp_path / "a_file")
    # every submodule the README names is there after `import octopipe`
    assert callable(octopipe.bench.runtime_profile) and callable(octopipe.models.init_module)


class _SharedScale(torch.nn.Module):
    """A scale read by the first layer and updated in place after the last (found by fuzzing:
    registered in two modules, one tensor, it was split across the ranks silently)."""

    def __init__(self):
        super().__init__()
        self.first, self.last = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.middle = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        scale = torch.linspace(0.5, 1.5, 8)
        self.first.register_buffer("scale", scale)
        self.last.register_buffer("scale", scale)

    def forward(self, x):
        x = self.first(x) * self.first.scale
        for layer in self.middle:
            x = torch.tanh(layer(x))
        self.last.scale.mul_(1.01)
        return self.last(x)


def test_a_buffer_updated_on_one_device_and_read_on_another_is_refused():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    options = dict(example_inputs=x, example_target=y, loss_fn=torch.nn.functional.mse_loss, num_microbatches=2,
                   schedule="1f1b", quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", octopipe.OctopipeWarning)  # (it updates a buffer per microbatch)
        with pytest.raises(octopipe.PlanError, match=r"updates buffer 'first.scale' in place, on device 1 and layer "
                                                     r"0 \(first\), which reads it, on device 0"):
            octopipe.compile(_SharedScale(), "cpux2", **options)
        octopipe.compile(_SharedScale(), "cpux1", **options)  # one device: its stages share the buffer
