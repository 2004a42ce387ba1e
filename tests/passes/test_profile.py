"""profile_costs: per-layer F / B / W measured on the device, bytes from real tensors; layer cutting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from octopipe import ClusterSpec, CostTable, ExecutionError
from octopipe.models import MODEL_NAMES, build, config, example_inputs, example_target, lm_loss
from octopipe.passes.costs import analytic_costs
from octopipe.passes.profile import layer_modules, profile_costs
from octopipe.passes.trace import trace

pytestmark = pytest.mark.usefixtures("one_thread")


def traced(name: str, batch_size: int = 2):
    torch.manual_seed(0)
    model = build(name, "tiny")
    inputs = example_inputs(name, "tiny", batch_size=batch_size)
    target = example_target(name, "tiny", batch_size=batch_size)
    return model, inputs, target, trace(model, inputs, loss_fn=lm_loss, example_target=target)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_profiles_every_layer_of_the_reference_models(name):
    model, inputs, target, graph = traced(name)
    table = profile_costs(graph, inputs, example_target=target, repeats=3, warmup=1)
    assert isinstance(table, CostTable)
    assert [c.name for c in table] == [layer.name for layer in graph.layers]
    assert [c.kind for c in table] == [layer.kind for layer in graph.layers]
    cfg = config(name, "tiny")
    for cost, layer in zip(table, graph.layers):
        assert cost.forward_ms > 0 and cost.backward_ms > 0, cost
        assert 0 <= cost.backward_weight_ms <= cost.backward_ms
        assert cost.param_bytes == layer.num_params * 4  # fp32 model
        if layer.kind == "block":
            assert cost.output_bytes == 2 * cfg.max_seq_len * cfg.hidden_size * 4
            assert cost.activation_bytes > cost.output_bytes  # a block keeps more than its output
            assert cost.backward_weight_ms > 0
        if layer.kind == "loss":
            assert cost.backward_weight_ms == 0 and cost.output_bytes == 0
    # a tied embedding and head (gemma) is one table entry, sized from the parameter itself
    expected = [(s.name, s.layers) for s in graph.shared]
    assert [(t.name, t.layers) for t in table.tied] == expected
    assert [t.bytes for t in table.tied] == [dict(model.named_parameters())[n].numel() * 4 for n, _ in expected]
    assert bool(table.tied) == (name == "gemma")
    # a tensor read beyond the next layer (the multimodal model's image features, read by every
    # cross-attention layer) is one skip entry, sized from the tensor the run produced
    assert [(s.name, s.producer, s.consumers) for s in table.skips] == [
        (e.name, e.producer, tuple(sorted(set(e.consumers)))) for e in graph.skip_edges]
    assert bool(table.skips) == (name == "multimodal")
    for skip in table.skips:
        assert skip.bytes > 0 and table[skip.producer].output_bytes >= skip.bytes
    # what a split B leaves for W, measured from the stash, is what the analysis counts for it
    # in fp32: the split linears' inputs (each storage once: q, k, v read one) and output gradients
    analytic = analytic_costs(graph, ClusterSpec.preset("cpux2"), batch_size=2, dtype_bytes=4)
    assert [c.weight_stash_bytes for c in table] == [c.weight_stash_bytes for c in analytic]
    assert any(c.weight_stash_bytes for c in table) and table[-1].weight_stash_bytes == 0  # (the loss has no weight)
    # what a layer receives and saves none of: the loss's logits (it keeps their log-softmax);
    # every other layer saves its input (a norm's or a linear's), and the first receives none
    assert [c.unsaved_input_bytes for c in table] == [c.unsaved_input_bytes for c in analytic]
    assert [c.unsaved_input_bytes for c in table[:-1]] == [0] * (len(table) - 1)
    assert table[-1].unsaved_input_bytes == table[-2].output_bytes > 0


class Block(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class TwoWidths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.layers = nn.ModuleList([Block(128, 256), Block(128, 2048)])  # the second is 8x wider
        self.head = nn.Linear(128, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_heavier_layers_measure_more_and_backward_is_at_least_forward():
    torch.manual_seed(0)
    model = TwoWidths()
    ids, target = torch.randint(0, 64, (8, 64)), torch.randint(0, 64, (8, 64))
    graph = trace(model, (ids,), loss_fn=lm_loss, example_target=target)
    table = profile_costs(graph, (ids,), example_target=target, repeats=7, warmup=2)
    narrow, wide = table[1], table[2]
    assert wide.forward_ms > 1.5 * narrow.forward_ms
    assert wide.backward_ms > 1.5 * narrow.backward_ms
    assert wide.activation_bytes > narrow.activation_bytes and wide.param_bytes > 3 * narrow.param_bytes
    for cost in (narrow, wide):
        assert cost.backward_ms >= 0.8 * cost.forward_ms  # B + W is about twice F for matmuls
        assert cost.backward_weight_ms > 0
    # W reads up's input and output gradient, down's input (relu's output) and output gradient
    assert narrow.weight_stash_bytes == 8 * 64 * 4 * (128 + 256 + 256 + 128)
    assert wide.weight_stash_bytes == 8 * 64 * 4 * (128 + 2048 + 2048 + 128)


class Patches(nn.Module):
    """A linear on the model's float input (a vision encoder's patch embedding), then a block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 128)
        self.block = Block(128, 256)

    def forward(self, pixels):
        return self.block(self.embed(pixels))


def test_activations_count_each_storage_once_and_not_the_batch():
    # the runtime's meter counts per storage and leaves out the step's batch, which a microbatch
    # is a view of: the profile does too, whatever the example inputs are views of
    torch.manual_seed(0)
    model = Patches()
    batch, target = torch.randn(64, 16, 32), torch.randn(64, 16, 128)
    graph = trace(model, (batch[:8],), loss_fn=nn.functional.mse_loss, example_target=target[:8])
    viewed = profile_costs(graph, (batch[:8],), example_target=target[:8], repeats=1, warmup=0)
    copied = profile_costs(graph, (batch[:8].clone(),), example_target=target[:8].clone(), repeats=1, warmup=0)
    assert [c.activation_bytes for c in viewed] == [c.activation_bytes for c in copied]
    assert viewed[0].activation_bytes == 0  # the linear saves only the pixels: the batch's
    # the block saves its input (up's, 8 x 16 x 128 floats) and relu's output (down's and relu's
    # backward share it: one storage), 8 x 16 x 256
    assert viewed[1].activation_bytes == 8 * 16 * 4 * (128 + 256)


def test_cut_layers_run_in_sequence_reproduce_the_model():
    model, inputs, target, graph = traced("multimodal")
    values = dict(zip(graph.inputs, (*inputs, target)))
    for cut in layer_modules(graph):
        outputs = cut.module(*[values[name] for name in cut.inputs])
        values.update(zip(cut.outputs, outputs))
    torch.testing.assert_close(values["output"], lm_loss(model(*inputs), target))
    # each cut module holds the model's own parameters
    named = dict(model.named_parameters())
    for cut in layer_modules(graph):
        for name, parameter in cut.module.named_parameters():
            assert parameter is named[name]


def test_profile_errors():
    _, inputs, target, graph = traced("llama")
    with pytest.raises(ExecutionError, match=r"takes 2 inputs \['input_ids', 'target'\], got 1"):
        profile_costs(graph, inputs)
    with pytest.raises(ExecutionError, match="repeats must be >= 1"):
        profile_costs(graph, inputs, example_target=target, repeats=0)
    with torch.device("meta"):
        model = build("llama", "tiny")
        meta_inputs = example_inputs("llama", "tiny", batch_size=2)
        meta_target = example_target("llama", "tiny", batch_size=2)
    meta_graph = trace(model, meta_inputs, loss_fn=lm_loss, example_target=meta_target)
    with pytest.raises(ExecutionError, match="the model is on the meta device"):
        profile_costs(meta_graph, meta_inputs, example_target=meta_target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiles_on_the_gpu():
    torch.manual_seed(0)
    model = build("llama", "tiny").cuda()
    inputs = tuple(t.cuda() for t in example_inputs("llama", "tiny", batch_size=4))
    target = example_target("llama", "tiny", batch_size=4).cuda()
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target)
    table = profile_costs(graph, inputs, example_target=target, repeats=5, warmup=2)
    assert all(c.forward_ms > 0 and c.backward_ms >= c.backward_weight_ms >= 0 for c in table)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.norm(x)) + x


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_gradient_accumulation_joins_b_and_w(monkeypatch):
    # every microbatch after the first adds its gradients into .grad: (M-1)/M of the timed addition
    # joins B+W, and W's deferred weights' share of it joins W; nothing with one microbatch
    from octopipe.passes import profile

    torch.manual_seed(0)
    model = _TwoBlocks()
    x, y = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    graph = trace(model, (x,), loss_fn=nn.functional.mse_loss, example_target=y)
    accumulated = []

    def accumulate_time(params, timer):
        accumulated.append(sum(p.numel() for p in params))
        return 0.8

    monkeypatch.setattr(profile._Timer, "__call__", lambda self, fn: 2.0)
    monkeypatch.setattr(profile, "_accumulate_time", accumulate_time)
    real_split = profile._split_times
    shares = []

    def split_times(*args):
        share = real_split(*args)[2]
        shares.append(share)
        return (1.0, 1.0, share, 0) if share else (0.0, 0.0, 0.0, 0)

    monkeypatch.setattr(profile, "_split_times", split_times)
    single = profile_costs(graph, (x,), example_target=y, num_microbatches=1)
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    assert accumulated == [per_block, per_block]  # timed at M=1 too (the blocks' parameters; the loss layer has none)
    blocks = [cost for cost in single if cost.kind == "block"]
    assert len(blocks) == 2 and all(c.backward_ms == 2.0 and c.backward_weight_ms == 1.0 for c in blocks)
    assert single.num_microbatches == 1
    shares.clear()
    four = profile_costs(graph, (x,), example_target=y, num_microbatches=4)
    linear = sum(p.numel() for p in model.blocks[0].proj.parameters())
    assert [s for s in shares if s] == [pytest.approx(linear / per_block)] * 2  # W defers the linear's weight, bias
    for cost in (c for c in four if c.kind == "block"):
        assert cost.backward_ms == pytest.approx(2.0 + 0.75 * 0.8)
        assert cost.backward_weight_ms == pytest.approx(1.0 + 0.75 * 0.8 * linear / per_block)
        assert (cost.accumulate_ms, cost.accumulate_weight_ms) == (0.8, pytest.approx(0.8 * linear / per_block))
    # the M=1 table re-costed for 4 microbatches is the M=4 profile
    for recosted, measured in zip(single.for_microbatches(4), four):
        assert recosted.backward_ms == pytest.approx(measured.backward_ms)
        assert recosted.backward_weight_ms == pytest.approx(measured.backward_weight_ms)
    with pytest.raises(ExecutionError, match="num_microbatches must be a positive integer"):
        profile_costs(graph, (x,), example_target=y, num_microbatches=0)


def test_compile_profiles_with_its_microbatch_count(monkeypatch):
    import octopipe
    from octopipe.passes import profile

    seen = []
    real = profile.profile_costs
    monkeypatch.setattr(profile, "profile_costs", lambda *a, **k: seen.append(k["num_microbatches"]) or real(*a, **k))
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8), torch.randn(8, 3, 8)
    octopipe.compile(_TwoBlocks(), "cpux2", example_inputs=(x,), example_target=y, loss_fn=nn.functional.mse_loss,
                     num_microbatches=4, costs="profile", schedule="1f1b", quiet=True)
    assert seen == [4]
