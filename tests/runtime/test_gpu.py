"""The exactness checks on GPUs: one GPU (every stage in one process, selective recomputation,
Triton kernels from torch.compile, bf16 autocast, the engine's default device under NCCL), and
two or four with NCCL and the communication stream. Skipped where the machine has too few GPUs."""

import pytest
import torch
from pipeline_helpers import assert_grads_close, build_model, greedy_plan, make_case, reference

from octopipe.runtime import launch

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
pytestmark = [pytest.mark.gpu, one_gpu]


def _one_device_plan(stages, microbatches):
    """Every stage on device 0, layers split evenly, B/W split (W ops fill the one device's gaps)."""
    def build(graph, *_):
        count = len(graph.layers)
        sizes = [count * (k + 1) // stages - count * k // stages for k in range(stages)]
        return greedy_plan(1, [0] * stages, microbatches, split=True, layers_per_stage=sizes)
    return build


def _gpu_reference(name):
    """Single-GPU training of the same model on the same batch: (loss, grads on the CPU)."""
    model, inputs, target, loss_fn = build_model(name)
    model = model.cuda()
    loss = loss_fn(model(*(t.cuda() for t in inputs)), target.cuda())
    loss.backward()
    return loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gemma", "deepseek", "nemotron-h", "skipnet"])
def test_one_gpu_pipeline_matches_single_gpu_training(name):
    # four stages on one GPU: local hand-offs, split backward and the GPU's random state per stage
    case = make_case(name, _one_device_plan(4, 4), 1, 4)
    device = torch.device("cuda")
    engine = case.engine(0, device=device)
    loss = engine.step(case.inputs, case.target)
    reference_loss, reference_grads = _gpu_reference(name)
    assert loss == pytest.approx(reference_loss, rel=1e-4)
    assert all(p.device.type == "cuda" for _, p in engine.named_parameters())
    assert_grads_close({n: p.grad.cpu() for n, p in engine.named_parameters()}, reference_grads, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gemma", "nemotron-h"])
def test_selective_stages_on_one_gpu_match_the_plan_without_them(name):
    # the selective checkpoint on CUDA (its policy over the flash/efficient attention kernels,
    # the GPU's random state): the same loss and gradients as the same plan without it
    results = []
    for selective in ((True, False, True, True), (False,) * 4):
        def plan(graph, *args, selective=selective):
            return _one_device_plan(4, 4)(graph, *args).with_recompute([False] * 4, selective)
        case = make_case(name, plan, 1, 4)
        engine = case.engine(0, device=torch.device("cuda"))
        results.append((engine.step(case.inputs, case.target), {n: p.grad.cpu() for n, p in engine.named_parameters()}))
    (loss, grads), (plain_loss, plain_grads) = results
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert_grads_close(grads, plain_grads, f"{name} selective")


@pytest.mark.timeout(300)
def test_compiled_stages_on_the_gpu_match_eager_stages():
    # torch.compile on CUDA: Inductor's Triton kernels, with split backward's weight-gradient stash
    eager = make_case("skipnet", _one_device_plan(2, 2), 1, 2, num_blocks=2)
    compiled = make_case("skipnet", _one_device_plan(2, 2), 1, 2, num_blocks=2, compile=True)
    device = torch.device("cuda")
    results = []
    for case in (eager, compiled):
        engine = case.engine(0, device=device)
        results.append((engine.step(case.inputs, case.target), {n: p.grad.cpu() for n, p in engine.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    assert_grads_close(grads, eager_grads, "compiled")


@pytest.mark.timeout(300)
def test_bf16_autocast_on_one_gpu_matches_single_gpu_autocast_training():
    from test_autocast import _batch

    model, pipe = _autocast_pipe(1, "zb-v")
    assert pipe.plan.num_stages == 2
    engine = pipe.engine(0, device=torch.device("cuda"))
    tokens, target = _batch()
    loss = engine.step((tokens,), target)
    _assert_matches_autocast_training(loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}, model)


@pytest.mark.timeout(300)
def test_fp16_on_one_gpu_matches_gradscaler_training():
    from test_autocast import MICROBATCHES, _batch, _loss

    model, pipe = _autocast_pipe(1, "zb-v", "fp16")
    engine = pipe.engine(0, device=torch.device("cuda"))
    tokens, target = _batch()
    loss = engine.step((tokens,), target)
    assert not engine.skipped_step
    model = model.cuda()
    scaler = torch.amp.GradScaler("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    total = 0.0
    for x, y in zip(tokens.cuda().chunk(MICROBATCHES), target.cuda().chunk(MICROBATCHES)):
        with torch.autocast("cuda", dtype=torch.float16):
            part = _loss(model(x), y) / MICROBATCHES
        scaler.scale(part).backward()
        total += part.item()
    scaler.unscale_(optimizer)
    assert loss == pytest.approx(total, rel=1e-3)
    for name, p in engine.named_parameters():
        reference = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(p.grad, reference, rtol=1e-2, atol=1e-3 * reference.abs().max().item())


def _autocast_pipe(num_devices, schedule, autocast="bf16"):
    """test_autocast's model and its autocast pipeline, compiled for an NCCL cluster."""
    import copy

    from test_autocast import MICROBATCHES, _batch, _loss, _model

    import octopipe

    model = _model()
    tokens, target = _batch()
    pipe = octopipe.compile(copy.deepcopy(model), "h100x8", num_devices=num_devices, example_inputs=(tokens,),
                            example_target=target, loss_fn=_loss, num_microbatches=MICROBATCHES, schedule=schedule,
                            autocast=autocast, quiet=True)
    return model, pipe


def _assert_matches_autocast_training(loss, grads, model):
    """`loss` and `grads` (by name, on the CPU) are those of single-GPU autocast training of
    `model` on test_autocast's batch, microbatch by microbatch (bf16 rounding apart)."""
    from test_autocast import MICROBATCHES, _batch, _loss

    tokens, target = _batch()
    model = model.cuda()
    total = 0.0
    for x, y in zip(tokens.cuda().chunk(MICROBATCHES), target.cuda().chunk(MICROBATCHES)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            part = _loss(model(x), y) / MICROBATCHES
        part.backward()
        total += part.item()
    assert loss == pytest.approx(total, rel=1e-3)
    reference = {n: p.grad.cpu() for n, p in model.named_parameters()}
    scale = max(g.abs().max().item() for g in reference.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-2, atol=1e-3 * scale)


def _default_device_step(rank, world_size, pipe, inputs, target):
    engine = pipe.engine(rank)  # no device: under NCCL, this process's GPU
    loss = engine.step(inputs, target)
    cpu_refused = ""
    try:
        pipe.engine(rank, device="cpu")
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        cpu_refused = str(exc)
    return engine.device.type, loss, cpu_refused


@pytest.mark.timeout(300)
def test_engine_under_nccl_runs_on_the_gpu_by_default():
    import octopipe
    from octopipe import models

    model, inputs, target, _ = build_model("gemma")
    pipe = octopipe.compile(model, "h100x8", num_devices=1, example_inputs=inputs, example_target=target,
                            loss_fn=models.lm_loss, num_microbatches=4, schedule="zb-v", quiet=True)
    [(device_type, loss, cpu_refused)] = launch(_default_device_step, 1, (pipe, inputs, target), timeout_s=240,
                                                backend="nccl", start_method="spawn")
    assert device_type == "cuda"
    assert loss == pytest.approx(_gpu_reference("gemma")[0], rel=1e-4)
    assert "NCCL process group" in cpu_refused and "backend='gloo'" in cpu_refused


def _run_on_gpu(rank, world_size, family):
    case = make_case("gemma", family, world_size, 4)
    device = torch.device("cuda", rank)
    engine = case.engine(rank, device=device, timeout_s=60)  # moves this rank's stages to its GPU
    loss = engine.step(case.inputs, case.target.to(device))
    return loss, {n: p.grad.cpu() for n, p in engine.named_parameters()}


@pytest.mark.timeout(300)
@two_gpus
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
@two_gpus
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
@two_gpus
def test_bf16_autocast_on_gpus_matches_single_gpu_autocast_training():
    # compiled for an NCCL cluster: the cross-stage dtypes come from a fake run on CUDA tensors,
    # where autocast's lists are CUDA's (einsum and more in bf16, not only the CPU's matmuls)
    model, pipe = _autocast_pipe(2, "zb-h1")
    results = launch(_autocast_on_gpu, 2, (pipe,), timeout_s=240, backend="nccl", start_method="spawn")
    _assert_matches_autocast_training(results[0][0], {**results[0][1], **results[1][1]}, model)


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


@pytest.mark.timeout(300)
def test_plan_profile_measures_on_the_gpu(tmp_path, capsys):
    from octopipe.cli import EXIT_OK, main

    assert main(["plan", "--model", "llama", "--profile", "--devices", "2", "--microbatches", "4", "--time-limit", "5",
                 "--quiet", "-o", str(tmp_path / "plan.json")]) == EXIT_OK
    assert "--profile measures on cuda:0" in capsys.readouterr().err
