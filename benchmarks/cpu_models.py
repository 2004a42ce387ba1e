"""CPU-sized configs of the reference models for the measured benchmarks (e2e_vs_torch, fidelity).

Big enough that a layer's compute (milliseconds on one core) dominates the runtime's per-op
overhead, small enough that a training step of 2 processes takes about a second.
"""

from __future__ import annotations

import torch

from octopipe import models

BATCH_SIZE = 16
NUM_MICROBATCHES = 8

CONFIGS = {
    "gemma": dict(hidden_size=160, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=40, intermediate_size=448,
                  vocab_size=12288, max_seq_len=128, sliding_window=32),
    "deepseek": dict(hidden_size=192, num_layers=6, num_dense_layers=2, num_experts=4, top_k=2, num_shared_experts=1,
                     expert_hidden_size=256, intermediate_size=512, vocab_size=6144, num_heads=4, num_kv_heads=2,
                     head_dim=48, max_seq_len=128),
    "nemotron-h": dict(hidden_size=160, layer_pattern="M-M*-MM-M-", num_heads=4, num_kv_heads=2, head_dim=40,
                       intermediate_size=448, mamba_num_heads=8, mamba_head_dim=40, d_state=32, n_groups=2,
                       vocab_size=8192, max_seq_len=128),
    "multimodal": dict(hidden_size=160, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=40, intermediate_size=448,
                       cross_attention_every=3, vocab_size=4096, max_seq_len=96, vision_hidden_size=128,
                       vision_num_layers=4, vision_num_heads=4, vision_intermediate_size=384, image_size=64,
                       patch_size=8),
}


def build(name: str):
    """(model, inputs, target) of `name` at its CPU config, deterministic."""
    overrides = CONFIGS[name]
    torch.manual_seed(0)
    model = models.build(name, "tiny", **overrides)
    inputs = models.example_inputs(name, "tiny", batch_size=BATCH_SIZE, **overrides)
    target = models.example_target(name, "tiny", batch_size=BATCH_SIZE, **overrides)
    return model, inputs, target
