"""LLaMA-style dense decoder: the homogeneous reference model.

token embedding -> N x [RMSNorm, causal RoPE attention with GQA, RMSNorm, SwiGLU MLP] -> RMSNorm ->
untied LM head. Every block is identical, so a uniform partition is already balanced except for
the embedding and the head.

Paper config follows LLaMA-2-13B (Touvron et al. 2023): hidden 5120, 40 layers, 40 heads (13B
uses full multi-head attention, num_kv_heads = 40; GQA is exercised by the tiny config),
head_dim 128, SwiGLU intermediate 13824, vocab 32000, sequence 4096, RoPE theta 1e4, RMSNorm eps
1e-5: 13.0B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from octopipe.models.common import (
    DecoderLM,
    GatedMLP,
    ModelConfig,
    check_decoder_config,
    init_weights,
    llama_attention_block,
)


@dataclass(frozen=True, slots=True)
class LlamaConfig(ModelConfig):
    family: ClassVar[str] = "llama"

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        check_decoder_config(self)

    @classmethod
    def tiny(cls) -> LlamaConfig:
        return cls(
            vocab_size=256,
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_seq_len=32,
        )

    @classmethod
    def paper(cls) -> LlamaConfig:
        return cls(
            vocab_size=32000,
            hidden_size=5120,
            num_layers=40,
            num_heads=40,
            num_kv_heads=40,
            head_dim=128,
            intermediate_size=13824,
            max_seq_len=4096,
        )


class LlamaModel(DecoderLM):
    """forward(input_ids [batch, seq]) -> logits [batch, seq, vocab]."""

    def __init__(self, config: LlamaConfig) -> None:
        layers = [
            llama_attention_block(
                hidden_size=config.hidden_size,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                max_seq_len=config.max_seq_len,
                rope_theta=config.rope_theta,
                norm_eps=config.norm_eps,
                mlp=GatedMLP(config.hidden_size, config.intermediate_size, act="silu"),
            )
            for _ in range(config.num_layers)
        ]
        super().__init__(
            embed=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=layers,
            norm=nn.RMSNorm(config.hidden_size, eps=config.norm_eps),
            head=nn.Linear(config.hidden_size, config.vocab_size, bias=False),
        )
        self.config = config
        init_weights(self)
