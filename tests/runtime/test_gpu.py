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


def _autocast_on_gpu(rank, world_size, pipe):
    from test_autocast import _batch

    device = torch.device("cuda", rank)
    engine = pipe.engine(rank, device=device, timeout_s=60)
    tokens, target = _batch()
    loss = engine.step((tokens.to(device),), target.to(device))
    return loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}


@pytest.mark.timeout(300)
def test_bf16_autocast_on_gpus_matches_single_gpu_autocast_training():
    # compiled for an NCCL cluster: the cross-stage dtypes come from a fake run on CUDA tensors,
    # where autocast's lists are CUDA's (einsum and more in bf16, not only the CPU's matmuls)
    import copy

    from test_autocast import MICROBATCHES, _batch, _loss, _model

    import octopipe

    model = _model()
    tokens, target = _batch()
    pipe = octopipe.compile(copy.deepcopy(model), "h100x8", num_devices=2, example_inputs=(tokens,),
                            example_target=target, loss_fn=_loss, num_microbatches=MICROBATCHES, schedule="zb-h1",
                            autocast="bf16", quiet=True)
    results = launch(_autocast_on_gpu, 2, (pipe,), timeout_s=240, backend="nccl", start_method="spawn")
    model = model.cuda()
    total = 0.0
    for x, y in zip(tokens.cuda().chunk(MICROBATCHES), target.cuda().chunk(MICROBATCHES)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss(model(x), y) / MICROBATCHES
        loss.backward()
        total += loss.item()
    reference = {n: p.grad.cpu() for n, p in model.named_parameters()}
    grads = {**results[0][1], **results[1][1]}
    assert results[0][0] == pytest.approx(total, rel=1e-3)
    scale = max(g.abs().max().item() for g in reference.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-2, atol=1e-3 * scale)


def _replicas_on_gpus(rank, world_size):
    from test_data_parallel import MICROBATCHES, _batches, _model

    import octopipe
    from octopipe import models

    device = torch.device("cuda", rank)
    tokens, target = _batches(True)
    replica = rank % 2
    pipe = octopipe.compile(_model(), "h100x4", example_inputs=(tokens[0],), example_target=target[0],
                            loss_fn=models.lm_loss, num_microbatches=MICROBATCHES, schedule="zb-h1", data_parallel=2,
                            loss_weight=models.lm_tokens, quiet=True)  # NCCL's pair order in the programs
    engine = pipe.engine(rank, device=device, timeout_s=60)
    loss = engine.step((tokens[replica].to(device),), target[replica].to(device))
    return loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_data_parallel_replicas_on_gpus_match_the_plain_model():
    # NCCL: 2 replicas x 2 ranks, the overlapped per-stage all-reduces on the GPUs' streams
    from test_data_parallel import REPLICAS, _plain

    results = launch(_replicas_on_gpus, 4, timeout_s=240, backend="nccl", start_method="spawn")
    loss, grads, _, _ = _plain(True)
    for replica in range(REPLICAS):
        mine = {n: g for r in (replica, REPLICAS + replica) for n, g in results[r][1].items()}
        assert_grads_close(mine, grads, f"replica {replica}")
    assert all(result[0] == pytest.approx(loss, rel=1e-4) for result in results)
