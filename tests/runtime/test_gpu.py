"""The same exactness check on GPUs with NCCL and the communication stream (skipped without 2 GPUs)."""

import pytest
import torch
from pipeline_helpers import assert_grads_close, make_case, reference

from octopipe.runtime import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _run_on_gpu(rank, world_size, family):
    case = make_case("gemma", family, world_size, 4)
    device = torch.device("cuda", rank)
    engine = case.engine(rank, device=device, timeout_s=60)  # moves this rank's stages to its GPU
    loss = engine.step(case.inputs, case.target.to(device))
    return loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["1f1b", "zb-v"])
def test_nccl_matches_single_process(family):
    results = launch(_run_on_gpu, 2, (family,), timeout_s=240, backend="nccl", start_method="spawn")
    (reference_loss,), reference_grads, _ = reference("gemma")
    for loss, grads in results:
        assert loss == pytest.approx(reference_loss, rel=1e-4)
        assert_grads_close(grads, reference_grads, family)


def _meta_on_gpu(rank, world_size, path):
    from test_materialize import _meta_pipe

    device = torch.device("cuda", rank)
    engine = _meta_pipe("gemma", "zb-h1").engine(rank, device=device, init=path, timeout_s=60)
    case = make_case("gemma", "1f1b", world_size, 4)
    loss = engine.step(tuple(t.to(device) for t in case.inputs), case.target.to(device))
    return loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}


@pytest.mark.timeout(300)
def test_meta_model_built_on_each_gpu_matches_single_process(tmp_path):
    from pipeline_helpers import build_model

    model, *_ = build_model("gemma")
    path = tmp_path / "plain.pt"
    torch.save(model.state_dict(), path)
    results = launch(_meta_on_gpu, 2, (str(path),), timeout_s=240, backend="nccl", start_method="spawn")
    (reference_loss,), reference_grads, _ = reference("gemma")
    for loss, grads in results:
        assert loss == pytest.approx(reference_loss, rel=1e-4)
        assert_grads_close(grads, reference_grads, "meta")
