"""Nemotron-H-style hybrid: Mamba-2, MLP and attention layers in an irregular pattern.

The layer pattern is a string, one character per layer: `M` = Mamba-2 mixer, `-` = squared-ReLU
MLP, `*` = causal GQA self-attention without positional encoding (the SSM layers carry position).
Each layer is one block: x + mixer(RMSNorm(x)). Embedding and head are untied.

The Mamba-2 mixer uses the SSD "quadratic" (matrix) form, fully tensorized: for each head,
y = (L o (C B^T)) (dt * x) + D * x, where L[i, j] = exp(sum_{j < k <= i} A dt_k) is the causal
cumulative-decay mask built by a segment sum. That costs O(seq^2) like attention, not the chunked
scan's O(seq), but has no loop over the sequence, so torch.fx traces it and the meta device runs it.

Paper config follows NVIDIA-Nemotron-Nano-9B-v2 (NVIDIA 2025): hidden 4480, 56 layers with
pattern M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M- (27 Mamba, 25 MLP, 4 attention),
Mamba 128 heads x 80 (inner 10240), state 128, 8 groups, conv 4; attention 40 heads / 8 KV heads
of 128; MLP intermediate 15680; vocab 131072; sequence 4096: 8.89B parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octopipe.models.common import (
    MLP,
    Attention,
    DecoderLM,
    ModelConfig,
    check_decoder_config,
    init_weights,
    require,
)

LAYER_KINDS = {"M": "mamba", "-": "mlp", "*": "attention"}


@dataclass(frozen=True, slots=True)
class NemotronHConfig(ModelConfig):
    family: ClassVar[str] = "nemotron-h"

    vocab_size: int
    hidden_size: int
    layer_pattern: str
    # attention layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # MLP layers
    intermediate_size: int
    # Mamba-2 layers
    mamba_num_heads: int
    mamba_head_dim: int
    d_state: int
    n_groups: int
    max_seq_len: int
    d_conv: int = 4
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        require(
            not unknown,
            self.family,
            f"layer_pattern has unknown layer kinds {unknown}; use M (Mamba), - (MLP), * (attention)",
        )
        check_decoder_config(self, rope=False)
        require(
            self.mamba_num_heads % self.n_groups == 0,
            self.family,
            f"mamba_num_heads={self.mamba_num_heads} must be a multiple of n_groups={self.n_groups}",
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    def replace(self, **overrides: Any) -> NemotronHConfig:
        """Also accepts `num_layers`: the pattern is cycled or cut to that length."""
        if "num_layers" in overrides:
            num_layers = overrides.pop("num_layers")
            require(num_layers >= 1, self.family, f"num_layers={num_layers} must be >= 1")
            pattern = overrides.get("layer_pattern", self.layer_pattern)
            overrides["layer_pattern"] = (pattern * math.ceil(num_layers / len(pattern)))[:num_layers]
        return ModelConfig.replace(self, **overrides)

    @classmethod
    def tiny(cls) -> NemotronHConfig:
        return cls(
            vocab_size=256,
            hidden_size=32,
            layer_pattern="M-M*-MM-",
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            mamba_num_heads=4,
            mamba_head_dim=16,
            d_state=8,
            n_groups=2,
            max_seq_len=32,
        )

    @classmethod
    def paper(cls) -> NemotronHConfig:
        return cls(
            vocab_size=131072,
            hidden_size=4480,
            layer_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=15680,
            mamba_num_heads=128,
            mamba_head_dim=80,
            d_state=128,
            n_groups=8,
            max_seq_len=4096,
        )


def segment_sum(a: Tensor) -> Tensor:
    """[.., seq] -> [.., seq, seq] with out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above.

    Built as a masked cumulative sum (not a difference of cumsums) so no large terms cancel.
    """
    positions = torch.arange(a.shape[-1], device=a.device)
    row, column = positions.unsqueeze(-1), positions.unsqueeze(0)
    summed = torch.cumsum(torch.where(row > column, a.unsqueeze(-1), 0.0), dim=-2)
    return summed.masked_fill(row < column, -torch.inf)


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """Mamba-2 state-space duality, quadratic form.

    x [b, l, h, p], dt [b, l, h] (after softplus), A [h] (negative), B and C [b, l, g, n] with the
    h heads split evenly over g groups. Returns y [b, l, h, p] of the recurrence
    state_t = exp(A dt_t) state_{t-1} + dt_t B_t x_t^T, y_t = C_t state_t, from a zero state.
    """
    heads_per_group = x.shape[2] // B.shape[2]
    B = B.repeat_interleave(heads_per_group, dim=2)
    C = C.repeat_interleave(heads_per_group, dim=2)
    decay = torch.exp(segment_sum((dt * A).transpose(1, 2)))  # [b, h, l, l]
    scores = torch.einsum("blhn,bshn->bhls", C, B) * decay
    return torch.einsum("bhls,bshp->blhp", scores, x * dt.unsqueeze(-1))


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: RMSNorm(y * silu(z)) over groups of `group_size` channels."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        gated = (y * F.silu(z)).unflatten(-1, (-1, self.group_size))
        return F.rms_norm(gated, (self.group_size,), eps=self.eps).flatten(-2) * self.weight


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer: in_proj -> (z, xBC, dt); causal depthwise conv1d + SiLU on xBC; SSD;
    D skip; gated group RMSNorm with z; out_proj.

    Attributes for a cost pass: `d_model`, `d_inner` (= num_heads * head_dim), `num_heads`,
    `head_dim`, `d_state`, `n_groups`, `d_conv`, `expand` (= d_inner / d_model).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        d_conv: int,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.d_state = d_state
        self.n_groups = n_groups
        self.d_conv = d_conv
        self.d_inner = num_heads * head_dim
        self.expand = self.d_inner / d_model
        self.conv_dim = self.d_inner + 2 * n_groups * d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + num_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1, bias=True
        )
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        self.D = nn.Parameter(torch.empty(num_heads))
        self.reset_parameters()
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // n_groups, eps=norm_eps)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def reset_parameters(self) -> None:
        """Mamba's init of the mixer's own parameters: decay rates A in [1, 16], step sizes dt in
        [1e-3, 1e-1] (log-uniform, stored as softplus's inverse), skip D = 1."""
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(1.0, 16.0)))
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            self.D.fill_(1.0)

    def forward(self, hidden: Tensor) -> Tensor:
        seq_len = hidden.shape[1]
        projected = self.in_proj(hidden)
        z = projected[..., : self.d_inner]
        xbc = projected[..., self.d_inner : self.d_inner + self.conv_dim]
        dt = projected[..., self.d_inner + self.conv_dim :]
        # Padding both sides then keeping the first seq_len outputs makes the conv causal.
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :seq_len].transpose(1, 2))
        group_width = self.n_groups * self.d_state
        x = xbc[..., : self.d_inner].unflatten(-1, (self.num_heads, self.head_dim))
        B = xbc[..., self.d_inner : self.d_inner + group_width].unflatten(-1, (self.n_groups, self.d_state))
        C = xbc[..., self.d_inner + group_width :].unflatten(-1, (self.n_groups, self.d_state))
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log)
        y = ssd(x, dt, A, B, C) + x * self.D.unsqueeze(-1)
        return self.out_proj(self.norm(y.flatten(-2), z))


class HybridBlock(nn.Module):
    """One pattern character: x + mixer(norm(x)). `kind` is "mamba", "mlp" or "attention"."""

    def __init__(self, kind: str, mixer: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.kind = kind
        self.norm = norm
        self.mixer = mixer

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mixer(self.norm(x))


def hybrid_block(config: NemotronHConfig, symbol: str) -> HybridBlock:
    kind = LAYER_KINDS[symbol]
    mixer: nn.Module
    if kind == "mamba":
        mixer = Mamba2Mixer(
            config.hidden_size,
            config.mamba_num_heads,
            config.mamba_head_dim,
            config.d_state,
            config.n_groups,
            config.d_conv,
            config.norm_eps,
        )
    elif kind == "mlp":
        mixer = MLP(config.hidden_size, config.intermediate_size, act="relu2")
    else:
        mixer = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            max_seq_len=config.max_seq_len,
            rope_theta=None,
        )
    return HybridBlock(kind, mixer, nn.RMSNorm(config.hidden_size, eps=config.norm_eps))


class NemotronHModel(DecoderLM):
    """forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__(
            embed=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=[hybrid_block(config, symbol) for symbol in config.layer_pattern],
            norm=nn.RMSNorm(config.hidden_size, eps=config.norm_eps),
            head=nn.Linear(config.hidden_size, config.vocab_size, bias=False),
        )
        self.config = config
        init_weights(self)
