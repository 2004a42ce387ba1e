"""Reference models: shapes, gradients, fx/export fidelity, microbatch exactness, paper sizes."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octopipe.models import (
    MODEL_NAMES,
    ModelConfigError,
    build,
    config,
    example_inputs,
    example_target,
    lm_loss,
)
from octopipe.models.common import Attention
from octopipe.models.deepseek import MoE
from octopipe.models.multimodal import CrossAttentionBlock
from octopipe.models.nemotron_h import Mamba2Mixer, segment_sum, ssd

# Published parameter counts of the models the paper configs follow; ours must be within 25%.
PUBLISHED_PARAMS = {
    "llama": 13.0e9,  # LLaMA-2-13B: 13.0B (Touvron et al. 2023, Table 1)
    "gemma": 2.61e9,  # Gemma-2-2B: 2.61B (Gemma Team 2024, Table 1: 2,614,341,888)
    "deepseek": 16.4e9,  # DeepSeek-MoE-16B: 16.4B total (Dai et al. 2024)
    "nemotron-h": 8.89e9,  # NVIDIA-Nemotron-Nano-9B-v2: 8.89B (model card)
    # LLaVA-1.5-7B: 7.06B = CLIP ViT-L/14-336 (0.30B) + projector (0.02B) + Vicuna-7B (6.74B);
    # our cross-attention blocks replace every 4th self-attention block at the same size.
    "multimodal": 7.06e9,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(name: str, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return build(name, "tiny", **overrides)


def vocab_size(name: str, size: str = "tiny") -> int:
    return config(name, size).vocab_size


def split_batch(inputs: tuple[Tensor, ...], start: int, stop: int) -> tuple[Tensor, ...]:
    return tuple(tensor[start:stop] for tensor in inputs)


# ---------------------------------------------------------------- every model


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_forward_backward(name: str) -> None:
    model = tiny(name)
    inputs = example_inputs(name, batch_size=4)
    target = example_target(name, batch_size=4)
    seq_len = config(name).max_seq_len
    logits = model(*inputs)
    assert logits.shape == (4, seq_len, vocab_size(name))
    assert target.shape == (4, seq_len) and target.dtype == torch.long
    loss = lm_loss(logits, target)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for param_name, param in model.named_parameters():  # tied parameters are listed once
        assert param.grad is not None, param_name
        assert param.grad.abs().sum() > 0, f"{name}: {param_name} has an all-zero gradient"
        assert torch.isfinite(param.grad).all(), param_name


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_tiny_is_small_and_fast(name: str) -> None:
    model = tiny(name)
    assert 5_000 <= sum(p.numel() for p in model.parameters()) <= 1_000_000
    inputs, target = example_inputs(name), example_target(name)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        lm_loss(model(*inputs), target).backward()
        best = min(best, time.perf_counter() - start)
    assert best < 0.5, f"{name}: forward+backward took {best:.3f} s on one thread"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fx_trace_matches_eager_exactly(name: str) -> None:
    model = tiny(name)
    inputs = example_inputs(name)
    traced = torch.fx.symbolic_trace(model)
    assert torch.equal(traced(*inputs), model(*inputs))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_export_matches_eager(name: str) -> None:
    model = tiny(name)
    inputs = example_inputs(name)
    exported = torch.export.export(model, inputs, strict=False)
    torch.testing.assert_close(exported.module()(*inputs), model(*inputs), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_microbatches_give_the_same_output(name: str) -> None:
    model = tiny(name)
    inputs = example_inputs(name, batch_size=4)
    with torch.no_grad():
        whole = model(*inputs)
        halves = torch.cat([model(*split_batch(inputs, 0, 2)), model(*split_batch(inputs, 2, 4))])
    torch.testing.assert_close(halves, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_causal_future_tokens_do_not_change_the_past(name: str) -> None:
    model = tiny(name)
    inputs = example_inputs(name, batch_size=2)
    changed = list(inputs)
    changed[-1] = inputs[-1].clone()
    changed[-1][:, -4:] = (changed[-1][:, -4:] + 1) % vocab_size(name)
    with torch.no_grad():
        before, after = model(*inputs), model(*changed)
    torch.testing.assert_close(after[:, :-4], before[:, :-4], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, -4:], before[:, -4:])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_init_is_deterministic(name: str) -> None:
    first, second = tiny(name).state_dict(), tiny(name).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_pipeline_attributes(name: str) -> None:
    model = tiny(name)
    assert isinstance(model.embed, nn.Embedding)
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == config(name).num_layers
    assert isinstance(model.head, nn.Linear)
    assert isinstance(model.norm, nn.Module)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_paper_config_on_meta_device(name: str) -> None:
    with torch.device("meta"):
        model = build(name, "paper")
        inputs = example_inputs(name, "paper", batch_size=2)
        logits = model(*inputs)
    cfg = config(name, "paper")
    assert cfg.max_seq_len == 4096
    assert all(param.is_meta for param in model.parameters())
    assert all(tensor.is_meta for tensor in inputs)
    assert logits.is_meta and logits.shape == (2, 4096, cfg.vocab_size)
    num_params = sum(param.numel() for param in model.parameters())
    published = PUBLISHED_PARAMS[name]
    assert abs(num_params - published) <= 0.25 * published, f"{name}: {num_params:,} parameters"


# ---------------------------------------------------------------- the public API


def test_model_names() -> None:
    assert MODEL_NAMES == ("llama", "gemma", "deepseek", "nemotron-h", "multimodal")


def test_overrides_and_errors() -> None:
    assert len(tiny("llama", num_layers=6).layers) == 6
    assert config("gemma", "paper", num_layers=3).num_layers == 3
    assert len(tiny("nemotron-h", num_layers=11).layers) == 11
    with pytest.raises(ModelConfigError, match="unknown model"):
        build("gpt")
    with pytest.raises(ModelConfigError, match="unknown size"):
        config("llama", "huge")
    with pytest.raises(ModelConfigError, match="no field"):
        config("llama", hidden=3)
    with pytest.raises(ModelConfigError, match="num_kv_heads"):
        config("llama", num_kv_heads=3)
    with pytest.raises(ModelConfigError, match="layer_pattern"):
        config("nemotron-h", layer_pattern="M-X")
    with pytest.raises(ModelConfigError, match="seq_len"):
        example_inputs("llama", seq_len=10_000)


def test_example_data_is_deterministic_and_next_token() -> None:
    (first,) = example_inputs("llama", batch_size=3, seq_len=8)
    (second,) = example_inputs("llama", batch_size=3, seq_len=8)
    target = example_target("llama", batch_size=3, seq_len=8)
    assert torch.equal(first, second) and first.shape == (3, 8)
    assert torch.equal(target[:, :-1], first[:, 1:])
    pixels, ids = example_inputs("multimodal", batch_size=2)
    assert pixels.shape == (2, 3, 16, 16) and ids.shape == (2, config("multimodal").max_seq_len)


def test_lm_loss_is_mean_cross_entropy() -> None:
    logits = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits.transpose(1, 2), target)
    torch.testing.assert_close(lm_loss(logits, target), expected)


# ---------------------------------------------------------------- gemma


def test_gemma_head_is_tied_to_the_embedding() -> None:
    model = tiny("gemma")
    assert model.head.weight is model.embed.weight
    # In the fx graph the head's matmul reads the embedding's weight: the tie is an explicit edge.
    traced = torch.fx.symbolic_trace(model)
    (head_matmul,) = [node for node in traced.graph.nodes if node.target is F.linear]
    assert head_matmul.args[1].op == "get_attr" and head_matmul.args[1].target == "embed.weight"
    assert head_matmul.meta["nn_module_stack"].keys() == {"head"}
    with torch.device("meta"):
        paper = build("gemma", "paper")
    assert paper.head.weight is paper.embed.weight
    assert config("gemma").vocab_size > 2 * max(vocab_size(n) for n in MODEL_NAMES if n != "gemma")


def test_gemma_alternates_sliding_and_global_attention() -> None:
    model = tiny("gemma")
    window = config("gemma").sliding_window
    windows = [block.attn.sliding_window for block in model.layers]
    assert windows == [window, None, window, None]


def test_sliding_window_attention_forgets_old_tokens() -> None:
    torch.manual_seed(0)
    attn = Attention(16, 4, 2, 4, max_seq_len=16, rope_theta=10000.0, sliding_window=4)
    x = torch.randn(1, 16, 16)
    changed = x.clone()
    changed[:, 0] += 1.0
    with torch.no_grad():
        before, after = attn(x), attn(changed)
    torch.testing.assert_close(after[:, 4:], before[:, 4:], rtol=0, atol=1e-6)  # out of window
    assert not torch.allclose(after[:, 1:4], before[:, 1:4])  # within the window


# ---------------------------------------------------------------- deepseek


def moe_layers(model: nn.Module) -> list[MoE]:
    return [block.mlp for block in model.layers if isinstance(block.mlp, MoE)]


def test_deepseek_dense_then_moe() -> None:
    cfg = config("deepseek")
    model = tiny("deepseek")
    kinds = [isinstance(block.mlp, MoE) for block in model.layers]
    assert kinds == [False] * cfg.num_dense_layers + [True] * (cfg.num_layers - cfg.num_dense_layers)
    moe = moe_layers(model)[0]
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.expert_hidden_size) == (
        cfg.num_experts,
        cfg.top_k,
        cfg.num_shared_experts,
        cfg.expert_hidden_size,
    )


def test_moe_gate_keeps_top_k_softmax_weights() -> None:
    moe = moe_layers(tiny("deepseek"))[0]
    x = torch.randn(2, 8, moe.hidden_size)
    with torch.no_grad():
        gate = moe.gate(x)
        probs = F.softmax(moe.router(x), dim=-1)
    assert ((gate != 0).sum(-1) == moe.top_k).all()
    torch.testing.assert_close(gate.sum(-1), probs.topk(moe.top_k, dim=-1).values.sum(-1))


def test_moe_matches_sparse_dispatch() -> None:
    moe = moe_layers(tiny("deepseek"))[0]
    x = torch.randn(3, 5, moe.hidden_size)
    with torch.no_grad():
        dense = moe(x)
        probs = F.softmax(moe.router(x), dim=-1)
        top = probs.topk(moe.top_k, dim=-1)
        sparse = moe.shared_experts(x)
        for token in range(x.shape[0] * x.shape[1]):
            b, s = divmod(token, x.shape[1])
            for weight, expert in zip(top.values[b, s], top.indices[b, s], strict=True):
                hidden = F.silu(x[b, s] @ moe.expert_gate_weight[expert]) * (x[b, s] @ moe.expert_up_weight[expert])
                sparse[b, s] += weight * (hidden @ moe.expert_down_weight[expert])
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-6)


def test_moe_token_output_depends_only_on_that_token() -> None:
    moe = moe_layers(tiny("deepseek"))[0]
    x = torch.randn(2, 8, moe.hidden_size)
    changed = x.clone()
    changed[:, 3:] = torch.randn(2, 5, moe.hidden_size)
    changed[1] = torch.randn(8, moe.hidden_size)
    with torch.no_grad():
        before, after = moe(x), moe(changed)
    torch.testing.assert_close(after[0, :3], before[0, :3], rtol=0, atol=1e-6)
    alone = torch.cat([moe(x[:, t : t + 1]) for t in range(8)], dim=1).detach()
    torch.testing.assert_close(alone, before, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- nemotron-h


def sequential_ssm(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The Mamba-2 recurrence, one step at a time (the reference for the quadratic form)."""
    batch, length, heads, head_dim = x.shape
    heads_per_group = heads // B.shape[2]
    B, C = B.repeat_interleave(heads_per_group, 2), C.repeat_interleave(heads_per_group, 2)
    state = torch.zeros(batch, heads, head_dim, B.shape[-1])
    outputs = []
    for t in range(length):
        decay = torch.exp(A * dt[:, t])[:, :, None, None]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        state = decay * state + update
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(outputs, dim=1)


def test_ssd_quadratic_form_matches_the_recurrence() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 4, 3, generator=generator)
    dt = F.softplus(torch.randn(2, 12, 4, generator=generator))
    A = -torch.rand(4, generator=generator) * 2
    B = torch.randn(2, 12, 2, 5, generator=generator)
    C = torch.randn(2, 12, 2, 5, generator=generator)
    torch.testing.assert_close(ssd(x, dt, A, B, C), sequential_ssm(x, dt, A, B, C))


def test_segment_sum() -> None:
    a = torch.tensor([1.0, 2.0, 4.0])
    expected = torch.tensor([[0.0, -torch.inf, -torch.inf], [2.0, 0.0, -torch.inf], [6.0, 4.0, 0.0]])
    assert torch.equal(segment_sum(a), expected)


def test_nemotron_pattern_and_mixer_attributes() -> None:
    cfg = config("nemotron-h")
    model = tiny("nemotron-h")
    kinds = [block.kind for block in model.layers]
    assert set(kinds) == {"mamba", "mlp", "attention"}
    symbols = {"mamba": "M", "mlp": "-", "attention": "*"}
    assert "".join(symbols[kind] for kind in kinds) == cfg.layer_pattern
    mixer = model.layers[kinds.index("mamba")].mixer
    assert isinstance(mixer, Mamba2Mixer)
    assert (mixer.d_state, mixer.num_heads, mixer.head_dim, mixer.d_conv, mixer.n_groups) == (
        cfg.d_state,
        cfg.mamba_num_heads,
        cfg.mamba_head_dim,
        cfg.d_conv,
        cfg.n_groups,
    )
    assert mixer.d_inner == cfg.mamba_num_heads * cfg.mamba_head_dim
    paper = config("nemotron-h", "paper").layer_pattern
    assert (len(paper), paper.count("M"), paper.count("-"), paper.count("*")) == (56, 27, 25, 4)


# ---------------------------------------------------------------- multimodal


def test_multimodal_cross_attention_consumes_the_vision_features() -> None:
    cfg = config("multimodal")
    model = tiny("multimodal")
    cross = [isinstance(block, CrossAttentionBlock) for block in model.layers]
    assert cross == [cfg.is_cross_attention(index) for index in range(cfg.num_layers)]
    assert any(cross) and not all(cross) and not cross[0]
    assert len(model.vision.layers) == cfg.vision_num_layers
    pixels, ids = example_inputs("multimodal", batch_size=2)
    with torch.no_grad():
        before = model(pixels, ids)
        after = model(pixels + 1.0, ids)
        features = model.projector(model.vision(pixels))
    assert features.shape == (2, cfg.num_patches, cfg.hidden_size)
    assert not torch.allclose(before, after)
    # The vision features skip to the cross-attention blocks' key/value projections, nothing else.
    traced = torch.fx.symbolic_trace(model)
    (features_node,) = [node for node in traced.graph.nodes if node.target == "projector.down_proj"]
    consumers = {user.target for user in features_node.users}
    cross_indices = [index for index in range(cfg.num_layers) if cross[index]]
    assert consumers == {f"layers.{i}.attn.{p}_proj" for i in cross_indices for p in ("k", "v")}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bf16_autocast_mixes_no_dtypes_in_a_norm(name: str) -> None:
    # Gemma's post-norms read a projection's bf16 output; an fp32 weight beside it made torch
    # compute the norm unfused and warn ("Mismatch dtype between input and weight")
    torch.manual_seed(0)
    model = build(name, "tiny")
    inputs = example_inputs(name, "tiny", batch_size=2)
    target = example_target(name, "tiny", batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(*inputs), target)
        loss.backward()
    assert torch.isfinite(loss)
