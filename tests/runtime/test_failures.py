"""Failures end in bounded time with ExecutionError naming the rank (and the instruction), never a
silent hang: a stalled peer, a dead peer, a worker exception, a launch timeout."""

import json
import os
import time

import pytest
from pipeline_helpers import make_case

from octopipe import ExecutionError
from octopipe.runtime import launch


def _peer_fails(rank, world_size, how, timeout_s, report):
    case = make_case("llama", "1f1b", world_size, 2)
    engine = case.engine(rank, timeout_s=timeout_s)
    if rank == 1:
        if how == "die":
            os._exit(3)
        time.sleep(timeout_s + 3)  # stall: never send, never receive
        return "stalled"
    start = time.monotonic()
    try:
        engine.step(case.inputs, case.target)
    except ExecutionError as exc:
        with open(report, "w") as handle:
            json.dump({"elapsed": time.monotonic() - start, "message": str(exc)}, handle)
        return "raised"
    return "finished"


@pytest.mark.timeout(120)
def test_stalled_peer_raises_within_the_timeout(tmp_path):
    report = tmp_path / "report.json"
    assert launch(_peer_fails, 2, ("stall", 2.0, str(report)), timeout_s=60) == ["raised", "stalled"]
    result = json.loads(report.read_text())
    assert result["elapsed"] < 2.0 + 3.0
    message = result["message"]
    assert message.startswith("rank 0:") and "rank 1" in message and "did not answer within 2 s" in message
    assert "recv_grad stage=0 mb=0 peer=1 peer_stage=1" in message, "names the instruction it waited in"


@pytest.mark.timeout(120)
def test_dead_peer_raises_and_launch_names_it(tmp_path):
    report = tmp_path / "report.json"
    with pytest.raises(ExecutionError, match=r"(?s)worker rank 1 of 2 failed.*exited with code 3"):
        launch(_peer_fails, 2, ("die", 20.0, str(report)), timeout_s=60)
    result = json.loads(report.read_text())
    assert result["elapsed"] < 20.0, "a closed connection fails at once, not at the timeout"
    assert result["message"].startswith("rank 0:") and "rank 1" in result["message"]


def _raises_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    return rank


def _hangs_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


@pytest.mark.timeout(120)
def test_worker_exception_is_raised_in_the_parent_with_traceback():
    with pytest.raises(ExecutionError) as info:
        launch(_raises_on_rank_one, 2, timeout_s=30)
    text = str(info.value)
    assert "worker rank 1 of 2 failed" in text and "ValueError: bad shard on purpose" in text
    assert "_raises_on_rank_one" in text, "the worker's traceback comes along"


@pytest.mark.timeout(120)
def test_launch_timeout_kills_and_names_the_rank_with_its_stack():
    start = time.monotonic()
    with pytest.raises(ExecutionError, match=r"rank\(s\) \[0\] of 2 did not finish within timeout_s=3 s") as info:
        launch(_hangs_on_rank_zero, 2, timeout_s=3)
    assert time.monotonic() - start < 15
    assert "_hangs_on_rank_zero" in str(info.value), "the hung rank's stack is in the message"


def _sum_of_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return rank, world_size, value.item(), torch.get_num_threads(), os.environ["RANK"]


@pytest.mark.timeout(120)
def test_launch_returns_values_by_rank():
    assert launch(_sum_of_ranks, 3, timeout_s=60) == [(r, 3, 3.0, 1, str(r)) for r in range(3)]


def _adds_rank(rank, world_size, tensor):
    tensor.add_(rank + 1)  # in place, as an optimizer step changes parameters
    return tensor.sum().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_launch_gives_workers_copies_of_their_args(method):
    # spawn as a CUDA build of torch makes launch use it: multiprocessing's pickler would share CPU
    # tensors with the workers, whose training then changed the caller's model
    import torch

    tensor = torch.zeros(4)
    assert launch(_adds_rank, 2, (tensor,), timeout_s=60, start_method=method) == [4.0, 8.0]
    assert torch.equal(tensor, torch.zeros(4))


def test_launch_without_fork_refuses_args_that_do_not_pickle():
    with pytest.raises(ExecutionError, match="must pickle to start processes with 'spawn'"):
        launch(_adds_rank, 2, (lambda: None,), timeout_s=60, start_method="spawn")


def _returns_then_lingers(rank, world_size, marker):
    import threading

    def finish_later():
        time.sleep(1.0)
        with open(f"{marker}.{rank}", "w") as handle:
            handle.write("exited normally")

    threading.Thread(target=finish_later).start()  # not a daemon: the process exits after it
    return rank


@pytest.mark.timeout(120)
def test_ranks_that_reported_are_let_finish_exiting_not_signalled_or_killed(tmp_path):
    marker = str(tmp_path / "done")
    assert launch(_returns_then_lingers, 2, (marker,), timeout_s=60) == [0, 1]
    # each rank was still alive after reporting; launch waited for it instead of asking it for
    # stacks (SIGUSR1) and killing it half a second later
    assert all(os.path.exists(f"{marker}.{rank}") for rank in range(2))
