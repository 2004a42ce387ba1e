"""Vision-language model: a ViT encoder whose output feeds cross-attention deep in an LLM.

pixel_values -> vision (conv patch embedding + learned position embedding, pre-norm ViT blocks,
LayerNorm) -> projector (Linear, GELU, Linear) -> vision features [batch, patches, hidden].
input_ids -> embed -> decoder blocks -> RMSNorm -> head. Every `cross_attention_every`-th decoder
block (indices k-1, 2k-1, ...) is a cross-attention block (queries from the text, keys/values from
the vision features, Llama-3.2-Vision / Flamingo style); the rest are LLaMA self-attention blocks.
The vision features are therefore a tensor produced before the decoder and consumed deep inside
it: a skip connection across pipeline stages.

forward(pixel_values [batch, 3, H, W], input_ids [batch, seq]) -> logits [batch, seq, vocab].

Paper config: CLIP ViT-L/14 at 336 px (24 layers, hidden 1024, 16 heads, MLP 4096, 576 patches;
304M) + a 2-layer GELU projector to 4096 (21M) + a LLaMA-2-7B-sized decoder (32 blocks, hidden
4096, 32 heads, SwiGLU 11008, vocab 32000; 6.74B) in which every 4th block cross-attends: 7.06B,
the size of LLaVA-1.5-7B. Left out: the ViT's class token and pre-LayerNorm, and Llama-3.2-Vision's
tanh gates on the cross-attention branches (zero-initialized gates would give the cross-attention
weights zero gradients at init).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from octopipe.models.common import (
    INIT_STD,
    MLP,
    Attention,
    GatedMLP,
    ModelConfig,
    TransformerBlock,
    check_decoder_config,
    init_weights,
    llama_attention_block,
    require,
)


@dataclass(frozen=True, slots=True)
class MultimodalConfig(ModelConfig):
    family: ClassVar[str] = "multimodal"

    # vision encoder
    image_size: int
    patch_size: int
    vision_hidden_size: int
    vision_num_layers: int
    vision_num_heads: int
    vision_intermediate_size: int
    # language decoder
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    cross_attention_every: int
    max_seq_len: int
    num_channels: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    vision_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        require(
            self.image_size % self.patch_size == 0,
            self.family,
            f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}",
        )
        require(
            self.vision_hidden_size % self.vision_num_heads == 0,
            self.family,
            f"vision_hidden_size={self.vision_hidden_size} must be a multiple of "
            f"vision_num_heads={self.vision_num_heads}",
        )
        check_decoder_config(self)
        require(
            1 <= self.cross_attention_every <= self.num_layers,
            self.family,
            f"cross_attention_every={self.cross_attention_every} must be in 1..num_layers="
            f"{self.num_layers} so at least one block cross-attends",
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def is_cross_attention(self, layer_index: int) -> bool:
        return layer_index % self.cross_attention_every == self.cross_attention_every - 1

    @classmethod
    def tiny(cls) -> MultimodalConfig:
        return cls(
            image_size=16,
            patch_size=4,
            vision_hidden_size=32,
            vision_num_layers=2,
            vision_num_heads=4,
            vision_intermediate_size=64,
            vocab_size=256,
            hidden_size=32,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=64,
            cross_attention_every=2,
            max_seq_len=32,
        )

    @classmethod
    def paper(cls) -> MultimodalConfig:
        return cls(
            image_size=336,
            patch_size=14,
            vision_hidden_size=1024,
            vision_num_layers=24,
            vision_num_heads=16,
            vision_intermediate_size=4096,
            vocab_size=32000,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            intermediate_size=11008,
            cross_attention_every=4,
            max_seq_len=4096,
        )


class PatchEmbedding(nn.Module):
    """Conv patchify [b, c, H, W] -> [b, patches, hidden], plus a learned position embedding."""

    def __init__(self, num_channels: int, hidden_size: int, patch_size: int, num_patches: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.num_patches = num_patches
        self.proj = nn.Conv2d(num_channels, hidden_size, patch_size, stride=patch_size)
        self.position = nn.Parameter(torch.empty(1, num_patches, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The position embedding ~ N(0, INIT_STD) (the projection is a module of its own)."""
        nn.init.normal_(self.position, std=INIT_STD)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.proj(pixel_values).flatten(2).transpose(1, 2) + self.position


class VisionEncoder(nn.Module):
    """ViT: patch_embed -> layers (bidirectional attention, GELU MLP, LayerNorm) -> norm."""

    def __init__(self, config: MultimodalConfig) -> None:
        super().__init__()
        hidden = config.vision_hidden_size
        self.patch_embed = PatchEmbedding(config.num_channels, hidden, config.patch_size, config.num_patches)
        self.layers = nn.ModuleList(
            TransformerBlock(
                attn=Attention(
                    hidden,
                    config.vision_num_heads,
                    config.vision_num_heads,
                    hidden // config.vision_num_heads,
                    max_seq_len=config.num_patches,
                    causal=False,
                    bias=True,
                ),
                mlp=MLP(hidden, config.vision_intermediate_size, act="gelu", bias=True),
                attn_norm=nn.LayerNorm(hidden, eps=config.vision_norm_eps),
                mlp_norm=nn.LayerNorm(hidden, eps=config.vision_norm_eps),
            )
            for _ in range(config.vision_num_layers)
        )
        self.norm = nn.LayerNorm(hidden, eps=config.vision_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        hidden = self.patch_embed(pixel_values)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


class CrossAttentionBlock(nn.Module):
    """x + cross_attn(attn_norm(x), vision), then x + mlp(mlp_norm(x)): forward(x, vision)."""

    def __init__(self, config: MultimodalConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.attn_norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.attn = Attention(
            hidden,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            max_seq_len=config.max_seq_len,
            causal=False,
            context_size=hidden,
        )
        self.mlp_norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, act="silu")

    def forward(self, x: Tensor, vision: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), vision)
        return x + self.mlp(self.mlp_norm(x))


class MultimodalModel(nn.Module):
    """forward(pixel_values, input_ids) -> logits [batch, seq, vocab]."""

    def __init__(self, config: MultimodalConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.vision = VisionEncoder(config)
        self.projector = MLP(config.vision_hidden_size, hidden, act="gelu", bias=True, output_size=hidden)
        self.embed = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            CrossAttentionBlock(config)
            if config.is_cross_attention(index)
            else llama_attention_block(
                hidden_size=hidden,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                max_seq_len=config.max_seq_len,
                rope_theta=config.rope_theta,
                norm_eps=config.norm_eps,
                mlp=GatedMLP(hidden, config.intermediate_size, act="silu"),
            )
            for index in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=config.norm_eps)
        self.head = nn.Linear(hidden, config.vocab_size, bias=False)
        init_weights(self)

    def forward(self, pixel_values: Tensor, input_ids: Tensor) -> Tensor:
        vision = self.projector(self.vision(pixel_values))
        hidden = self.embed(input_ids)
        for layer in self.layers:
            if isinstance(layer, CrossAttentionBlock):
                hidden = layer(hidden, vision)
            else:
                hidden = layer(hidden)
        return self.head(self.norm(hidden))
