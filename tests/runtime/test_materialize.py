"""A model built on the meta device: each rank creates only its own stages' tensors, from a
checkpoint or an init function, and trains exactly as the plain model does; what init leaves
unset is an error naming it, and a failed attempt leaves the stages as they were."""

import pytest
import torch
from pipeline_helpers import assert_grads_close, build_model, reference

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch
from octopipe.runtime.materialize import materialize
from octopipe.runtime.stage import StageModule


def _meta_pipe(name, schedule, num_devices=2, num_microbatches=4, **overrides):
    """Compile `name` built on the meta device, as every rank of a torchrun job does."""
    with torch.device("meta"):
        model = models.build(name, **overrides)
        inputs = models.example_inputs(name, batch_size=4, **overrides)
        target = models.example_target(name, batch_size=4, **overrides)
    cluster = octopipe.ClusterSpec.preset("cpu", num_devices=num_devices)
    return octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                            num_microbatches=num_microbatches, schedule=schedule, quiet=True)


def _step_from_checkpoint(rank, world_size, schedule, path):
    pipe = _meta_pipe("gemma", schedule)
    engine = pipe.engine(rank, init=path)
    _, inputs, target, _ = build_model("gemma")
    loss = engine.step(inputs, target)
    return loss, {name: p.grad.clone() for name, p in engine.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_meta_model_from_a_checkpoint_trains_like_the_plain_model(tmp_path, schedule):
    # gemma ties its head to its embedding (on both ranks); zb-h1 rewrites the linears, whose
    # weights a stage then reads by attribute, away from their nn.Linear
    model, *_ = build_model("gemma")
    path = tmp_path / "plain.pt"
    torch.save(model.state_dict(), path)  # a plain state dict: no "model" key, no rotary tables
    results = launch(_step_from_checkpoint, 2, (schedule, str(path)), timeout_s=90)
    (reference_loss,), reference_grads, _ = reference("gemma")
    seen = set()
    for loss, grads in results:
        assert loss == pytest.approx(reference_loss, rel=1e-5)
        assert_grads_close(grads, reference_grads, schedule)
        seen |= set(grads)
    assert seen == set(reference_grads)


def _step_from_init_function(rank, world_size):
    pipe = _meta_pipe("gemma", "1f1b")
    torch.manual_seed(100 + rank)  # each rank draws different values: the tied weight must still agree
    engine = pipe.engine(rank, init=models.init_module)
    _, inputs, target, _ = build_model("gemma")
    loss = engine.step(inputs, target)
    state = engine.gather_state_dict(0)
    return loss, {name: p.grad.clone() for name, p in engine.named_parameters()}, state


@pytest.mark.timeout(120)
def test_meta_model_with_an_init_function_is_one_consistent_model():
    results = launch(_step_from_init_function, 2, (), timeout_s=90)
    state = results[0][2]
    for value in state["model"].values():
        assert torch.isfinite(value).all()
    # the weights the ranks drew, put into the plain model, give the pipeline's loss and gradients
    model, inputs, target, loss_fn = build_model("gemma")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.load_state_dict(state["model"], strict=False)
    assert not torch.equal(before["embed.weight"], model.embed.weight)  # values from the ranks, not seed 0's
    loss = loss_fn(model(*inputs), target)
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for rank_loss, grads, _ in results:
        assert rank_loss == pytest.approx(loss.item(), rel=1e-5)
        assert_grads_close(grads, expected, "init_module")


def test_a_meta_model_needs_init():
    pipe = _meta_pipe("llama", "1f1b")
    with pytest.raises(ExecutionError, match=r"rank 0: the model was built on the meta device.*init=") as error:
        pipe.engine(0)
    assert "octopipe.models.init_module" in str(error.value)


def test_a_meta_model_cannot_be_profiled_and_compile_says_which_costs_to_use():
    # was an ExecutionError from inside the profiling pass, naming an internal function
    with torch.device("meta"):
        model = models.build("llama")
        inputs, target = models.example_inputs("llama", batch_size=4), models.example_target("llama", batch_size=4)
    with pytest.raises(ArgumentError, match=r"costs='profile' .* meta device .* use costs='analytic'"):
        octopipe.compile(model, "cpux2", example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                         num_microbatches=4, costs="profile", quiet=True)


@pytest.mark.parametrize("init, message", [
    (lambda module: None, r"rank 0: \d+ tensors .* left uninitialized .*'embed.weight'.*init did not set them"),
    ({"model": {}}, r"rank 0: init checkpoint has no value for \d+ parameters .*'embed.weight'"),
    ("no-such-checkpoint.pt", r"init checkpoint 'no-such-checkpoint.pt' does not exist"),
    (42, r"init must be a checkpoint path, a state dict, a function of a module, or \"reset\""),
])
def test_what_init_leaves_unset_is_named_and_the_stages_stay_on_meta(init, message):
    pipe = _meta_pipe("llama", "1f1b")
    with pytest.raises(ExecutionError, match=message):
        pipe.engine(0, init=init)
    # nothing half-built is left behind: the next attempt starts from meta tensors again
    assert all(p.is_meta for stage in pipe.stages for p in stage.module.parameters())
    engine = pipe.engine(0, init=models.init_module)
    assert all(torch.isfinite(p).all() for _, p in engine.named_parameters())


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    pipe = _meta_pipe("llama", "1f1b")
    other, *_ = build_model("llama", hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ExecutionError, match=r"'embed.weight' has shape \(\d+, 32\), the model's is \(\d+, \d+\)"):
        pipe.engine(0, init=other.state_dict())


def test_reset_uses_each_modules_reset_parameters():
    pipe = _meta_pipe("llama", "zb-h1")
    engine = pipe.engine(1, init="reset")
    params = dict(engine.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    norm = next(name for name in params if name.endswith("norm.weight"))
    assert torch.equal(params[norm], torch.ones_like(params[norm]))  # RMSNorm's reset


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_init_module_covers_every_builtin_model_and_tables_are_recomputed(name):
    torch.manual_seed(0)
    plain = models.build(name)
    with torch.device("meta"):
        model = models.build(name)
    whole = StageModule(0, model, (), ())
    assert materialize([whole], torch.device("cpu"), models.init_module, rank=0)  # raises if anything stays unset
    for (key, value), (plain_key, plain_value) in zip(model.named_buffers(), plain.named_buffers()):
        assert key == plain_key and torch.equal(value, plain_value)  # RoPE tables: reset_buffers
    for (key, value), (_, plain_value) in zip(model.named_parameters(), plain.named_parameters()):
        assert value.shape == plain_value.shape and torch.isfinite(value).all(), key


def test_engine_on_a_real_model_keeps_its_parameters():
    model, inputs, target, loss_fn = build_model("gemma")
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=1), example_inputs=inputs,
                            example_target=target, loss_fn=loss_fn, num_microbatches=2, schedule="1f1b", quiet=True)
    engine = pipe.engine(0, device="cpu")
    assert {id(p) for _, p in engine.named_parameters()} == {id(p) for p in model.parameters()}


class _TwoEnds(torch.nn.Module):
    """The root holds a parameter read by the first layer and one read by the last."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Parameter(torch.zeros(8))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.last = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = x + self.first
        for layer in self.layers:
            x = layer(x)
        return x * self.last


def test_a_rank_creates_only_its_own_tensors_of_a_module_shared_with_another_rank():
    with torch.device("meta"):
        model, x, y = _TwoEnds(), torch.zeros(4, 8), torch.zeros(4, 8)
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=2), example_inputs=(x,),
                            example_target=y, loss_fn=torch.nn.functional.mse_loss, num_microbatches=2,
                            schedule="1f1b", quiet=True)

    def fill(module):
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    engine = pipe.engine(0, init=fill)
    mine = dict(engine.named_parameters())
    assert "first" in mine and "last" not in mine
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in mine.values())
    assert model.first is mine["first"] and model.last.is_meta  # rank 1's tensor is not built here


def test_a_meta_model_with_real_examples_is_told_where_each_is():
    # the example run's own error (a device mismatch) once came with advice about batch dims
    with torch.device("meta"):
        model = models.build("llama", "tiny", num_layers=2)
    inputs = models.example_inputs("llama", "tiny", batch_size=4, num_layers=2)
    target = models.example_target("llama", "tiny", batch_size=4, num_layers=2)
    with pytest.raises(ArgumentError, match=r"the model is on the meta device but example input 0, example_target "
                                            r"are on a real device"):
        octopipe.compile(model, "cpux2", example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                         num_microbatches=2, schedule="1f1b", quiet=True)
    real = models.build("llama", "tiny", num_layers=2)
    with pytest.raises(ArgumentError, match="the model is on a real device but example_target is on the meta device"):
        octopipe.compile(real, "cpux2", example_inputs=inputs, example_target=target.to("meta"),
                         loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b", quiet=True)


class _Tables(torch.nn.Module):
    """Two non-persistent tables, read by the last layer, that reset_buffers assigns anew."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.register_buffer("scale", self._scale(), persistent=False)
        self.register_buffer("mask", self._mask(), persistent=False)

    def _scale(self):
        return torch.linspace(0.5, 1.5, 8)

    def _mask(self):
        return torch.arange(8) % 2 == 0

    def reset_buffers(self):
        self.scale = self._scale()  # the usual idiom: assigned, not copied in
        self.mask = self._mask()

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale * self.mask


def test_tables_reset_buffers_assigns_anew_reach_the_stages_that_read_them():
    # found by fuzzing: the stage module kept the placeholder of a table reset_buffers assigned
    # anew (only its owner's attribute took the new one): a float table was refused as unset
    # although reset_buffers exists, a boolean one silently masked everything
    torch.manual_seed(0)
    plain = _Tables()
    with torch.device("meta"):
        model = _Tables()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = octopipe.compile(model, octopipe.ClusterSpec.preset("cpu", num_devices=2), example_inputs=(x.to("meta"),),
                            example_target=y.to("meta"), loss_fn=torch.nn.functional.mse_loss, num_microbatches=2,
                            schedule="1f1b", quiet=True)
    engine = pipe.engine(1, init=plain.state_dict())
    held = {id(b): b for stage in engine.stages.values() for b in stage.module.buffers()}
    assert len(held) == 2
    assert sorted(map(str, (b.dtype for b in held.values()))) == ["torch.bool", "torch.float32"]
    for table in held.values():
        assert torch.equal(table, plain.scale if table.dtype == torch.float32 else plain.mask)
