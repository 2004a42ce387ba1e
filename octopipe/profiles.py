"""GPU-profiled layer tables (data/profiles/*.json) with the byte counts the profiles leave out.

The published profiles give per-layer forward and backward times only. `load_profile(path)`
reads one (embedding merged into layer 0, the head into the last layer) and fills, for a
microbatch of one sequence in bf16:

  output_bytes      the hidden state sent to the next stage: seq_len * hidden * 2.
  activation_bytes  what a layer keeps from F to B/W, after Korthikanti et al. ("Reducing
                    Activation Recomputation in Large Transformer Models", MLSys 2023): a
                    transformer block keeps 34 * s * h bytes (flash attention: no 5 a s^2 term).
                    - dense and MoE blocks: 34 s h (an MoE block's active experts keep about what
                      a dense MLP keeps; routing buffers are not counted);
                    - Nemotron-H's sub-layers, from the same breakdown: self-attention + its norm
                      13 s h (11 + 2), MLP + its norm 21 s h (19 + 2), and a Mamba2 mixer
                      34 s h scaled by its median forward time over the median attention + MLP
                      pair's.
                    The embedding and head merged into the first and last layer add nothing (the
                    head's logits are not counted).
  param_bytes       left out (None): the profiles do not say.

The hidden size comes from `HIDDEN_SIZE` for the four published models (their published
configurations), or from the caller. Without one the table keeps no bytes, and memory limits
cannot be planned against it (`octopipe.plan` refuses an activation limit then).

Consumed by the CLI (`octopipe plan --costs data/profiles/...json`) and the benchmarks.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from octopipe.errors import CostTableError
from octopipe.ir.costs import CostTable

HIDDEN_SIZE = {"gpt-13B": 5120, "deepseek-16B": 2048, "gpt-oss-20B": 2880, "nemotron-nano-v2-9B": 4480}
"""Hidden sizes of the profiled models (gpt-13B, DeepSeekMoE 16B, gpt-oss-20B, Nemotron-Nano-v2-9B)."""

BYTES_PER_ELEMENT = 2  # bf16
TRANSFORMER_LAYER = 34  # activation bytes per (sequence position x hidden unit), Korthikanti et al.
ATTENTION_SUBLAYER = 13  # 11 (attention) + 2 (its LayerNorm)
MLP_SUBLAYER = 21  # 19 (MLP) + 2 (its LayerNorm)


def is_profile(data: Any) -> bool:
    """Whether parsed JSON is a published profile (it names its sequence length and kind legend)."""
    return isinstance(data, dict) and "seq_len" in data and "kind_legend" in data and "layers" in data


def load_profile(path: str | Path, hidden_size: int | None = None) -> CostTable:
    """The profile at `path` with output and activation bytes filled (see the module doc).
    `hidden_size` defaults to the model's entry in `HIDDEN_SIZE`; a model not there needs it."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise CostTableError(f"{path}: cannot read profile: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CostTableError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not is_profile(raw):
        raise CostTableError(f"{path}: not a profile (needs seq_len, kind_legend and layers); load a cost table with "
                             "CostTable.load")
    costs = CostTable.load(path)
    model = str(raw.get("model", ""))
    hidden = hidden_size if hidden_size is not None else HIDDEN_SIZE.get(model)
    if hidden is None:
        raise CostTableError(f"{path}: no hidden size known for model {model!r} (known: {', '.join(HIDDEN_SIZE)}); "
                             "pass hidden_size (CLI: --hidden-size) to fill activation and message bytes")
    if not (isinstance(hidden, int) and hidden > 0):
        raise CostTableError(f"{path}: hidden_size must be a positive integer, got {hidden!r}")
    return fill_bytes(costs, int(raw["seq_len"]), hidden, raw.get("kind_legend", {}), where=str(path))


def fill_bytes(costs: CostTable, seq_len: int, hidden_size: int, kind_legend: dict[str, str], *,
               where: str = "profile") -> CostTable:
    """`costs` with output and activation bytes of one sequence of `seq_len` tokens (bf16)."""
    legend = {key: str(text).lower() for key, text in kind_legend.items()}

    def role(kind: str) -> str:
        text = legend.get(kind.split("+")[0], "")
        for word in ("mamba", "self-attention", "mlp"):
            if word in text:
                return word
        return "block"

    def median_forward(wanted: str) -> float | None:
        times = [layer.forward_ms for layer in costs if "+" not in layer.kind and role(layer.kind) == wanted]
        return statistics.median(times) if times else None

    per_position = {"block": float(TRANSFORMER_LAYER), "self-attention": float(ATTENTION_SUBLAYER),
                    "mlp": float(MLP_SUBLAYER)}
    mamba, attention, mlp = median_forward("mamba"), median_forward("self-attention"), median_forward("mlp")
    if mamba is not None:
        if attention is None or mlp is None:
            raise CostTableError(f"{where}: Mamba layers need attention and MLP layers to scale their activations from")
        per_position["mamba"] = TRANSFORMER_LAYER * mamba / (attention + mlp)
    layers = [
        replace(layer, activation_bytes=round(per_position[role(layer.kind)] * seq_len * hidden_size),
                output_bytes=seq_len * hidden_size * BYTES_PER_ELEMENT)
        for layer in costs
    ]
    return costs.replace_layers(layers)
