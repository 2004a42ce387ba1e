"""Our baseline orders against torch.distributed.pipelining's, and our plans through torch's CSV.

torch builds a schedule's per-rank compute order (`pipeline_order`) in the schedule's
constructor from the stage objects' num_stages / group_size / group_rank alone, and lowers it
with sends and receives without touching a process group. So stand-in stage objects are enough
to get torch's own order for any (devices, stages, microbatches), and a recording stand-in runs
the single-stage schedules' real `_step_microbatches` loop (the order they execute).

Findings (each asserted below):
  * GPipe, interleaved 1F1B, ZB-V: identical to torch for every input torch accepts, and we refuse
    (PlanError) exactly the interleaved microbatch counts torch refuses (ValueError).
  * 1F1B: identical to the order torch's Schedule1F1B executes. Its `pipeline_order` (the IR it
    exports and draws) differs on the last rank only: there it lists forwards 1..m instead of
    0..m-1, because `_get_pipeline_order` pre-increments `forward_mb` in the steady state and the
    last rank has no warm-up forward to start it from. That is a torch bug (microbatch m does not
    exist and 0 is missing). torch also refuses m < p; we build it (warm-up min(p-1-i, m)).
  * DualPipeV: identical once each OVERLAP_F_B action is expanded into its sub-actions (F, then
    a full B), which is how OctoPipe runs an overlapped pair; both require m >= 2p.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

from octopipe.cluster import ClusterSpec  # noqa: E402
from octopipe.errors import PlanError  # noqa: E402
from octopipe.ir.costs import CostTable, LayerCost  # noqa: E402
from octopipe.ir.plan import PipelinePlan  # noqa: E402
from octopipe.schedules import NAMES, baselines, build  # noqa: E402

_Action = pipelining._Action
COMPUTE = {"F", "I", "B", "W"}


def stand_in(num_stages: int, num_devices: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_stages=num_stages, group_size=num_devices, group_rank=rank, stage_index=rank,
                           submod=None, stage_index_to_group_rank=None, is_first=rank == 0,
                           is_last=rank == num_stages - 1, has_backward=True)


def torch_order(schedule_class, num_devices: int, num_microbatches: int, stages_per_device: int = 1) -> list[list[str]]:
    """torch's compute order per rank, as action strings; OVERLAP_F_B expanded into its sub-actions."""
    num_stages = num_devices * stages_per_device
    if stages_per_device == 1:
        schedule = schedule_class(stand_in(num_stages, num_devices), num_microbatches)
    else:
        schedule = schedule_class([stand_in(num_stages, num_devices) for _ in range(stages_per_device)], num_microbatches)
    rows = []
    for rank in range(num_devices):
        row = []
        for action in schedule.pipeline_order[rank]:
            if action is None:
                continue
            for part in action.sub_actions or (action,):
                if part.computation_type.value in COMPUTE:
                    row.append(str(part))
        rows.append(row)
    return rows


def our_order(name: str, num_devices: int, num_microbatches: int, stages_per_device: int | None = None) -> list[list[str]]:
    """Our plan in torch's notation (B -> I where the pair has a W): the rows of `to_torch_csv`."""
    stages = num_devices * (stages_per_device or (2 if name in ("interleaved-1f1b", "zb-v", "dualpipe-v") else 1))
    costs = CostTable([LayerCost(name=f"l{i}", forward_ms=1.0, backward_ms=2.0) for i in range(stages)])
    cluster = ClusterSpec.preset("h100x8", num_devices=num_devices)
    plan = build(name, costs, cluster, num_microbatches, stages_per_device=stages_per_device)
    return [row.split(",") if row else [] for row in plan.to_torch_csv().splitlines()]


class RecordingStage(SimpleNamespace):
    """A stage that only logs the compute torch's single-stage loop asks of it (no comms, no tensors)."""

    def get_fwd_recv_ops(self, microbatch):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{microbatch}")

    def backward_one_chunk(self, microbatch, **kwargs):
        self.log.append(f"{self.stage_index}B{microbatch}")

    def perform_reduce_grad(self, *args):
        pass

    def clear_runtime_states(self):
        pass


def torch_executed_order(schedule_class, num_devices: int, num_microbatches: int) -> list[list[str]]:
    rows = []
    for rank in range(num_devices):
        stage = RecordingStage(**vars(stand_in(num_devices, num_devices, rank)), log=[])
        schedule = schedule_class(stage, num_microbatches)
        schedule._initialize_stage = lambda *args, **kwargs: None  # shape inference needs real modules
        schedule._step_microbatches()
        rows.append(stage.log)
    return rows


# -- single-stage schedules -----------------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(1, 1), (1, 3), (2, 2), (2, 5), (4, 4), (4, 8), (4, 11), (8, 16)])
def test_1f1b_equals_what_torch_executes(p, m):
    assert our_order("1f1b", p, m) == torch_executed_order(pipelining.Schedule1F1B, p, m)


@pytest.mark.parametrize("p, m", [(1, 2), (2, 2), (2, 5), (4, 4), (4, 8), (8, 16)])
def test_1f1b_differs_from_torch_pipeline_order_only_by_its_last_rank_bug(p, m):
    ours = our_order("1f1b", p, m)
    theirs = torch_order(pipelining.Schedule1F1B, p, m)
    assert theirs[:-1] == ours[:-1]

    def shift_forwards(action: str) -> str:
        parsed = _Action.from_str(action)
        if parsed.computation_type.value != "F":
            return action
        return f"{parsed.stage_index}F{parsed.microbatch_index + 1}"

    assert theirs[-1] == [shift_forwards(a) for a in ours[-1]]
    assert f"{p - 1}F0" not in theirs[-1] and f"{p - 1}F{m}" in theirs[-1]


def test_torch_refuses_1f1b_with_fewer_microbatches_than_stages_we_do_not():
    with pytest.raises(ValueError):
        torch_order(pipelining.Schedule1F1B, 4, 3)
    assert len(our_order("1f1b", 4, 3)) == 4


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (4, 4), (4, 9), (8, 8)])
def test_gpipe_is_identical(p, m):
    assert our_order("gpipe", p, m) == torch_order(pipelining.ScheduleGPipe, p, m)
    assert our_order("gpipe", p, m) == torch_executed_order(pipelining.ScheduleGPipe, p, m)


# -- multi-stage schedules ------------------------------------------------------------------------

INTERLEAVED_CASES = [(p, v, m) for p in (1, 2, 3, 4) for v in (2, 3) for m in range(1, 3 * p + 3)]


@pytest.mark.parametrize("p, v, m", INTERLEAVED_CASES)
def test_interleaved_1f1b_is_identical_where_defined(p, v, m):
    try:
        theirs = torch_order(pipelining.ScheduleInterleaved1F1B, p, m, v)
    except ValueError:
        with pytest.raises(PlanError, match="not a multiple"):
            our_order("interleaved-1f1b", p, m, v)
        return
    assert our_order("interleaved-1f1b", p, m, v) == theirs


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 3, 4, 5) for m in range(1, 3 * p + 2)])
def test_zb_v_is_identical(p, m):
    assert our_order("zb-v", p, m) == torch_order(pipelining.ScheduleZBVZeroBubble, p, m, 2)


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 3, 4, 6) for m in range(1, 4 * p + 2)])
def test_dualpipe_v_is_torch_with_overlapped_pairs_run_f_then_b(p, m):
    if m < 2 * p:
        with pytest.raises(ValueError):
            torch_order(pipelining.ScheduleDualPipeV, p, m, 2)
        with pytest.raises(PlanError, match=r"num_microbatches >= 2 \* num_devices"):
            our_order("dualpipe-v", p, m)
        return
    assert our_order("dualpipe-v", p, m) == torch_order(pipelining.ScheduleDualPipeV, p, m, 2)


# -- CSV round trip through torch -----------------------------------------------------------------

@pytest.mark.parametrize("p, m", [(1, 2), (2, 4), (4, 8), (3, 7)])
def test_our_plans_load_in_torch_and_come_back_unchanged(tmp_path: Path, p, m):
    costs = CostTable([LayerCost(name=f"l{i}", forward_ms=1.0 + i % 3, backward_ms=2.0) for i in range(4 * p + 1)])
    plans = baselines(costs, ClusterSpec.preset("h100x8", num_devices=p), m)
    assert {key.split("/")[0] for key in plans} >= set(NAMES) - {"dualpipe-v", "interleaved-1f1b"}
    for key, plan in plans.items():
        text = plan.to_torch_csv()
        rows = [row.split(",") if row else [] for row in text.splitlines()]
        for row in rows:
            for cell in row:
                action = _Action.from_str(cell)
                assert str(action) == cell and action.computation_type.value in COMPUTE
        path = tmp_path / f"{key.replace('/', '_')}.csv"
        path.write_text(text)
        stages = [stand_in(plan.num_stages, p) for _ in range(len(plan.stages_of(0)))]
        schedule = pipelining._PipelineScheduleRuntime(stages=stages, n_microbatches=m)
        schedule._load_csv(str(path))  # validates, infers stage -> rank, lowers with sends/receives
        assert schedule.stage_index_to_group_rank == dict(enumerate(plan.placement)), key
        assert [[str(a) for a in schedule.pipeline_order[rank]] for rank in range(p)] == rows, key
        assert all(schedule.pipeline_order_with_comms[rank] for rank in range(p))
        assert PipelinePlan.from_torch_csv(text, plan.boundaries) == plan, key
