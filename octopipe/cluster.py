"""ClusterSpec: the devices a plan runs on, their memory and the links between them.

Glossary: a *device* is one accelerator (or one CPU process in a local gloo "cluster"); devices are
grouped into *nodes* of `devices_per_node`; devices in one node talk over the intra-node link
(NVLink), devices in different nodes over the inter-node link (InfiniBand / RoCE). Bandwidths are
per device and per direction, in bytes per second.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octopipe.errors import ClusterSpecError
from octopipe.ir.costs import is_finite_number

GiB = 2**30


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    num_devices: int
    devices_per_node: int = 8
    memory_bytes: float = 80 * GiB
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    latency_s: float = 5e-6
    peak_flops: float = 989e12
    memory_bandwidth: float = 3.35e12
    """Device memory (HBM) bandwidth, bytes/s: the speed of memory-bound ops in analytic costs."""
    flops_efficiency: float = 0.5
    """Fraction of `peak_flops` that matmul-heavy work reaches; analytic costs divide by it."""
    op_overhead_ms: float = 0.0
    """Host time the runtime adds to every compute op (F, B, W) beyond the layers' own time:
    Python dispatch and autograd bookkeeping. Negligible on GPUs (hidden behind queued kernels);
    measurable on CPU, where `octopipe.bench.calibrate_cpu_cluster` measures it."""
    message_overhead_ms: float = 0.0
    """Host time the runtime spends on a device to post one send or one receive to another
    device (the transfer itself then runs beside compute). Zero on GPUs (the copy engine does
    the work); on CPU, gloo's posting takes a fraction of a millisecond of the rank's own thread,
    which `octopipe.bench.runtime_profile` measures inside real steps (`RuntimeProfile.calibrate`)."""
    step_overhead_ms: float = 0.0
    """Host time of a step outside its ops, added once to every iteration: the engine cutting the
    batch and setting up, the instructions' loop between ops, the loss's last instruction, the
    barrier that ends the step. Zero on GPUs (the host runs ahead of the kernels); on CPU
    processes a few ms a step, a fifth of a tiny model's step, which `octopipe.bench` measures
    inside pipelined steps (`RuntimeProfile.calibrate`). The lower bounds leave it out."""
    message_copy_bandwidth: float = 0.0
    """Bytes/s at which the host's own threads copy a message on each end (0: they do not). On
    GPUs NCCL's kernels move the bytes; with gloo over TCP between CPU processes the sender's and
    the receiver's CPU copy every byte, time the ranks' compute loses: each F or B pays
    bytes / message_copy_bandwidth for every message it sends or receives across devices
    (`octopipe.bench.calibrate_cpu_cluster` sets it to the measured link bandwidth, and
    `RuntimeProfile.calibrate` to the one ping-ponged in the profile's own rotation)."""
    backend: str = "nccl"
    name: str = "custom"
    data_parallel: int = 1
    """Copies of the pipeline these devices are one replica of (`replica`): every step sums each
    device's gradients over its copies (`all_reduce_ms`, a bucket per stage), which the simulator
    charges."""
    data_parallel_bandwidth: float = 0.0
    """Bytes/s of the links between a device's copies (0: `intra_node_bandwidth`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ClusterSpecError(f"ClusterSpec: name must be a string, got {self.name!r:.40}")
        where = f"ClusterSpec {self.name!r}"
        for field in ("num_devices", "devices_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterSpecError(f"{where}: {field} must be a positive integer, got {value!r}")
        for field in ("memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth", "peak_flops", "memory_bandwidth"):
            value = getattr(self, field)
            if not is_finite_number(value) or not value > 0:
                raise ClusterSpecError(f"{where}: {field} must be a positive finite number, got {value!r:.60}")
        if not is_finite_number(self.latency_s) or not 0 <= self.latency_s < 1:
            raise ClusterSpecError(f"{where}: latency_s must be in [0, 1) seconds, got {self.latency_s!r}")
        if not is_finite_number(self.op_overhead_ms) or not 0 <= self.op_overhead_ms < 1e3:
            raise ClusterSpecError(f"{where}: op_overhead_ms must be in [0, 1000), got {self.op_overhead_ms!r}")
        if not is_finite_number(self.message_overhead_ms) or not 0 <= self.message_overhead_ms < 1e3:
            raise ClusterSpecError(f"{where}: message_overhead_ms must be in [0, 1000), got {self.message_overhead_ms!r}")
        if not is_finite_number(self.step_overhead_ms) or not 0 <= self.step_overhead_ms < 1e4:
            raise ClusterSpecError(f"{where}: step_overhead_ms must be in [0, 10000), got {self.step_overhead_ms!r}")
        if not is_finite_number(self.message_copy_bandwidth) or not self.message_copy_bandwidth >= 0:
            raise ClusterSpecError(f"{where}: message_copy_bandwidth must be a finite number >= 0 (bytes/s; 0: no host "
                                   f"copy), got {self.message_copy_bandwidth!r}")
        if not is_finite_number(self.flops_efficiency) or not 0 < self.flops_efficiency <= 1:
            raise ClusterSpecError(f"{where}: flops_efficiency must be in (0, 1], got {self.flops_efficiency!r}")
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ClusterSpecError(f"{where}: data_parallel must be a positive integer, got {self.data_parallel!r}")
        if not is_finite_number(self.data_parallel_bandwidth) or not self.data_parallel_bandwidth >= 0:
            raise ClusterSpecError(f"{where}: data_parallel_bandwidth must be a finite number >= 0 (bytes/s; 0: the "
                                   f"node's), got {self.data_parallel_bandwidth!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ClusterSpecError(f"{where}: backend must be 'nccl' or 'gloo', got {self.backend!r}")

    @property
    def hosts_pay_for_messages(self) -> bool:
        """Whether a device's own host time goes into its cross-device messages (posting, copying):
        gloo on CPU; not the GPU presets."""
        return bool(self.message_overhead_ms or self.message_copy_bandwidth)

    # -- topology ---------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s of the link between two different devices."""
        if self.node_of(src) == self.node_of(dst):
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth

    def transfer_ms(self, num_bytes: float, src: int, dst: int) -> float:
        """Time to move `num_bytes` from device src to dst; a hand-off on one device is free."""
        if src == dst:
            return 0.0
        return (self.latency_s + num_bytes / self.bandwidth(src, dst)) * 1e3

    def with_devices(self, num_devices: int) -> ClusterSpec:
        return dataclasses.replace(self, num_devices=num_devices)

    def replica(self, data_parallel: int) -> ClusterSpec:
        """The cluster one of `data_parallel` pipeline replicas sees, ranks ordered as Megatron
        orders them (rank = pipeline rank x data_parallel + replica, the copies of a pipeline rank
        side by side): every data_parallel-th device, so a node holds devices_per_node /
        data_parallel of a replica's devices (one, where data_parallel fills a node or more)."""
        where = f"ClusterSpec {self.name!r}: {data_parallel} data-parallel replicas"
        if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
            raise ClusterSpecError(f"{where}: the replica count must be a positive integer")
        if self.data_parallel > 1:
            raise ClusterSpecError(f"{where}: this spec is already one of {self.data_parallel} replicas")
        if self.num_devices % data_parallel:
            raise ClusterSpecError(f"{where}: they must divide the {self.num_devices} devices")
        # devices on one node (all of a local CPU "cluster") see the same links whatever the count
        per_node = min(self.devices_per_node, self.num_devices)
        if per_node % data_parallel and data_parallel % per_node:
            raise ClusterSpecError(f"{where}: the count must divide the {per_node} devices of a node or be a "
                                   "multiple of it, so that every replica sees the same links")
        if data_parallel == 1:
            return self
        bandwidth = self.intra_node_bandwidth if data_parallel <= per_node else self.inter_node_bandwidth
        return dataclasses.replace(self, num_devices=self.num_devices // data_parallel,
                                   devices_per_node=max(1, self.devices_per_node // data_parallel), data_parallel=data_parallel,
                                   data_parallel_bandwidth=bandwidth, name=f"{self.name}/{data_parallel}")

    def all_reduce_ms(self, num_bytes: float) -> float:
        """A ring all-reduce of `num_bytes` of one device's gradients over its `data_parallel`
        copies (neighbouring devices; inside a node where they fit in one): 2 (d - 1) / d of the
        bytes each way and 2 (d - 1) latencies; 0 without copies."""
        return self._ring_ms(2, num_bytes)

    def all_gather_ms(self, num_bytes: float) -> float:
        """A ring all-gather over the `data_parallel` copies of a device where each holds 1/d of
        `num_bytes`: (d - 1) / d of the bytes and d - 1 latencies; 0 without copies (what the
        runtime's broadcast of each copy's share after a sharded optimizer step moves)."""
        return self._ring_ms(1, num_bytes)

    def reduce_scatter_ms(self, num_bytes: float) -> float:
        """A ring reduce-scatter of `num_bytes` of one device's gradients over its `data_parallel`
        copies, each summing 1/d of them: the all-gather's steps and bytes, half an all-reduce
        (what the runtime's reduce of each share onto its owner moves with a sharded optimizer)."""
        return self._ring_ms(1, num_bytes)

    def _ring_ms(self, passes: int, num_bytes: float) -> float:
        """`passes` trips around the ring of the `data_parallel` copies (2 for an all-reduce, 1
        for an all-gather or a reduce-scatter): passes x (d - 1) steps, each a latency and 1/d of the bytes."""
        copies = self.data_parallel
        if copies <= 1:
            return 0.0
        bandwidth = self.data_parallel_bandwidth or self.intra_node_bandwidth
        steps = passes * (copies - 1)
        return (steps * self.latency_s + steps / copies * num_bytes / bandwidth) * 1e3

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cluster spec") -> ClusterSpec:
        if not isinstance(data, dict):
            raise ClusterSpecError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ClusterSpecError(f"{where}: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        if "preset" in data:
            raise ClusterSpecError(f"{where}: 'preset' is not a field")
        if "num_devices" not in data:
            raise ClusterSpecError(f"{where}: missing required field 'num_devices'")
        data = {key: _coerce(key, value) for key, value in data.items()}
        try:
            return cls(**data)
        except TypeError as exc:
            raise ClusterSpecError(f"{where}: {exc}") from None
        except ClusterSpecError as exc:  # a field's value: say which file (or mapping) it came from
            raise ClusterSpecError(f"{where}: {exc}") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        """Read a YAML or JSON file of ClusterSpec fields. A file may also say `preset: NAME`
        (with optional `num_devices` and overrides) to start from a preset."""
        from octopipe.ir.files import parse_json, parse_yaml, read_text

        path = Path(path)
        text = read_text(path, ClusterSpecError, "cluster spec")
        if path.suffix.lower() == ".json":
            data = parse_json(text, str(path), ClusterSpecError)
        else:
            data = parse_yaml(text, str(path), ClusterSpecError)
        if isinstance(data, dict) and "preset" in data:
            data = dict(data)
            base = cls.preset(str(data.pop("preset")), data.pop("num_devices", None))
            merged = base.to_dict() | data
            return cls.from_dict(merged, where=str(path))
        return cls.from_dict(data, where=str(path))

    # -- presets ----------------------------------------------------------------------------
    @classmethod
    def of(cls, spec: ClusterSpec | str | Path, where: str = "cluster") -> ClusterSpec:
        """`spec` itself if it is a ClusterSpec, the file it names (.yaml/.yml/.json) or the
        preset it names (`h100x8`, `cpux2`, ...)."""
        if isinstance(spec, ClusterSpec):
            return spec
        if isinstance(spec, Path) or (isinstance(spec, str) and cls.names_file(spec)):
            return cls.load(spec)
        if isinstance(spec, str):
            return cls.preset(spec)
        raise ClusterSpecError(f"{where}: expected a ClusterSpec, a preset name (h100x8, cpux2, ...) or a spec file "
                               f"(.yaml/.json), got {type(spec).__name__}")

    @staticmethod
    def names_file(spec: str | Path) -> bool:
        """Whether `spec` names a spec file (.yaml, .yml or .json, in any case), not a preset."""
        return Path(spec).suffix.lower() in (".yaml", ".yml", ".json")

    @classmethod
    def preset(cls, name: str, num_devices: int | None = None) -> ClusterSpec:
        """A real cluster by name: `h100x8`, `h100x16`, `h800x16`, `a100x32-roce`, `cpux4`, ...

        GPU presets are nodes of 8 with NVLink inside and InfiniBand (default) or RoCE between;
        `cpu` is a local "cluster" of gloo processes on this machine. `num_devices` overrides the
        count in the name.
        """
        if not isinstance(name, str):
            raise ClusterSpecError(f"cluster preset must be a name like {PRESET_EXAMPLES[0]!r}, got {type(name).__name__}")
        match = _PRESET_NAME.match(name.strip().lower())
        if not match:
            raise ClusterSpecError(
                f"unknown cluster preset {name!r:.60}; use one of {', '.join(PRESET_EXAMPLES)} "
                "(GPU kind h100|h800|h200|a100 or cpu, 'x' device count, optional -ib|-roce)"
            )
        kind, count, fabric = match.group(1), match.group(2), match.group(3) or "ib"
        devices = num_devices if num_devices is not None else int(count) if count else _DEFAULT_COUNT[kind]
        base = dict(_GPU_PRESETS[kind])
        if kind != "cpu" and fabric == "roce":
            base["inter_node_bandwidth"] = base["inter_node_bandwidth"] * 0.8
            base["latency_s"] = base["latency_s"] * 2
        suffix = f"-{fabric}" if kind != "cpu" and match.group(3) else ""
        return cls(num_devices=devices, name=f"{kind}x{devices}{suffix}", **base)


def _coerce(key: str, value: Any) -> Any:
    """File values to field types: YAML reads `1.0e10` as a string, JSON writes 8.0 for 8."""
    if key in ("num_devices", "devices_per_node") and isinstance(value, float) and value.is_integer():
        return int(value)
    if key not in ("backend", "name", "num_devices", "devices_per_node") and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


_PRESET_NAME = re.compile(r"^(h100|h800|h200|a100|cpu)(?:x([0-9]{1,9}))?(?:-(ib|roce))?$")
_DEFAULT_COUNT = {"h100": 8, "h800": 8, "h200": 8, "a100": 8, "cpu": 2}
# Per-device, per-direction bandwidths: NVLink 4 (H100/H200) 900 GB/s bidirectional, H800's
# NVLink cut to 400 GB/s, A100 NVLink 3 600 GB/s; one 400 Gb/s (H-series) or 200 Gb/s (A100)
# NIC per GPU between nodes. Peak flops are dense BF16.
_GPU_PRESETS: dict[str, dict[str, Any]] = {
    "h100": dict(devices_per_node=8, memory_bytes=80 * GiB, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
                 latency_s=5e-6, peak_flops=989e12, memory_bandwidth=3.35e12, backend="nccl"),
    "h800": dict(devices_per_node=8, memory_bytes=80 * GiB, intra_node_bandwidth=200e9, inter_node_bandwidth=50e9,
                 latency_s=5e-6, peak_flops=989e12, memory_bandwidth=3.35e12, backend="nccl"),
    "h200": dict(devices_per_node=8, memory_bytes=141 * GiB, intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
                 latency_s=5e-6, peak_flops=989e12, memory_bandwidth=4.8e12, backend="nccl"),
    "a100": dict(devices_per_node=8, memory_bytes=80 * GiB, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
                 latency_s=8e-6, peak_flops=312e12, memory_bandwidth=2.0e12, backend="nccl"),
    # One gloo process per "device" on one machine: loopback TCP, a CPU core's worth of flops.
    "cpu": dict(devices_per_node=1024, memory_bytes=4 * GiB, intra_node_bandwidth=2e9, inter_node_bandwidth=2e9,
                latency_s=5e-5, peak_flops=1e11, memory_bandwidth=2e10, flops_efficiency=0.3,
                message_copy_bandwidth=2e9, backend="gloo"),
}
PRESET_EXAMPLES = ("h100x8", "h100x16", "h800x16-roce", "h200x8", "a100x32", "cpux2")
