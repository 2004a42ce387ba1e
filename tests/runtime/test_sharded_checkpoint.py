"""Engine.save_checkpoint(path, sharded=True): every rank writes its own shard into a directory
and rank 0 an index, nothing gathered (Megatron's per-rank files). 4 gloo processes (2 replicas x
2 ranks of gemma, its optimizer state sharded by rows): the directory's merged state equals the
gathered file's bit for bit, each shard holds its rank's part only, a save over an older one
leaves only the new shards, and the directory resumes sharded and unsharded runs and loads into
the plain model; a background save holds the state at its call and is indexed only when
finished."""

import os

import pytest
import torch
from pipeline_helpers import replica_token_batches

import octopipe
from octopipe import models
from octopipe.errors import ArgumentError, ExecutionError
from octopipe.runtime import launch, load_into_model
from octopipe.runtime.engine import SHARDED_INDEX
from octopipe.runtime.materialize import checkpoint_state

pytestmark = pytest.mark.usefixtures("one_thread")
REPLICAS = 2
LR = 1e-2


def _model():
    torch.manual_seed(0)
    return models.build("gemma", "tiny")


def _batches():
    return replica_token_batches(REPLICAS, 7)


def _pipe(shard):
    tokens, target = _batches()
    return octopipe.compile(_model(), "cpux4", example_inputs=(tokens[0],), example_target=target[0],
                            loss_fn=models.lm_loss, num_microbatches=2, schedule="1f1b", data_parallel=REPLICAS,
                            shard_optimizer=shard, quiet=True)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _step(engine, batch):
    loss = engine.step(*batch)
    engine.clip_grad_norm_(0.5)
    engine.optimizer_step()
    return loss


def _worker(rank, world_size, folder):
    tokens, target = _batches()
    mine = ((tokens[rank % REPLICAS],), target[rank % REPLICAS])
    engine = _pipe(True).engine(rank, timeout_s=60, optimizer=_adamw)
    for _ in range(2):
        _step(engine, mine)
    engine.save_checkpoint(f"{folder}/ckpt", sharded=True)  # an older save, replaced below
    _step(engine, mine)
    if rank == 0:  # a stray shard of some other save: dropped with the older ones
        torch.save({"model": {}}, f"{folder}/ckpt/shard-stray-rank00000-of00004.pt")
    extra = {"iteration": 3, "scheduler": {"last_epoch": 3, "base_lrs": [LR]}, "seen": torch.tensor([rank])}
    engine.save_checkpoint(f"{folder}/ckpt", sharded=True, extra=extra)  # (the loop's own state, rank 0's kept)
    engine.save_checkpoint(f"{folder}/gathered.pt", extra=extra)
    # in the background (Megatron's --async-save): the shard copied, written by a thread while
    # the next step changes the weights in place; complete (indexed) only at finish_checkpoint
    engine.save_checkpoint(f"{folder}/background", sharded=True, background=True, extra=extra)
    indexed_before_finish = os.path.exists(f"{folder}/background/{SHARDED_INDEX}")
    _step(engine, mine)
    engine.finish_checkpoint()
    after = {n: p.detach().clone() for n, p in engine.named_parameters()}
    resumed = {}
    extras = []
    for shard in (True, False):  # the directory resumed: the next step as the uninterrupted run took it
        other = _pipe(shard).engine(rank, timeout_s=60, optimizer=_adamw)
        extras.append(other.load_checkpoint(f"{folder}/ckpt"))
        _step(other, mine)
        resumed[shard] = {n: p.detach().clone() for n, p in other.named_parameters()}
    extras.append(engine.load_checkpoint(f"{folder}/gathered.pt"))
    refused = []
    for options in (dict(sharded="yes"), dict(background=True), dict(extra={"schedule": lambda step: 1.0}),
                    dict(extra=[3])):
        try:
            engine.save_checkpoint(f"{folder}/ckpt", **options)
        except ArgumentError as exc:
            refused.append(str(exc))
    return after, resumed, (refused, indexed_before_finish), extras


@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_is_the_gathered_one_written_rank_by_rank(tmp_path):
    per_rank = launch(_worker, 4, args=(str(tmp_path),), timeout_s=240)
    for rank, (after, resumed, (refused, indexed_before_finish), extras) in enumerate(per_rank):
        # every rank gets rank 0's state of the loop back, from the directory and the file
        for extra in extras:
            assert extra["iteration"] == 3 and extra["scheduler"] == {"last_epoch": 3, "base_lrs": [LR]}, rank
            assert torch.equal(extra["seen"], torch.tensor([0])), rank
        for shard in (True, False):
            assert set(resumed[shard]) == set(after), rank
            for name, value in after.items():
                assert torch.equal(resumed[shard][name], value), (rank, shard, name)
        assert len(refused) == 4 and "must be True or False" in refused[0] and "pass sharded=True too" in refused[1]
        assert "extra['schedule'] is a function" in refused[2] and "takes a dict" in refused[3]
        assert not indexed_before_finish, rank
    folder = tmp_path / "ckpt"
    files = sorted(os.listdir(folder))
    assert SHARDED_INDEX in files
    shards = [name for name in files if name.startswith("shard-")]
    assert len(shards) == 4 and len({name.split("-")[1] for name in shards}) == 1  # one save's, the last
    assert all(name.endswith(f"rank{r:05d}-of00004.pt") for r, name in enumerate(shards))
    merged = checkpoint_state(str(folder), 0)
    gathered = torch.load(tmp_path / "gathered.pt", weights_only=True)
    assert set(merged) == set(gathered)

    def equal(a, b, where):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert set(a) == set(b), where
            for key in a:
                equal(a[key], b[key], (*where, key))
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for index, (x, y) in enumerate(zip(a, b)):
                equal(x, y, (*where, index))
        else:
            assert a == b, where

    equal(merged, gathered, ())
    # the background save holds the state at its call, not the step taken while it wrote
    equal(checkpoint_state(str(tmp_path / "background"), 0), gathered, ("background",))
    # each rank wrote its own part: replica 0's ranks their stages' weights, replica 1's none (and
    # their rows of the optimizer's state)
    parts = [torch.load(folder / name, weights_only=True) for name in shards]
    names = [set(part["model"]) for part in parts]
    assert names[0] and names[2] and not names[1] and not names[3]
    assert names[0].isdisjoint(names[2] - {"embed.weight"})  # (the tied embedding: on both pipeline ranks)
    assert all(part["optimizer"]["state"] for part in parts)
    total = sum(value.numel() for part in parts for state in part["optimizer"]["state"].values()
                for key, value in state.items() if key == "exp_avg")
    # (the tied embedding's state is held by both pipeline ranks' copies)
    assert total >= sum(value.numel() for state in gathered["optimizer"]["state"].values()
                        for key, value in state.items() if key == "exp_avg")
    # the plain model loads the directory as it loads the file
    plain, reference = _model(), _model()
    load_into_model(plain, merged)
    load_into_model(reference, gathered)
    for (name, a), (_, b) in zip(plain.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_a_sharded_checkpoint_directory_that_is_incomplete_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExecutionError, match=f"a directory without {SHARDED_INDEX}: not a sharded checkpoint"):
        checkpoint_state(str(tmp_path / "empty"), 0)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / SHARDED_INDEX).write_text('{"format": "octopipe sharded checkpoint 1", "world_size": 1, '
                                                       '"files": ["shard-x-rank00000-of00001.pt"]}')
    with pytest.raises(ExecutionError, match="names 'shard-x-rank00000-of00001.pt', which is missing"):
        checkpoint_state(str(tmp_path / "partial"), 0)
    (tmp_path / "partial" / SHARDED_INDEX).write_text('{"format": "other", "files": ["../x.pt"]}')
    with pytest.raises(ExecutionError, match="is not an index of"):
        checkpoint_state(str(tmp_path / "partial"), 0)
