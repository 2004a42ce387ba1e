"""compile(autocast="bf16" | "fp16"): every stage's forward under torch.autocast, tensors crossing stages
in autocast's dtypes, equals plain autocast training (each microbatch's loss_fn(model(x), y) under
torch.autocast, backward outside it), loss and every gradient, under 1F1B, ZB-H1 (split B/W
linears), interleaved 1F1B and a recomputing plan; and it is not plain fp32 training (the test
could fail). fp16 adds loss scaling: equal to torch.amp.GradScaler training, and an overflow
anywhere skips the step on every rank."""

import math

import pytest
import torch
from torch import nn

import octopipe
from octopipe.errors import ArgumentError, OctopipeError
from octopipe.passes.profile import profile_costs
from octopipe.runtime import launch

pytestmark = pytest.mark.usefixtures("one_thread")  # as each rank runs: CPU kernels' sums depend on threads
MICROBATCHES = 4
SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "1f1b recomputing")


class Mixed(nn.Module):
    """Linear outputs cross stages (bf16 under autocast) and so do residual sums (fp32)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = self.down(torch.relu(self.up(x)))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (8, 6), generator=generator), torch.randint(0, 32, (8, 6), generator=generator)


def _model():
    torch.manual_seed(0)
    return Mixed()


def _pipes(model, autocast="bf16"):
    tokens, target = _batch()
    cluster = octopipe.ClusterSpec.preset("cpux2")
    pipes = []
    for name in SCHEDULES:
        schedule = name.split()[0]
        pipe = octopipe.compile(model, cluster, example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                                num_microbatches=MICROBATCHES, schedule=schedule, autocast=autocast, quiet=True)
        if name.endswith("recomputing"):
            plan = pipe.plan.with_recompute([True] * pipe.plan.num_stages)
            pipe = octopipe.compile(model, cluster, example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                                    num_microbatches=MICROBATCHES, plan=plan, costs=pipe.costs, autocast=autocast,
                                    quiet=True)
        pipes.append(pipe)
    return pipes


def _plain(model, autocast):
    tokens, target = _batch()
    total = 0.0
    for x, y in zip(tokens.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model(x), y) / MICROBATCHES
        loss.backward()
        total += loss.item()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def _worker(rank, world_size, pipes):
    tokens, target = _batch()
    results = []
    for pipe in pipes:
        engine = pipe.engine(rank, timeout_s=30)
        loss = engine.step((tokens,), target)
        results.append((loss, {name: p.grad.clone() for name, p in engine.named_parameters()}))
        engine.zero_grad()
    return results


@pytest.mark.timeout(180)
def test_autocast_pipeline_equals_plain_autocast_training():
    model = _model()
    pipes = _pipes(model)
    crossing = {spec.dtype for pipe in pipes for stage in pipe.stages for spec in stage.outputs}
    assert torch.bfloat16 in crossing and torch.float32 in crossing  # both kinds of tensor cross stages
    assert any("split_linear" in stage.module.code for stage in pipes[1].stages)  # ZB-H1 splits linears
    per_rank = launch(_worker, 2, args=(pipes,))
    plain_loss, plain_grads = _plain(model, autocast=True)
    fp32_loss, _ = _plain(model, autocast=False)
    assert abs(plain_loss - fp32_loss) > 1e-4  # bf16 matmuls change the loss: autocast is really on
    _assert_every_schedule_equals(per_rank, plain_loss, plain_grads)  # the same kernels on the same values


def _assert_every_schedule_equals(per_rank, plain_loss, plain_grads):
    """Each schedule's loss, and every gradient bitwise, in fp32, over both ranks."""
    for index, name in enumerate(SCHEDULES):
        assert per_rank[0][index][0] == pytest.approx(plain_loss, rel=1e-6), name
        grads = {**per_rank[0][index][1], **per_rank[1][index][1]}
        assert set(grads) == set(plain_grads)
        for param, grad in grads.items():
            assert grad.dtype == torch.float32, (name, param)
            assert torch.equal(grad, plain_grads[param]), (name, param)


def test_autocast_arguments_are_checked():
    model = _model()
    tokens, target = _batch()

    def compile_with(**options):
        return octopipe.compile(model, "cpux2", example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                                num_microbatches=2, schedule="1f1b", quiet=True, **options)

    assert compile_with(autocast="fp16").autocast is torch.float16
    assert compile_with(autocast=torch.float16).autocast is torch.float16
    with pytest.raises(ArgumentError, match="'bf16'.*'fp16'"):
        compile_with(autocast="int8")
    pipe = compile_with(autocast=torch.bfloat16)
    assert pipe.autocast is torch.bfloat16 and compile_with(autocast="bfloat16").autocast is torch.bfloat16
    with pytest.raises(ArgumentError, match="compiled with autocast"):
        pipe.engine(0, autocast=None)
    with pytest.raises(ArgumentError, match="compiled with autocast"):
        compile_with().engine(0, autocast="bf16")


def test_a_meta_model_or_a_gpu_cluster_gets_the_dtypes_from_a_fake_run():
    """A meta-device model has no values to run, and autocast casts by device type: compile runs
    the example microbatch on fake tensors (of the engines' device type; the CPU here) and gets
    the same cross-stage specs as a real run. Stage 0 ends at relu(up), which crosses in bf16."""
    tokens, target = _batch()
    options = dict(loss_fn=_loss, num_microbatches=2, schedule="1f1b", partition=[0, 2, 9], costs="analytic",
                   quiet=True, autocast="bf16")
    real = octopipe.compile(_model(), "cpux2", example_inputs=(tokens,), example_target=target, **options)
    with torch.device("meta"):
        meta_model = Mixed()
    meta = octopipe.compile(meta_model, "cpux2", example_inputs=(tokens.to("meta"),),
                            example_target=target.to("meta"), **options)
    gpu = octopipe.compile(_model(), "h100x8", example_inputs=(tokens,), example_target=target, num_devices=2,
                           **options)
    specs = [[stage.outputs for stage in pipe.stages] for pipe in (real, meta, gpu)]
    assert specs[0][0][0].dtype == torch.bfloat16
    assert specs[0] == specs[1] == specs[2]


def _mismatched_worker(rank, world_size, pipe):
    from octopipe.passes.codegen import stages_on
    from octopipe.runtime.engine import Engine

    engine = Engine(rank, world_size, stages_on(pipe.stages, pipe.plan, rank), pipe.programs[rank],
                    pipe.num_microbatches, timeout_s=10, autocast="bf16")
    tokens, target = _batch()
    return engine.step((tokens,), target)


@pytest.mark.timeout(120)
def test_an_engine_whose_autocast_differs_from_compile_says_so_at_the_send():
    tokens, target = _batch()
    # stage 0 = embed and up: relu(up) crosses, fp32 as compiled, bf16 under the engine's autocast
    pipe = octopipe.compile(_model(), "cpux2", example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                            num_microbatches=2, schedule="1f1b", partition=[0, 2, 9], quiet=True)
    assert [spec.dtype for spec in pipe.stages[0].outputs] == [torch.float32]
    with pytest.raises(OctopipeError, match="is .*bfloat16, but the pipeline was compiled for .*float32"):
        launch(_mismatched_worker, 2, args=(pipe,))


def test_profile_costs_measure_under_autocast():
    model = _model()
    tokens, target = _batch()
    graph = octopipe.compile(model, "cpux2", example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                             num_microbatches=2, schedule="1f1b", quiet=True).graph
    micro = (tokens[:4],)
    plain = profile_costs(graph, micro, example_target=target[:4], repeats=1, warmup=0)
    mixed = profile_costs(graph, micro, example_target=target[:4], repeats=1, warmup=0, autocast="bf16")
    up = next(i for i, layer in enumerate(graph.layers) if layer.name.startswith("up"))
    assert mixed.layers[up].output_bytes == plain.layers[up].output_bytes / 2  # its bf16 output is what it sends
    half = profile_costs(graph, micro, example_target=target[:4], repeats=1, warmup=0, autocast="fp16")
    assert half.layers[up].output_bytes == mixed.layers[up].output_bytes
    with pytest.raises(ArgumentError, match="autocast takes"):
        profile_costs(graph, micro, example_target=target[:4], autocast="fp8")


def _plain_fp16(model):
    """torch.amp.GradScaler training of each microbatch under fp16 autocast: (loss, unscaled grads)."""
    tokens, target = _batch()
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    total = 0.0
    for x, y in zip(tokens.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(x), y) / MICROBATCHES
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.unscale_(optimizer)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


def _overflow_worker(rank, world_size, pipe):
    # a scale so large the fp16 gradients overflow on the loss stage's rank: every rank must skip
    from octopipe.runtime.amp import LossScaler

    tokens, target = _batch()
    engine = pipe.engine(rank, timeout_s=30, loss_scaler=LossScaler(init_scale=2.0**100))
    engine.step((tokens,), target)
    skipped = (engine.skipped_step, all(p.grad is None for _, p in engine.named_parameters()),
               engine.loss_scaler.scale, engine.state_dict()["loss_scaler"],
               engine.clip_grad_norm_(1.0))  # the gradients overflowed: an infinite norm, as torch reports
    engine.loss_scaler.scale = 2.0**16
    loss = engine.step((tokens,), target)
    return skipped, (engine.skipped_step, loss, {name: p.grad.clone() for name, p in engine.named_parameters()})


@pytest.mark.timeout(180)
def test_fp16_pipeline_equals_gradscaler_training_and_skips_overflowing_steps_together():
    model = _model()
    pipes = _pipes(model, autocast="fp16")
    crossing = {spec.dtype for pipe in pipes for stage in pipe.stages for spec in stage.outputs}
    assert torch.float16 in crossing  # scaled fp16 gradients come back across stages too
    per_rank = launch(_worker, 2, args=(pipes,))
    plain_loss, plain_grads = _plain_fp16(model)
    bf16_loss, _ = _plain(model, autocast=True)
    assert abs(plain_loss - bf16_loss) > 1e-4  # fp16 is really on
    _assert_every_schedule_equals(per_rank, plain_loss, plain_grads)  # unscaled as GradScaler unscales
    results = launch(_overflow_worker, 2, args=(pipes[1],))
    for skipped, _ in results:
        assert skipped == (True, True, 2.0**99, {"scale": 2.0**99, "good_steps": 0}, math.inf)
    assert not any(after[0] for _, after in results)
    assert results[0][1][1] == pytest.approx(plain_loss, rel=1e-6)
    grads = {**results[0][1][2], **results[1][1][2]}
    assert all(torch.equal(grad, plain_grads[name]) for name, grad in grads.items())


def test_loss_scaler_grows_backs_off_and_is_only_for_fp16():
    from octopipe.runtime.amp import LossScaler

    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0 and scaler.good_steps == 0
    scaler.update(False)
    scaler.update(True)  # backs off and starts counting again
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    with pytest.raises(ArgumentError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)
    tokens, target = _batch()
    pipe = octopipe.compile(_model(), "cpux2", example_inputs=(tokens,), example_target=target, loss_fn=_loss,
                            num_microbatches=2, schedule="1f1b", autocast="bf16", quiet=True)
    with pytest.raises(ArgumentError, match="loss_scaler=.*is for fp16"):
        pipe.engine(0, loss_scaler=LossScaler())
    # the scale travels in checkpoints (every rank's is the same: the merge keeps one)
    from octopipe.runtime.engine import merge_state_dicts

    half = octopipe.compile(_model(), "cpux2", num_devices=1, example_inputs=(tokens,), example_target=target,
                            loss_fn=_loss, num_microbatches=2, schedule="1f1b", autocast="fp16", quiet=True)
    engine = half.engine(0, loss_scaler=LossScaler(init_scale=2.0**9))
    engine.step((tokens,), target)
    state = merge_state_dicts([engine.state_dict(), {"model": {}}])
    assert state["loss_scaler"] == {"scale": 2.0**9, "good_steps": 1}
    restored = half.engine(0)
    restored.load_state_dict(state)
    assert (restored.loss_scaler.scale, restored.loss_scaler.good_steps) == (2.0**9, 1)


def test_loss_scaler_megatron_options_hysteresis_min_scale_and_static():
    from octopipe.runtime.amp import LossScaler

    # hysteresis 2 (Megatron's default): the first bad step since the scale last grew is skipped
    # without a backoff, the second backs off; a growth restores the allowance
    scaler = LossScaler(init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=16.0)
    scaler.update(True)
    assert scaler.scale == 64.0 and scaler.hysteresis_left == 1
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 32.0 and scaler.good_steps == 0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 16.0  # the floor, not 8
    assert scaler.state_dict() == {"scale": 16.0, "good_steps": 0, "hysteresis_left": -2}
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 32.0 and scaler.hysteresis_left == 2
    restored = LossScaler(hysteresis=2)
    restored.load_state_dict({"scale": 8.0, "good_steps": 1})  # a checkpoint without the tracker
    assert (restored.scale, restored.good_steps, restored.hysteresis_left) == (8.0, 1, 2)
    static = LossScaler(init_scale=128.0, growth_interval=1, dynamic=False)
    for bad in (True, False, False, True):
        static.update(bad)
    assert static.scale == 128.0
    assert LossScaler().state_dict() == {"scale": 2.0**16, "good_steps": 0}  # GradScaler's, as before
    for options in ({"hysteresis": 0}, {"min_scale": 2.0**20}, {"dynamic": 1}):
        with pytest.raises(ArgumentError, match="hysteresis >= 1, 0 <= min_scale <= init_scale"):
            LossScaler(**options)
