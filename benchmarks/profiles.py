"""The four GPU-profiled cost tables, with the byte counts the profiles leave out.

`load_profile(name)` reads data/profiles/<name>-seq<S>.json (per-layer forward and
backward ms, embedding merged into layer 0 and the head into the last layer) and fills, for a
microbatch of one sequence in bf16:

  output_bytes      the hidden state sent to the next stage: seq_len * hidden * 2.
  activation_bytes  what a layer keeps from F to B/W, after Korthikanti et al. ("Reducing
                    Activation Recomputation in Large Transformer Models", MLSys 2023): a
                    transformer block keeps 34 * s * h bytes (flash attention: no 5 a s^2 term).
                    - dense and MoE blocks (gpt-13B T, deepseek D and M, gpt-oss S and F): 34 s h
                      (an MoE block's active experts keep about what a dense MLP keeps; routing
                      buffers are not counted);
                    - Nemotron-H's sub-layers, from the same breakdown: self-attention + its norm
                      13 s h (11 + 2), MLP + its norm 21 s h (19 + 2), and a Mamba2 mixer
                      34 s h scaled by its median forward time over the median attention + MLP
                      pair's, i.e. about 22 s h.
                    The embedding and head merged into the first and last layer add nothing (the
                    head's logits are not counted).
  param_bytes       left out (None): the profiles do not say, and the baselines do not need it.

Hidden sizes are the models' published ones: gpt-13B 5120, deepseek-16B 2048 (DeepSeekMoE 16B),
gpt-oss-20B 2880, nemotron-nano-v2-9B 4480.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

from octopipe.errors import CostTableError
from octopipe.ir.costs import CostTable

PROFILE_DIR = Path(os.environ.get("OCTOPIPE_PROFILE_DIR", Path(__file__).resolve().parents[1] / "data/profiles"))
"""Where the profiled tables live: the repository's copy of the OctoPipe authors' published
profiles (data/profiles/, identical to ../shared/data/profiles/); override with $OCTOPIPE_PROFILE_DIR."""

HIDDEN_SIZE = {"gpt-13B": 5120, "deepseek-16B": 2048, "gpt-oss-20B": 2880, "nemotron-nano-v2-9B": 4480}
MODELS = tuple(HIDDEN_SIZE)

BYTES_PER_ELEMENT = 2  # bf16
TRANSFORMER_LAYER = 34  # activation bytes per (sequence position x hidden unit), Korthikanti et al.
ATTENTION_SUBLAYER = 13  # 11 (attention) + 2 (its LayerNorm)
MLP_SUBLAYER = 21  # 19 (MLP) + 2 (its LayerNorm)


def profile_path(name: str) -> Path:
    matches = sorted(PROFILE_DIR.glob(f"{name}-seq*.json"))
    if len(matches) != 1:
        raise CostTableError(
            f"profile {name!r}: expected one file {name}-seq*.json in {PROFILE_DIR}, found {len(matches)}; "
            f"known models: {', '.join(MODELS)}"
        )
    return matches[0]


def load_profile(name: str) -> CostTable:
    """The profiled CostTable of `name` (one of MODELS) with output and activation bytes filled."""
    if name not in HIDDEN_SIZE:
        raise CostTableError(f"profile {name!r}: no hidden size known; known models: {', '.join(MODELS)}")
    path = profile_path(name)
    raw = json.loads(path.read_text())
    costs = CostTable.load(path)
    seq_len, hidden = int(raw["seq_len"]), HIDDEN_SIZE[name]
    legend = {key: text.lower() for key, text in raw.get("kind_legend", {}).items()}

    def role(kind: str) -> str:
        text = legend.get(kind.split("+")[0], "")
        for word in ("mamba", "self-attention", "mlp"):
            if word in text:
                return word
        return "block"

    def median_forward(wanted: str) -> float | None:
        times = [layer.forward_ms for layer in costs if "+" not in layer.kind and role(layer.kind) == wanted]
        return statistics.median(times) if times else None

    per_position = {"block": TRANSFORMER_LAYER, "self-attention": ATTENTION_SUBLAYER, "mlp": MLP_SUBLAYER}
    mamba, attention, mlp = median_forward("mamba"), median_forward("self-attention"), median_forward("mlp")
    if mamba is not None:
        if attention is None or mlp is None:
            raise CostTableError(f"profile {name!r}: Mamba layers need attention and MLP layers to scale from")
        per_position["mamba"] = TRANSFORMER_LAYER * mamba / (attention + mlp)
    layers = [
        replace(layer, activation_bytes=round(per_position[role(layer.kind)] * seq_len * hidden),
                output_bytes=seq_len * hidden * BYTES_PER_ELEMENT)
        for layer in costs
    ]
    return costs.replace_layers(layers)
