"""ClusterSpec: validation, presets, topology, file round trips."""

import json

import pytest

from octopipe import ClusterSpec, ClusterSpecError


def test_presets_are_nodes_of_eight_with_nvlink_inside():
    spec = ClusterSpec.preset("h100x16")
    assert (spec.num_devices, spec.devices_per_node, spec.num_nodes) == (16, 8, 2)
    assert spec.bandwidth(0, 7) == spec.intra_node_bandwidth > spec.bandwidth(7, 8) == spec.inter_node_bandwidth
    assert ClusterSpec.preset("a100x8").peak_flops < spec.peak_flops
    assert ClusterSpec.preset("h800x16").intra_node_bandwidth < spec.intra_node_bandwidth
    roce = ClusterSpec.preset("h100x16-roce")
    assert roce.inter_node_bandwidth < spec.inter_node_bandwidth and roce.name == "h100x16-roce"
    assert ClusterSpec.preset("h100", num_devices=4).num_devices == 4


def test_cpu_preset_is_a_local_gloo_cluster():
    spec = ClusterSpec.preset("cpux4")
    assert spec.backend == "gloo" and spec.num_devices == 4 and spec.num_nodes == 1


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    spec = ClusterSpec(num_devices=16, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9, latency_s=1e-5)
    assert spec.transfer_ms(1e9, 3, 3) == 0.0
    assert spec.transfer_ms(1e9, 0, 1) == pytest.approx((1e-5 + 0.01) * 1e3)
    assert spec.transfer_ms(1e9, 7, 8) == pytest.approx((1e-5 + 0.1) * 1e3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_devices=0), "num_devices must be a positive integer"),
        (dict(num_devices=2.5), "num_devices must be a positive integer"),
        (dict(num_devices=2, memory_bytes=-1), "memory_bytes must be a positive finite number"),
        (dict(num_devices=2, inter_node_bandwidth=float("nan")), "inter_node_bandwidth"),
        (dict(num_devices=2, latency_s=-1e-6), "latency_s must be in"),
        (dict(num_devices=2, flops_efficiency=1.5), "flops_efficiency"),
        (dict(num_devices=2, backend="mpi"), "backend must be 'nccl' or 'gloo'"),
        (dict(num_devices=2, step_overhead_ms=-0.5), r"step_overhead_ms must be in \[0, 10000\)"),
        (dict(num_devices=2, step_overhead_ms=float("inf")), "step_overhead_ms"),
    ],
)
def test_invalid_specs_raise_clear_errors(fields, message):
    with pytest.raises(ClusterSpecError, match=message):
        ClusterSpec(**fields)


def test_a_bad_value_in_a_spec_file_names_the_file(tmp_path):
    path = tmp_path / "negative.yaml"
    path.write_text("preset: h100x8\nlatency_s: -1\n")
    with pytest.raises(ClusterSpecError, match=r"negative\.yaml: .*latency_s must be in"):
        ClusterSpec.of(path)


def test_unknown_preset_lists_examples():
    with pytest.raises(ClusterSpecError, match="unknown cluster preset 'tpu-v5'.*h100x8"):
        ClusterSpec.preset("tpu-v5")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_load_round_trip(tmp_path, suffix):
    spec = ClusterSpec.preset("h800x16-roce")
    path = tmp_path / f"cluster{suffix}"
    spec.save(path)
    assert ClusterSpec.load(path) == spec


def test_load_from_preset_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: h100\nnum_devices: 32\nmemory_bytes: 1.0e10\n")
    spec = ClusterSpec.load(path)
    assert spec.num_devices == 32 and spec.memory_bytes == 1.0e10 and spec.num_nodes == 4


def test_load_errors_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_devices": 4, "bandwith": 1}))
    with pytest.raises(ClusterSpecError, match=r"bad.json: unknown field\(s\) \['bandwith'\]"):
        ClusterSpec.load(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("num_devices: [4\n")
    with pytest.raises(ClusterSpecError, match="broken.yaml: not valid YAML"):
        ClusterSpec.load(broken)
    with pytest.raises(ClusterSpecError, match="cannot read"):
        ClusterSpec.load(tmp_path / "missing.yaml")
    missing = tmp_path / "m.json"
    missing.write_text("{}")
    with pytest.raises(ClusterSpecError, match="missing required field 'num_devices'"):
        ClusterSpec.load(missing)
