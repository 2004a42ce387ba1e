"""octopipe.profiles: the published GPU profiles with the bytes they leave out."""

import json
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
