"""Building blocks shared by the reference models: norms, rotary embeddings, attention, MLPs.

Depends only on torch and `octopipe.errors`; produces plain `nn.Module`s that trace with
`torch.fx.symbolic_trace` and run on the meta device. Rules every module here follows, because
the compiler depends on them:

- forward takes and returns tensors only, with no Python control flow on tensor values or shapes
  (shape reads are passed straight into torch ops, which fx records);
- masks and rotary tables are built inside the module that uses them, so the hidden state is the
  only tensor that crosses from one block to the next;
- every op is deterministic and depends on one sample only (no dropout, no batch statistics), so
  a batch cut into microbatches gives the same outputs.

Glossary: *block* = one element of a model's `layers` ModuleList = one pipeline layer;
*mixer* = the token-mixing half of a block (attention or SSM); *GQA* = grouped-query attention,
`num_kv_heads` key/value heads shared by `num_heads` query heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octopipe.errors import OctopipeError

INIT_STD = 0.02

_Config = TypeVar("_Config", bound="ModelConfig")


class ModelConfigError(OctopipeError, ValueError):
    """A reference-model name, size or config field is invalid."""


# ---------------------------------------------------------------- configs


class ModelConfig:
    """Mixin for the frozen config dataclasses: checked overrides and the two standard sizes."""

    __slots__ = ()
    family: ClassVar[str] = ""

    @classmethod
    def tiny(cls: type[_Config]) -> _Config:
        raise NotImplementedError

    @classmethod
    def paper(cls: type[_Config]) -> _Config:
        raise NotImplementedError

    def replace(self: _Config, **overrides: Any) -> _Config:
        """A copy with `overrides` applied; unknown field names raise ModelConfigError."""
        names = {field.name for field in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ModelConfigError(f"{self.family} config has no field(s) {unknown}; valid fields: {sorted(names)}")
        return dataclasses.replace(self, **overrides)  # type: ignore[type-var]


def require(condition: bool, family: str, message: str) -> None:
    """Config validation: raise ModelConfigError naming the family when `condition` is false."""
    if not condition:
        raise ModelConfigError(f"{family} config: {message}")


def check_decoder_config(config: Any, rope: bool = True) -> None:
    """The checks every decoder config shares: positive sizes, GQA head grouping, RoPE's even
    head_dim."""
    family = config.family
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "max_seq_len"):
        value = getattr(config, field)
        require(value >= 1, family, f"{field}={value} must be >= 1")
    require(
        config.num_heads % config.num_kv_heads == 0,
        family,
        f"num_heads={config.num_heads} must be a multiple of num_kv_heads={config.num_kv_heads}",
    )
    if rope:
        require(config.head_dim % 2 == 0, family, f"head_dim={config.head_dim} must be even (RoPE)")


# ---------------------------------------------------------------- initialization


def init_weights(model: nn.Module, std: float = INIT_STD) -> None:
    """Linear and embedding weights ~ N(0, std), biases 0; everything else keeps its own init.

    Convolutions keep PyTorch's kaiming-uniform default (Mamba's and ViT's reference choice), norms
    their ones/zeros, and custom parameters (SSM decays, expert tensors, position embeddings) the
    init their module gave them. Deterministic under `torch.manual_seed`; a no-op on meta tensors.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)


def init_module(module: nn.Module, std: float = INIT_STD) -> None:
    """One module's own parameters as `build` initializes them (Linear and Embedding weights
    ~ N(0, std), biases 0, any other module its `reset_parameters()`), to run on every
    submodule like `nn.Module.apply`: how a rank fills the stages it created from a model built
    on the meta device (`pipe.engine(rank, device=..., init=init_module)`). Draws from torch's
    RNG on the module's device: the same distributions as `build`, not the same values."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    else:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


# ---------------------------------------------------------------- activations


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation (Gemma's GeGLU)."""
    return F.gelu(x, approximate="tanh")


def relu_squared(x: Tensor) -> Tensor:
    """ReLU(x)^2 (Nemotron-H's MLP)."""
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "relu2": relu_squared,
}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ModelConfigError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# ---------------------------------------------------------------- MLPs


class Fp32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in the weight's dtype and returned in the input's: under autocast a norm
    that reads a half-precision activation (Gemma's post-norms read a projection's output) would
    otherwise mix dtypes, which torch computes unfused, with a warning. As HF's Gemma norm does."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act="silu", GeGLU with act="gelu_tanh"."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.act_name = act
        self.act_fn = activation(act)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MLP(nn.Module):
    """down(act(up(x))): the ViT / projector GELU MLP and Nemotron-H's squared-ReLU MLP.

    Maps back to `hidden_size` unless `output_size` says otherwise (the vision projector).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "gelu",
        bias: bool = False,
        output_size: int | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.output_size = hidden_size if output_size is None else output_size
        self.act_name = act
        self.act_fn = activation(act)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, self.output_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


# ---------------------------------------------------------------- attention


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half form) with cos/sin tables precomputed up to `max_seq_len`.

    The tables are non-persistent buffers owned by each attention module, so a block carries its
    own and nothing but the hidden state crosses block boundaries. forward slices them to the
    input's sequence length, which must not exceed `max_seq_len`.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        inverse_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inverse_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the tables in place (they are in no checkpoint): what a rank that built this
        module on the meta device calls once its tensors exist (`runtime/materialize.py`)."""
        device = self.cos.device
        inverse_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                            / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32, device=device), inverse_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: Tensor) -> Tensor:
        """Rotate x [batch, heads, seq, head_dim] by its positions 0..seq-1."""
        seq_len = x.shape[-2]
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        # narrow, not [:seq_len]: under fx the buffer is a real tensor and seq_len a Proxy.
        cos = torch.narrow(self.cos, 0, 0, seq_len)
        sin = torch.narrow(self.sin, 0, 0, seq_len)
        return x * cos + rotated * sin


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> Tensor:
    """Boolean [seq, seq] mask: query i sees keys j with i - window < j <= i."""
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    """Multi-head attention with optional RoPE, GQA, sliding window and cross-attention.

    Self-attention: forward(x). Cross-attention (`context_size` set): forward(x, context), where
    queries come from x [batch, seq, hidden] and keys/values from context [batch, ctx, context_size]
    (no mask, no RoPE). Uses `F.scaled_dot_product_attention`, one fx node a cost pass can price.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        max_seq_len: int,
        rope_theta: float | None = None,
        causal: bool = True,
        sliding_window: int | None = None,
        bias: bool = False,
        context_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ModelConfigError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if context_size is not None and (causal or rope_theta is not None or sliding_window):
            raise ModelConfigError("cross-attention takes no causal mask, RoPE or sliding window")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.sliding_window = sliding_window
        self.is_cross_attention = context_size is not None
        kv_input_size = hidden_size if context_size is None else context_size
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(kv_input_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(kv_input_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(head_dim, max_seq_len, rope_theta) if rope_theta is not None else None

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        source = x if context is None else context
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(source).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        if self.rotary is not None:
            q = self.rotary(q)
            k = self.rotary(k)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.sliding_window is not None:
            mask = sliding_window_mask(q.shape[-2], self.sliding_window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(out.transpose(1, 2).flatten(2))


# ---------------------------------------------------------------- blocks and the LM shell


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    With post norms (Gemma-2's sandwich norm) each branch output is normalized again before the
    residual add. `mlp` is any [.., hidden] -> [.., hidden] module (dense MLP or MoE).
    """

    def __init__(
        self,
        attn: Attention,
        mlp: nn.Module,
        attn_norm: nn.Module,
        mlp_norm: nn.Module,
        post_attn_norm: nn.Module | None = None,
        post_mlp_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.post_attn_norm = post_attn_norm
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.post_mlp_norm = post_mlp_norm

    def forward(self, x: Tensor) -> Tensor:
        h = self.attn(self.attn_norm(x))
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


class DecoderLM(nn.Module):
    """embed -> layers (one block = one pipeline layer) -> norm -> head; returns logits.

    forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]. The families subclass it to
    build their blocks; anything family-specific around the stack (Gemma's embedding scale and
    logit soft-cap) lives inside `embed` / `head` so the top level stays a plain chain.
    """

    def __init__(self, embed: nn.Embedding, layers: list[nn.Module], norm: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(self.norm(hidden))


def llama_attention_block(
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    rope_theta: float,
    norm_eps: float,
    mlp: nn.Module,
) -> TransformerBlock:
    """The LLaMA block (RMSNorm, causal RoPE GQA attention, the given MLP), shared by the
    llama, deepseek and multimodal decoders."""
    attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, max_seq_len=max_seq_len, rope_theta=rope_theta)
    return TransformerBlock(attn, mlp, nn.RMSNorm(hidden_size, eps=norm_eps), nn.RMSNorm(hidden_size, eps=norm_eps))
