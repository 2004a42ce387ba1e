"""DeepSeek-MoE-style decoder: a few dense layers, then mixture-of-experts layers.

embedding -> `num_dense_layers` LLaMA blocks (SwiGLU MLP) -> MoE blocks (same attention; the MLP
is `num_shared_experts` always-on experts plus `num_experts` routed experts, top-k softmax
routing) -> RMSNorm -> untied head. No auxiliary load-balancing loss.

Routed experts run as *dense masked compute*: every expert runs on every token and the outputs
are weighted by a [.., num_experts] gate matrix that is zero outside each token's top-k (the
scatter of its top-k softmax weights). That keeps shapes static, the module traceable by
torch.fx and runnable on the meta device, and each token's output a function of that token only
(microbatching is exact). It costs `num_experts / top_k` times the routed FLOPs a dispatching
kernel would: a cost pass should scale the routed einsums by `top_k / num_experts`, which is why
`MoE` exposes `num_experts`, `top_k`, `num_shared_experts` and `expert_hidden_size`.

Paper config follows DeepSeek-MoE-16B (Dai et al. 2024): vocab 102400, hidden 2048, 28 layers,
16 heads of 128, first layer dense (intermediate 10944), then 64 routed experts top-6 plus 2 shared
experts, expert hidden 1408, sequence 4096: 16.4B parameters (about 2.8B active per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octopipe.models.common import (
    INIT_STD,
    DecoderLM,
    GatedMLP,
    ModelConfig,
    check_decoder_config,
    init_weights,
    llama_attention_block,
    require,
)


@dataclass(frozen=True, slots=True)
class DeepSeekConfig(ModelConfig):
    family: ClassVar[str] = "deepseek"

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense layers' SwiGLU width
    num_dense_layers: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_hidden_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_decoder_config(self)
        require(
            0 <= self.num_dense_layers <= self.num_layers,
            self.family,
            f"num_dense_layers={self.num_dense_layers} must be in 0..num_layers={self.num_layers}",
        )
        require(
            1 <= self.top_k <= self.num_experts,
            self.family,
            f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}",
        )
        require(self.num_shared_experts >= 0, self.family, "num_shared_experts must be >= 0")

    @classmethod
    def tiny(cls) -> DeepSeekConfig:
        return cls(
            vocab_size=256,
            hidden_size=32,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            head_dim=8,
            intermediate_size=96,
            num_dense_layers=1,
            num_experts=4,
            top_k=2,
            num_shared_experts=1,
            expert_hidden_size=24,
            max_seq_len=32,
        )

    @classmethod
    def paper(cls) -> DeepSeekConfig:
        return cls(
            vocab_size=102400,
            hidden_size=2048,
            num_layers=28,
            num_heads=16,
            num_kv_heads=16,
            head_dim=128,
            intermediate_size=10944,
            num_dense_layers=1,
            num_experts=64,
            top_k=6,
            num_shared_experts=2,
            expert_hidden_size=1408,
            max_seq_len=4096,
        )


class MoE(nn.Module):
    """Shared SwiGLU experts plus top-k-routed SwiGLU experts, computed densely and masked.

    Routed expert weights are stacked: gate/up [num_experts, hidden, expert_hidden], down
    [num_experts, expert_hidden, hidden]. The shared experts are one SwiGLU MLP of width
    `num_shared_experts * expert_hidden_size` (as DeepSeek implements them).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int,
        expert_hidden_size: int,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_shared_experts = num_shared_experts
        self.expert_hidden_size = expert_hidden_size
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.expert_gate_weight = nn.Parameter(torch.empty(num_experts, hidden_size, expert_hidden_size))
        self.expert_up_weight = nn.Parameter(torch.empty(num_experts, hidden_size, expert_hidden_size))
        self.expert_down_weight = nn.Parameter(torch.empty(num_experts, expert_hidden_size, hidden_size))
        self.reset_parameters()
        self.shared_experts = (
            GatedMLP(hidden_size, num_shared_experts * expert_hidden_size, act="silu")
            if num_shared_experts > 0
            else None
        )

    def gate(self, x: Tensor) -> Tensor:
        """[.., num_experts] routing weights: the token's top-k softmax probabilities, else 0.

        DeepSeek-MoE takes the softmax over all experts and does not renormalize the top k.
        """
        probs = F.softmax(self.router(x), dim=-1)
        top = torch.topk(probs, self.top_k, dim=-1)
        return torch.zeros_like(probs).scatter(-1, top.indices, top.values)

    def reset_parameters(self) -> None:
        """The experts' own weights ~ N(0, INIT_STD) (the router and shared experts are modules of their own)."""
        for weight in (self.expert_gate_weight, self.expert_up_weight, self.expert_down_weight):
            nn.init.normal_(weight, std=INIT_STD)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate(x)
        hidden = F.silu(torch.einsum("...h,ehi->...ei", x, self.expert_gate_weight)) * torch.einsum(
            "...h,ehi->...ei", x, self.expert_up_weight
        )
        # Weighting before the down projection lets one einsum also sum over the experts.
        out = torch.einsum("...ei,eih->...h", hidden * gate.unsqueeze(-1), self.expert_down_weight)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepSeekModel(DecoderLM):
    """forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]."""

    def __init__(self, config: DeepSeekConfig) -> None:
        layers = []
        for index in range(config.num_layers):
            mlp: nn.Module
            if index < config.num_dense_layers:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, act="silu")
            else:
                mlp = MoE(
                    config.hidden_size,
                    config.num_experts,
                    config.top_k,
                    config.num_shared_experts,
                    config.expert_hidden_size,
                )
            layers.append(
                llama_attention_block(
                    hidden_size=config.hidden_size,
                    num_heads=config.num_heads,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                    max_seq_len=config.max_seq_len,
                    rope_theta=config.rope_theta,
                    norm_eps=config.norm_eps,
                    mlp=mlp,
                )
            )
        super().__init__(
            embed=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=layers,
            norm=nn.RMSNorm(config.hidden_size, eps=config.norm_eps),
            head=nn.Linear(config.hidden_size, config.vocab_size, bias=False),
        )
        self.config = config
        init_weights(self)
