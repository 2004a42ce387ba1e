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
  selective_activation_bytes, selective_recompute_ms
                    what a stage under selective recomputation keeps (its matmul, attention and
                    convolution outputs) and the time of recomputing the rest in B, as fractions of
                    the layer's activation bytes and of its kind's median forward time. The
                    fractions (`SELECTIVE_FRACTIONS`) are those the analytic cost pass gives the
                    matching reference model's paper config at 4096 tokens, per layer kind:
                    gpt-13B from llama (LLaMA-2-13B), deepseek-16B from deepseek, nemotron-nano
                    from nemotron-h, and gpt-oss-20B (no reference model) from deepseek's MoE
                    blocks. Estimates, not measurements: the profiles time no selective run.
                    Models without fractions keep none, and the planner then offers no
                    selective stages for them.
  weight_stash_bytes
                    what a split backward's B leaves for its W (the split linears' inputs and
                    output gradients), as a per-kind fraction of the layer's activation bytes
                    (`WEIGHT_STASH_FRACTIONS`), from the same analytic configs as the selective
                    fractions. An MoE block leaves far less than a dense one (its expert matmuls
                    are not split). A merged-in head leaves its block's share: its logits'
                    gradient is not counted, as its logits are not. Models or kinds without
                    fractions keep none, and the memory model's `weight_memory_fraction` of the
                    activations stands in for them.

The hidden size comes from `HIDDEN_SIZE` for the four published models (their published
configurations), or from the caller. Without one the table keeps no bytes, and memory limits
cannot be planned against it (`octopipe.plan` refuses an activation limit then).

Consumed by the CLI (`octopipe plan --costs data/profiles/...json`) and the benchmarks.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from octopipe.errors import CostTableError, OctopipeWarning
from octopipe.ir.costs import CostTable
from octopipe.ir.files import parse_json, read_text

SELECTIVE_FRACTIONS: dict[str, dict[str, tuple[float, float]]] = {
    "gpt-13B": {"T": (0.479, 0.089)},
    "deepseek-16B": {"D": (0.485, 0.157), "M": (0.437, 0.181)},
    "gpt-oss-20B": {"S": (0.437, 0.181), "F": (0.437, 0.181)},
    "nemotron-nano-v2-9B": {"M": (0.439, 0.188), "-": (0.360, 0.082), "*": (0.485, 0.063)},
}
"""Per model and layer kind: (kept bytes / activation bytes, recompute ms / forward ms) under
selective recomputation, from the analytic pass (see the module doc; a test recomputes them)."""

WEIGHT_STASH_FRACTIONS: dict[str, dict[str, float]] = {
    "gpt-13B": {"T": 0.677},
    "deepseek-16B": {"D": 0.699, "M": 0.310},
    "gpt-oss-20B": {"S": 0.310, "F": 0.310},
    "nemotron-nano-v2-9B": {"M": 0.355, "-": 0.720, "*": 0.615},
}
"""Per model and layer kind: a split B's stash for its W / the layer's activation bytes, from the
analytic pass (see the module doc; a test recomputes them)."""

HIDDEN_SIZE = {"gpt-13B": 5120, "deepseek-16B": 2048, "gpt-oss-20B": 2880, "nemotron-nano-v2-9B": 4480}
"""Hidden sizes of the profiled models (gpt-13B, DeepSeekMoE 16B, gpt-oss-20B, Nemotron-Nano-v2-9B)."""

BYTES_PER_ELEMENT = 2  # bf16
MAX_DIMENSION = 2**24  # a hidden size or sequence length above this is a mistake
TRANSFORMER_LAYER = 34  # activation bytes per (sequence position x hidden unit), Korthikanti et al.
ATTENTION_SUBLAYER = 13  # 11 (attention) + 2 (its LayerNorm)
MLP_SUBLAYER = 21  # 19 (MLP) + 2 (its LayerNorm)


def is_profile(data: Any) -> bool:
    """Whether parsed JSON is a published profile (it names its sequence length and kind legend)."""
    return isinstance(data, dict) and "seq_len" in data and "kind_legend" in data and "layers" in data


def load_profile(path: str | Path, hidden_size: int | None = None, *, selective: bool = True,
                 weight_stash: bool = True) -> CostTable:
    """The profile at `path` with output and activation bytes filled (see the module doc).
    `hidden_size` defaults to the model's entry in `HIDDEN_SIZE`; a model not there needs it.
    `selective`: also fill the selective-recomputation estimates, where `SELECTIVE_FRACTIONS`
    has the model. `weight_stash`: also fill what a split B leaves for its W, where
    `WEIGHT_STASH_FRACTIONS` has the model (else the memory model's default share stands in)."""
    if not isinstance(path, (str, Path)):
        raise CostTableError(f"load_profile: path must be a file path, got {type(path).__name__}")
    path = Path(path)
    raw = parse_json(read_text(path, CostTableError, "profile"), str(path), CostTableError)
    if not is_profile(raw):
        raise CostTableError(f"{path}: not a profile (needs seq_len, kind_legend and layers); load a cost table with "
                             "CostTable.load")
    costs = CostTable.load(path)
    model = str(raw.get("model", ""))
    hidden = hidden_size if hidden_size is not None else HIDDEN_SIZE.get(model)
    if hidden is None:
        raise CostTableError(f"{path}: no hidden size known for model {model!r} (known: {', '.join(HIDDEN_SIZE)}); "
                             "pass hidden_size (CLI: --hidden-size) to fill activation and message bytes")
    if not (isinstance(hidden, int) and not isinstance(hidden, bool) and 0 < hidden <= MAX_DIMENSION):
        raise CostTableError(f"{path}: hidden_size must be a positive integer up to {MAX_DIMENSION}, got {hidden!r:.40}")
    seq_len, legend = raw["seq_len"], raw["kind_legend"]
    if not (isinstance(seq_len, int) and not isinstance(seq_len, bool) and 0 < seq_len <= MAX_DIMENSION):
        raise CostTableError(f"{path}: seq_len must be a positive integer up to {MAX_DIMENSION} (tokens per "
                             f"sequence), got {seq_len!r:.40}")
    if not isinstance(legend, dict) or not all(isinstance(key, str) for key in legend):
        raise CostTableError(f"{path}: kind_legend must map layer kinds to descriptions, got {legend!r:.80}")
    costs = fill_bytes(costs, seq_len, hidden, legend, where=str(path))
    stash = WEIGHT_STASH_FRACTIONS.get(model) if weight_stash else None
    if stash:
        costs = fill_weight_stash(costs, stash)
    fractions = SELECTIVE_FRACTIONS.get(model) if selective else None
    if not fractions:
        return costs
    unknown = sorted({layer.kind.split("+")[0] for layer in costs} - set(fractions))
    if unknown:
        warnings.warn(f"{path}: no selective-recomputation estimates for layer kind(s) {unknown} (known for {model}: "
                      f"{sorted(fractions)}); selective recomputation keeps all of their activations (no saving, no "
                      "extra time)", OctopipeWarning, stacklevel=2)
        fractions = {**fractions, **{kind: (1.0, 0.0) for kind in unknown}}
    return fill_selective(costs, fractions, where=str(path))


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
        if not attention + mlp > 0:
            raise CostTableError(f"{where}: Mamba layers' activations are scaled by the attention and MLP layers' "
                                 "forward times, and those are 0 ms; give them their times")
        per_position["mamba"] = TRANSFORMER_LAYER * mamba / (attention + mlp)
    layers = [
        replace(layer, activation_bytes=round(per_position[role(layer.kind)] * seq_len * hidden_size),
                output_bytes=seq_len * hidden_size * BYTES_PER_ELEMENT)
        for layer in costs
    ]
    return costs.replace_layers(layers)


def fill_weight_stash(costs: CostTable, fractions: dict[str, float]) -> CostTable:
    """`costs` (activation bytes filled) with each layer's `weight_stash_bytes`: its kind's
    fraction of its activation bytes. A layer whose kind has no fraction keeps none (unknown: the
    memory model's `weight_memory_fraction` stands in), as does one without activation bytes."""
    layers = []
    for layer in costs:
        share = fractions.get(layer.kind.split("+")[0])
        if share is None or layer.activation_bytes is None:
            layers.append(layer)
        else:
            layers.append(replace(layer, weight_stash_bytes=round(share * layer.activation_bytes)))
    return costs.replace_layers(layers)


def fill_selective(costs: CostTable, fractions: dict[str, tuple[float, float]], *,
                   where: str = "profile") -> CostTable:
    """`costs` (activation bytes filled) with selective-recomputation estimates: per layer, its
    kind's kept fraction of its activation bytes, and its kind's recompute fraction of the median
    forward time of the layers of that kind that have no embedding or head merged in (the
    profiles count nothing of those, so neither do the estimates)."""
    base = {layer.kind.split("+")[0] for layer in costs}
    missing = sorted(base - set(fractions))
    if missing:
        raise CostTableError(f"{where}: no selective-recomputation fractions for layer kinds {missing} (known: "
                             f"{sorted(fractions)}); give them, or load it with selective=False")
    median = {}
    for kind in base:
        times = [layer.forward_ms for layer in costs if layer.kind == kind]
        if not times:
            times = [layer.forward_ms for layer in costs if layer.kind.split("+")[0] == kind]
        median[kind] = statistics.median(times)
    layers = []
    for layer in costs:
        kind = layer.kind.split("+")[0]
        kept, recompute = fractions[kind]
        layers.append(replace(layer, selective_activation_bytes=round(kept * (layer.activation_bytes or 0)),
                              selective_recompute_ms=round(recompute * median[kind], 4)))
    return costs.replace_layers(layers)
