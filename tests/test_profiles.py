"""octopipe.profiles: the published GPU profiles with the bytes they leave out."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from octopipe import profiles
from octopipe.errors import CostTableError
from octopipe.ir.costs import CostTable

DATA = Path(__file__).resolve().parents[1] / "data" / "profiles"


def test_bytes_follow_the_activation_model_of_each_layer_kind():
    path = DATA / "nemotron-nano-v2-9B-seq4096.json"
    bare = CostTable.load(path)
    costs = profiles.load_profile(path)
    assert not bare.has_memory_info and costs.has_memory_info
    s, h = 4096, profiles.HIDDEN_SIZE["nemotron-nano-v2-9B"]
    assert set(costs.output) == {s * h * 2}  # bf16 hidden state between stages
    by_kind = {layer.kind: layer.activation_bytes for layer in costs if "+" not in layer.kind}
    assert by_kind["-"] == 21 * s * h and by_kind["*"] == 13 * s * h  # MLP and attention sub-layers
    assert 13 * s * h < by_kind["M"] < 34 * s * h  # Mamba: scaled by its forward time
    assert [layer.forward_ms for layer in costs] == [layer.forward_ms for layer in bare]  # times untouched
    dense = profiles.load_profile(DATA / "gpt-13B-seq4096.json")
    assert {layer.activation_bytes for layer in dense} == {34 * 4096 * 5120}


def test_unknown_model_needs_a_hidden_size(tmp_path):
    raw = json.loads((DATA / "gpt-oss-20B-seq2048.json").read_text())
    raw["model"] = "mystery-3B"
    path = tmp_path / "mystery.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CostTableError, match="hidden_size"):
        profiles.load_profile(path)
    costs = profiles.load_profile(path, hidden_size=1024)
    assert set(costs.output) == {2048 * 1024 * 2}
    with pytest.raises(CostTableError, match="positive integer"):
        profiles.load_profile(path, hidden_size=0)


def test_a_cost_table_is_not_a_profile(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"layers": [{"name": "l0", "forward_ms": 1, "backward_ms": 2}]}))
    with pytest.raises(CostTableError, match="not a profile"):
        profiles.load_profile(path)


def test_selective_estimates_scale_each_kind_by_its_fractions():
    path = DATA / "deepseek-16B-seq4096.json"
    costs = profiles.load_profile(path)
    assert costs.has_selective_info
    for layer in costs:
        kept, recompute = profiles.SELECTIVE_FRACTIONS["deepseek-16B"][layer.kind.split("+")[0]]
        assert layer.selective_activation_bytes == round(kept * layer.activation_bytes)
        assert 0 < layer.selective_recompute_ms < layer.forward_ms
    merged, plain = costs.layers[0], costs.layers[1]  # D+E and D: the embedding adds no recompute
    assert merged.selective_recompute_ms == plain.selective_recompute_ms
    assert not profiles.load_profile(path, selective=False).has_selective_info


def test_a_model_without_fractions_keeps_no_selective_estimates(tmp_path):
    raw = json.loads((DATA / "gpt-oss-20B-seq2048.json").read_text())
    raw["model"] = "mystery-3B"
    path = tmp_path / "mystery.json"
    path.write_text(json.dumps(raw))
    assert not profiles.load_profile(path, hidden_size=1024).has_selective_info
    costs = profiles.load_profile(DATA / "gpt-oss-20B-seq2048.json")
    with pytest.raises(CostTableError, match=r"kinds \['S'\]"):
        profiles.fill_selective(costs, {"F": (0.5, 0.1)})


@pytest.mark.parametrize("model, family, kinds", [
    ("gpt-13B", "llama", {"T": None}),
    ("deepseek-16B", "deepseek", {"D": "dense", "M": "moe"}),
    ("nemotron-nano-v2-9B", "nemotron-h", {"M": "M", "-": "-", "*": "*"}),
])
def test_selective_fractions_are_the_analytic_passes(model, family, kinds):
    from octopipe import models
    from octopipe.cluster import ClusterSpec
    from octopipe.passes.costs import analytic_costs, paper_graph

    config = models.config(family, "paper")
    costs = analytic_costs(paper_graph(family), ClusterSpec.preset("h100x16", num_devices=8), batch_size=1,
                           seq_len=4096)
    blocks = [layer for layer in costs if layer.kind == "block"]
    pattern = getattr(config, "layer_pattern", None)
    for kind, which in kinds.items():
        if which is None:
            layer = blocks[0]
        elif which in ("dense", "moe"):
            layer = blocks[0] if which == "dense" else blocks[config.num_dense_layers]
        else:
            layer = blocks[pattern.index(which)]
        kept, recompute = profiles.SELECTIVE_FRACTIONS[model][kind]
        assert layer.selective_activation_bytes / layer.activation_bytes == pytest.approx(kept, abs=6e-4)
        assert layer.selective_recompute_ms / layer.forward_ms == pytest.approx(recompute, abs=6e-4)
        stash = profiles.WEIGHT_STASH_FRACTIONS[model][kind]
        assert layer.weight_stash_bytes / layer.activation_bytes == pytest.approx(stash, abs=6e-4)
    if model == "deepseek-16B":  # gpt-oss-20B borrows the MoE block's
        assert set(profiles.SELECTIVE_FRACTIONS["gpt-oss-20B"].values()) == {profiles.SELECTIVE_FRACTIONS[model]["M"]}
        assert set(profiles.WEIGHT_STASH_FRACTIONS["gpt-oss-20B"].values()) == {
            profiles.WEIGHT_STASH_FRACTIONS[model]["M"]}


def test_weight_stash_scales_each_kind_by_its_fraction_and_is_left_unknown_without_one(tmp_path):
    path = DATA / "deepseek-16B-seq4096.json"
    costs = profiles.load_profile(path)
    for layer in costs:  # the merged-in embedding and head leave their block's share
        share = profiles.WEIGHT_STASH_FRACTIONS["deepseek-16B"][layer.kind.split("+")[0]]
        assert layer.weight_stash_bytes == round(share * layer.activation_bytes)
    moe = next(layer for layer in costs if layer.kind == "M")
    dense = next(layer for layer in costs if layer.kind == "D")
    assert moe.weight_stash_bytes < 0.5 * dense.weight_stash_bytes  # experts' einsums are not split
    assert {layer.weight_stash_bytes for layer in profiles.load_profile(path, weight_stash=False)} == {None}
    partial = profiles.fill_weight_stash(costs.replace_layers([replace(layer, weight_stash_bytes=None)
                                                                for layer in costs]), {"D": 0.5})
    assert all((layer.weight_stash_bytes is None) == (layer.kind.split("+")[0] == "M") for layer in partial)
    raw = json.loads((DATA / "gpt-oss-20B-seq2048.json").read_text())
    raw["model"] = "mystery-3B"
    unknown = tmp_path / "mystery.json"
    unknown.write_text(json.dumps(raw))
    assert {layer.weight_stash_bytes for layer in profiles.load_profile(unknown, hidden_size=1024)} == {None}
