"""compile(..., data_parallel=2): two replicas of a 2-rank pipeline (4 gloo processes), each on its
own batch, train exactly as one plain model on both batches together: loss, every gradient (tied
embedding and head included), token weights across replicas, gradients accumulated over two steps,
the clipped norm and the evaluation loss."""

import pytest
import torch
from pipeline_helpers import assert_grads_close

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError, ClusterSpecError
from octopipe.runtime import launch

pytestmark = pytest.mark.usefixtures("one_thread")
REPLICAS = 2
MICROBATCHES = 2
IGNORE = -100
SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")


def _model():
    torch.manual_seed(0)
    return models.build("gemma", "tiny")  # its head is tied to the embedding


def _batches(padded=False):
    """One batch of 4 rows per replica; `padded`: replica 0 has 13 real tokens in its first
    microbatch, replica 1 none in its second."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (REPLICAS * 4, 8), generator=generator)
    target = torch.randint(0, 64, (REPLICAS * 4, 8), generator=generator)
    if padded:
        target[1, 3:] = IGNORE
        target[6:8, :] = IGNORE
    return tokens.chunk(REPLICAS), target.chunk(REPLICAS)


def _pipe(schedule, weighted):
    tokens, target = _batches(weighted)
    return octopipe.compile(_model(), octopipe.ClusterSpec.preset("cpu", num_devices=4), example_inputs=(tokens[0],),
                            example_target=target[0], loss_fn=models.lm_loss, num_microbatches=MICROBATCHES,
                            schedule=schedule, data_parallel=REPLICAS, quiet=True,
                            loss_weight=models.lm_tokens if weighted else None)


def _worker(rank, world_size):
    replica = rank % REPLICAS
    results = []
    for weighted in (False, True):
        tokens, target = _batches(weighted)
        mine = ((tokens[replica],), target[replica])
        for schedule in SCHEDULES:
            engine = _pipe(schedule, weighted).engine(rank, timeout_s=60)
            loss = engine.step(*mine)
            grads = {n: p.grad.clone() for n, p in engine.named_parameters()}
            engine.step(*mine)  # accumulated: twice this step's gradients, not summed over replicas again
            twice = {n: p.grad.clone() for n, p in engine.named_parameters()}
            norm = engine.clip_grad_norm_(1e-3)  # of the accumulated gradient
            evaluated = engine.evaluate(*mine)
            results.append(dict(loss=loss, grads=grads, twice=twice, norm=norm, evaluated=evaluated))
    return results


def _plain(weighted):
    model = _model()
    tokens, target = _batches(weighted)
    pieces = [(x, y) for t, g in zip(tokens, target) for x, y in zip(t.chunk(MICROBATCHES), g.chunk(MICROBATCHES))]
    if weighted:  # the token mean over both replicas' batches
        loss = models.lm_loss(model(torch.cat(tokens)), torch.cat(target))
    else:  # the mean over every microbatch of both replicas
        loss = sum(models.lm_loss(model(x), y) for x, y in pieces) / len(pieces)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = 2 * param.grad
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    model.eval()
    with torch.no_grad():
        if weighted:
            evaluated = models.lm_loss(model(torch.cat(tokens)), torch.cat(target)).item()
        else:
            evaluated = sum(models.lm_loss(model(x), y).item() for x, y in pieces) / len(pieces)
    return loss.item(), grads, norm, evaluated


@pytest.mark.timeout(300)
def test_replicas_train_as_one_model_on_their_batches_together():
    per_rank = launch(_worker, 4, timeout_s=240)
    index = 0
    for weighted in (False, True):
        loss, grads, norm, evaluated = _plain(weighted)
        for schedule in SCHEDULES:
            what = f"{schedule}{' token-weighted' if weighted else ''}"
            for rank in range(4):
                result = per_rank[rank][index]
                assert result["loss"] == pytest.approx(loss, rel=1e-5), what
                assert result["norm"] == pytest.approx(norm, rel=1e-5), what
                assert result["evaluated"] == pytest.approx(evaluated, rel=1e-5), what
            for replica in range(REPLICAS):
                ranks = [stage * REPLICAS + replica for stage in range(2)]  # this replica's pipeline
                mine = {n: g for r in ranks for n, g in per_rank[r][index]["grads"].items()}
                assert set(mine) == set(grads), what
                assert_grads_close(mine, grads, what)
                twice = {n: g for r in ranks for n, g in per_rank[r][index]["twice"].items()}
                assert_grads_close(twice, {n: 2 * g for n, g in grads.items()}, f"{what} accumulated")
            index += 1


def test_data_parallel_arguments():
    tokens, target = _batches()
    options = dict(example_inputs=(tokens[0],), example_target=target[0], loss_fn=models.lm_loss, num_microbatches=2,
                   schedule="1f1b", quiet=True)
    with pytest.raises(ArgumentError, match="data_parallel must be a positive integer"):
        octopipe.compile(_model(), "cpux4", data_parallel=0, **options)
    with pytest.raises(ClusterSpecError, match="must divide the 4 devices"):
        octopipe.compile(_model(), "cpux4", data_parallel=3, **options)
    with pytest.raises(ClusterSpecError, match="devices of a node"):
        octopipe.compile(_model(), octopipe.ClusterSpec.preset("h100x12"), data_parallel=3, **options)
    pipe = octopipe.compile(_model(), "h100x16", data_parallel=4, **options)
    assert pipe.plan.num_devices == 4 and pipe.world_size == 16
    assert pipe.data_parallel_ms > 0  # the tied embedding's gradient, summed over 4 replicas in a node
    with pytest.raises(ArgumentError, match="compiled for 4 replica"):
        pipe.engine(0, data_parallel=1)
    replica = octopipe.ClusterSpec.preset("h100x16").replica(4)
    assert (replica.num_devices, replica.devices_per_node) == (4, 2)  # a node holds 2 of a replica's 4 devices
    assert octopipe.ClusterSpec.preset("h100x16").replica(8).devices_per_node == 1


def _drawn_worker(rank, world_size, path):
    pipe = _pipe("1f1b", False)
    torch.manual_seed(rank)  # every rank draws different weights
    engine = pipe.engine(rank, init="reset", timeout_s=60)
    engine.save_checkpoint(path)  # replica 0's shards, merged on rank 0
    return {name: p.detach().clone() for name, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_replicas_start_from_the_first_replicas_weights_and_checkpoint_once(tmp_path):
    # as DDP does at construction: whatever each rank drew, replica 1 takes replica 0's values
    path = tmp_path / "replicas.pt"
    per_rank = launch(_drawn_worker, 4, args=(str(path),), timeout_s=90)
    for stage in range(2):
        first, second = per_rank[stage * REPLICAS], per_rank[stage * REPLICAS + 1]
        assert set(first) == set(second) and first
        for name in first:
            assert torch.equal(first[name], second[name]), name
    embed = "embed.weight"
    assert not torch.equal(per_rank[0][embed], _model().state_dict()[embed])  # drawn, not the model's own
    saved = torch.load(path, weights_only=True)["model"]
    held = {**per_rank[0], **per_rank[2]}  # replica 0's pipeline: every parameter once
    assert set(held) <= set(saved)
    for name, value in held.items():
        assert torch.equal(saved[name], value), name
    plain = _model()
    octopipe.runtime.load_into_model(plain, {"model": saved})  # a checkpoint of the whole model
    assert torch.equal(plain.embed.weight, held[embed])
