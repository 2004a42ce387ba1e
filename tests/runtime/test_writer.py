"""The background checkpoint writer process (`octopipe.runtime.writer`)."""

import os

import pytest
import torch

from octopipe.runtime.writer import ShardWriter, _shared_folder


def _leftovers():
    return [name for name in os.listdir(_shared_folder()) if name.startswith(f"octopipe-save-{os.getpid()}-")]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(120)
def test_the_writer_saves_what_torch_save_would_and_leaves_nothing_in_shared_memory(tmp_path):
    writer = ShardWriter()
    base = torch.randn(6, 5)
    shard = {"weights": {"w": base, "t": base.t(), "half": base.to(torch.bfloat16)[1:3]},
             "state": [torch.tensor(3, dtype=torch.int64), torch.ones(4, dtype=torch.bool), torch.empty(0, 7)],
             "extra": {"iteration": 5, "name": "x", "pair": (torch.tensor(2.5), None)}}
    try:
        for index, scale in enumerate((1, 3, 2)):  # a larger shard, then a smaller one in the same memory
            shard["weights"]["big"] = torch.arange(100 * scale, dtype=torch.float32)
            before = base.clone()
            writer.submit(shard, str(tmp_path / f"dir{index}" / "shard.pt"))
            base.add_(1.0)  # training goes on: the file keeps the values at submit
            expected = {**shard, "weights": {**shard["weights"], "w": before, "t": before.t()}}
            assert writer.wait() is None
            written = torch.load(tmp_path / f"dir{index}" / "shard.pt", weights_only=True)
            assert _equal(written["weights"]["w"], expected["weights"]["w"])
            assert _equal(written["weights"]["t"], expected["weights"]["t"])
            assert _equal(written["weights"]["big"], shard["weights"]["big"])
            assert _equal(written["state"], shard["state"]) and _equal(written["extra"], shard["extra"])
            assert not _leftovers()
        # a shard that cannot be written: the error comes back, and the writer goes on
        writer.submit({"x": torch.ones(2)}, "/proc/no/such/dir/shard.pt")
        error = writer.wait()
        assert isinstance(error, OSError) and str(error)
        writer.submit({"x": torch.ones(2)}, str(tmp_path / "after.pt"))
        assert writer.wait() is None and torch.equal(torch.load(tmp_path / "after.pt")["x"], torch.ones(2))
        process = writer._process
    finally:
        writer.close()
    assert process is not None and process.poll() is not None and not _leftovers()
