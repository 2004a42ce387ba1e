"""Gemma-2-style decoder: a huge tied vocabulary and alternating local/global attention.

embedding (scaled by sqrt(hidden)) -> N x [RMSNorm, attention, RMSNorm (post), residual; RMSNorm,
GeGLU MLP, RMSNorm (post), residual] -> RMSNorm -> head -> logit soft-cap. Even layers use
sliding-window attention (a banded causal mask built inside the layer), odd layers global causal
attention. The head uses the embedding's weight: `model.head.weight is model.embed.weight`, one
Parameter shared by the first and the last pipeline layer.

Paper config follows Gemma-2-2B (Gemma Team 2024): vocab 256000, hidden 2304, 26 layers, 8 heads,
4 KV heads, head_dim 256, GeGLU intermediate 9216, RMSNorm eps 1e-6, final logit soft-cap 30:
2.61B parameters, 0.59B of them in the tied embedding. The sequence is 4096 and the window 2048
(Gemma-2 pairs a 4096 window with 8192 context; both are halved so local and global layers still
differ). Left out: attention-logit soft-capping (it rules out the fused attention kernel) and the
(1 + weight) norm parametrization (an equivalent reparametrization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from octopipe.models.common import (
    Attention,
    DecoderLM,
    Fp32RMSNorm,
    GatedMLP,
    ModelConfig,
    TransformerBlock,
    check_decoder_config,
    init_weights,
    require,
)


@dataclass(frozen=True, slots=True)
class GemmaConfig(ModelConfig):
    family: ClassVar[str] = "gemma"

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_seq_len: int
    sliding_window: int
    final_logit_softcap: float = 30.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_decoder_config(self)
        require(self.sliding_window >= 1, self.family, f"sliding_window={self.sliding_window} < 1")
        require(self.final_logit_softcap > 0, self.family, "final_logit_softcap must be > 0")

    @classmethod
    def tiny(cls) -> GemmaConfig:
        # A vocabulary far larger than the other tiny models keeps it head-heavy like the real one.
        return cls(
            vocab_size=1024,
            hidden_size=32,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            max_seq_len=32,
            sliding_window=8,
        )

    @classmethod
    def paper(cls) -> GemmaConfig:
        return cls(
            vocab_size=256000,
            hidden_size=2304,
            num_layers=26,
            num_heads=8,
            num_kv_heads=4,
            head_dim=256,
            intermediate_size=9216,
            max_seq_len=4096,
            sliding_window=2048,
        )

    def is_sliding(self, layer_index: int) -> bool:
        """Gemma-2 alternates: layer 0 local (sliding window), layer 1 global, and so on."""
        return layer_index % 2 == 0


class ScaledEmbedding(nn.Embedding):
    """Token embedding multiplied by sqrt(hidden): Gemma's input normalizer."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = math.sqrt(embedding_dim)

    def forward(self, input_ids: Tensor) -> Tensor:
        return super().forward(input_ids) * self.scale


class SoftCappedHead(nn.Linear):
    """LM head whose logits are soft-capped: cap * tanh(logits / cap)."""

    def __init__(self, in_features: int, out_features: int, softcap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.softcap = softcap

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x) / self.softcap) * self.softcap


class GemmaModel(DecoderLM):
    """forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]; head tied to embed."""

    def __init__(self, config: GemmaConfig) -> None:
        hidden = config.hidden_size

        def norm() -> nn.RMSNorm:
            return nn.RMSNorm(hidden, eps=config.norm_eps)

        layers = [
            TransformerBlock(
                attn=Attention(
                    hidden,
                    config.num_heads,
                    config.num_kv_heads,
                    config.head_dim,
                    max_seq_len=config.max_seq_len,
                    rope_theta=config.rope_theta,
                    sliding_window=config.sliding_window if config.is_sliding(index) else None,
                ),
                mlp=GatedMLP(hidden, config.intermediate_size, act="gelu_tanh"),
                attn_norm=norm(),
                mlp_norm=norm(),
                post_attn_norm=Fp32RMSNorm(hidden, eps=config.norm_eps),  # (they read a projection's output)
                post_mlp_norm=Fp32RMSNorm(hidden, eps=config.norm_eps),
            )
            for index in range(config.num_layers)
        ]
        embed = ScaledEmbedding(config.vocab_size, hidden)
        head = SoftCappedHead(hidden, config.vocab_size, config.final_logit_softcap)
        head.weight = embed.weight
        super().__init__(embed=embed, layers=layers, norm=norm(), head=head)
        self.config = config
        init_weights(self)
