"""End to end: OctoPipe's plan run by OctoPipe's runtime vs torch.distributed.pipelining's best
built-in schedule with the uniform split its users write, on heterogeneous models, in one run.

For each model (Gemma-style head-heavy, DeepSeek-style dense+MoE, Nemotron-H-style hybrid, and a
ViT + cross-attention multimodal model; CPU-sized configs), 2 processes (gloo, 1 thread each):

- OctoPipe: profile the layers on this machine, measure the link, `octopipe.plan` (20 s), compile
  its plan and up to two runners-up (`PlanResult.runners_up`: the fastest plans of other shapes,
  predicted within 10%), run each with `Engine`; the fastest measured is ours, as torch's fastest
  measured schedule is theirs (the planner's own choice is the last column);
- torch: hand-cut stage modules with the blocks split uniformly (embedding/vision encoder with the
  first blocks, norm + head with the last, as the torch.distributed.pipelining tutorials do) under
  every built-in schedule it has for 2 ranks (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
  InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), same batch and microbatches.

All runs of one model share one launch and alternate step by step (ours, then each torch
schedule), so machine noise hits them alike; each timed step right after an untimed one of the
same run, so it runs on hot memory (`--no-rewarm` to time cold turns; see
`octopipe.bench.measure_many`). A step's time is the slowest rank's; the table gives
the median of the measured steps, throughput in tokens/s, OctoPipe's speedup over the best
torch schedule (ratio of medians), and the same speedup taken round by round (torch's step over
ours in the same round: median and middle half), which shows how far the noise moves it.

    python benchmarks/e2e_vs_torch.py [--steps 8] [--warmup 1] [--no-rewarm] [--candidates 3] [--models gemma,...]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import octopipe
from octopipe import models
from octopipe.bench import StepTiming, calibrate_cpu_cluster, paired_speedup, runtime_profile
from octopipe.runtime import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_models import BATCH_SIZE, CONFIGS, NUM_MICROBATCHES  # noqa: E402
from cpu_models import build as _data

TORCH_SCHEDULES = (  # (class name, stages per rank, placement "loop" | "v")
    ("ScheduleGPipe", 1, "loop"),
    ("Schedule1F1B", 1, "loop"),
    ("ScheduleInterleaved1F1B", 2, "loop"),
    ("ScheduleLoopedBFS", 2, "loop"),
    ("ScheduleInterleavedZeroBubble", 2, "loop"),
    ("ScheduleZBVZeroBubble", 2, "v"),
    ("ScheduleDualPipeV", 2, "v"),
)


class DecoderChunk(nn.Module):
    """Blocks [start, end) of a DecoderLM-shaped model; the embedding first, norm + head last."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.embed = model.embed if start == 0 else None
        self.layers = nn.ModuleList(model.layers[i] for i in range(start, end))
        self.tail = nn.Sequential(model.norm, model.head) if end == len(model.layers) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.tail(x) if self.tail is not None else x


class MultimodalChunk(nn.Module):
    """Decoder blocks [start, end) of the multimodal model, passing the vision features along
    (torch.distributed.pipelining sends stage outputs only to the next stage)."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.first = start == 0
        self.last = end == len(model.layers)
        self.vision = model.vision if self.first else None
        self.projector = model.projector if self.first else None
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleList(model.layers[i] for i in range(start, end))
        self.tail = nn.Sequential(model.norm, model.head) if self.last else None

    def forward(self, a: torch.Tensor, b: torch.Tensor):
        if self.first:
            vision, hidden = self.projector(self.vision(a)), self.embed(b)
        else:
            hidden, vision = a, b
        for layer in self.layers:
            hidden = layer(hidden, vision) if type(layer).__name__ == "CrossAttentionBlock" else layer(hidden)
        return self.tail(hidden) if self.last else (hidden, vision)


def _torch_schedules(model: nn.Module, name: str, rank: int, world_size: int, num_microbatches: int):
    from torch.distributed import pipelining

    chunk_class = MultimodalChunk if name == "multimodal" else DecoderChunk
    num_blocks = len(model.layers)
    built = {}
    for class_name, per_rank, shape in TORCH_SCHEDULES:
        num_stages = world_size * per_rank
        bounds = [num_blocks * k // num_stages for k in range(num_stages + 1)]
        if shape == "loop":
            own = [s for s in range(num_stages) if s % world_size == rank]
        else:
            own = [rank, num_stages - 1 - rank]
        stages = [pipelining.PipelineStage(chunk_class(model, bounds[s], bounds[s + 1]), s, num_stages,
                                           torch.device("cpu")) for s in own]
        schedule_class = getattr(pipelining, class_name)
        try:
            schedule = (schedule_class(stages[0], num_microbatches, loss_fn=models.lm_loss) if per_rank == 1
                        else schedule_class(stages, num_microbatches, loss_fn=models.lm_loss))
        except Exception as exc:  # noqa: BLE001 - a schedule torch refuses for this shape is reported, not fatal
            built[class_name] = f"refused: {exc}"
            continue
        built[class_name] = (schedule, 0 in own, num_stages - 1 in own)
    return built


def worker(rank: int, world_size: int, name: str, pipes, steps: int, warmup: int, rewarm: bool = True) -> dict:
    # torch's DualPipeV hands AccumulateGrad a transposed gradient for deepseek's stacked expert
    # weights and warns that this "may impair performance"; its time is measured, the warning only
    # broke up the table
    warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
    torch.manual_seed(0)
    model, inputs, target = _data(name)
    # the compiled pipelines share parameters with their own copy of the model; torch's chunks use `model`
    engines = [pipe.engine(rank) for pipe in pipes]
    schedules = _torch_schedules(model, name, rank, world_size, pipes[0].num_microbatches)

    def run_ours(engine) -> None:
        engine.step(inputs, target)
        engine.zero_grad()

    runs = {_ours(index): functools.partial(run_ours, engine) for index, engine in enumerate(engines)}
    for class_name, entry in schedules.items():
        if isinstance(entry, str):
            continue
        schedule, has_first, has_last = entry

        def run_torch(schedule=schedule, has_first=has_first, has_last=has_last) -> None:
            args = inputs if has_first else ()
            if has_last:
                schedule.step(*args, target=target, losses=[])
            else:
                schedule.step(*args)
            model.zero_grad(set_to_none=True)

        runs[class_name] = run_torch
    times: dict[str, list[float]] = {key: [] for key in runs}
    failed: dict[str, str] = {key: entry for key, entry in schedules.items() if isinstance(entry, str)}
    for repetition in range(warmup + steps):
        for key, run in list(runs.items()):
            try:
                if rewarm:  # an untimed step first: the timed one runs on hot memory (bench.measure_many)
                    dist.barrier()
                    run()
                dist.barrier()
                start = time.perf_counter()
                run()
            except Exception as exc:  # noqa: BLE001
                failed[key] = f"failed: {type(exc).__name__}: {exc}"[:200]
                del runs[key]
                continue
            dist.barrier()
            if repetition >= warmup:
                times[key].append(time.perf_counter() - start)
    return {"times": times, "failed": failed}


def _ours(index: int) -> str:
    return "octopipe" if index == 0 else f"octopipe runner-up {index}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-rewarm", action="store_true",
                        help="time each run's first step of its turn (memory it left cold, see bench.measure_many)")
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--time-limit", type=float, default=20.0, help="planner seconds per model")
    parser.add_argument("--candidates", type=int, default=3,
                        help="OctoPipe plans measured: the planner's choice and its runners-up (PlanResult.runners_up)")
    parser.add_argument("--microbatches", type=int, default=NUM_MICROBATCHES,
                        help=f"microbatches of the batch of {BATCH_SIZE} (a divisor of it)")
    args = parser.parse_args()
    num_microbatches = args.microbatches
    torch.set_num_threads(1)
    calibrated = calibrate_cpu_cluster(2)
    print(f"2 ranks, gloo, CPU, 1 thread each; link {calibrated.latency_s * 1e6:.0f} us, "
          f"{calibrated.intra_node_bandwidth / 1e9:.2f} GB/s; batch {BATCH_SIZE}, {num_microbatches} microbatches; "
          f"median of {args.steps} steps after {args.warmup} warm-up (a step = the slowest rank)")
    header = f"{'model':<11} {'octopipe ms':>11} {'plans':>5} {'best torch schedule':<30} {'torch ms':>9} " \
             f"{'tokens/s ours':>13} {'tokens/s torch':>14} {'speedup':>8}  per-step pairs: median (middle half)  " \
             f"{'planner choice':>14}"
    lines = []
    for name in args.models.split(","):
        model, inputs, target = _data(name)
        profile = runtime_profile(model, inputs, target, models.lm_loss, num_microbatches,
                                  op_overhead_ms=calibrated.op_overhead_ms, rewarm=not args.no_rewarm)
        costs, cluster = profile.costs, profile.calibrate(calibrated)
        result = octopipe.plan(costs, cluster, num_microbatches, time_limit_s=args.time_limit, quiet=True)
        candidates = [result.plan, *result.runners_up][:args.candidates]
        pipes = [octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                                  num_microbatches=num_microbatches, costs=costs, plan=plan) for plan in candidates]
        per_rank = launch(worker, 2, (name, pipes, args.steps, args.warmup, not args.no_rewarm), timeout_s=3600,
                          backend="gloo")
        steps_of = {}
        for key, times in per_rank[0]["times"].items():
            if times:
                steps_of[key] = StepTiming(tuple(max(r["times"][key][k] for r in per_rank) * 1e3
                                                 for k in range(len(times))), ())
        medians = {key: timing.median_ms for key, timing in steps_of.items()}
        mine = {_ours(index): medians.pop(_ours(index)) for index in range(len(pipes)) if _ours(index) in medians}
        fastest = min(mine, key=mine.get)
        ours = mine[fastest]
        best = min(medians, key=medians.get)
        paired = paired_speedup(steps_of[fastest], steps_of[best])
        tokens = BATCH_SIZE * inputs[-1].shape[1]
        print(f"\n{name}: torch per schedule: "
              + ", ".join(f"{k.removeprefix('Schedule')} {v:.0f}" for k, v in sorted(medians.items(), key=lambda kv: kv[1])))
        for index, pipe in enumerate(pipes):  # compile simulated each plan on these costs and cluster
            plan, predicted = pipe.plan, pipe.simulation.iteration_ms
            print(f"  {_ours(index)}: {plan.num_stages} stages, placement {plan.placement}, predicted {predicted:.0f} ms, "
                  f"measured {mine.get(_ours(index), float('nan')):.0f} ms{' (fastest)' if _ours(index) == fastest else ''}")
        for key, why in per_rank[0]["failed"].items():
            print(f"  {key}: {why}")
        choice = mine.get("octopipe", float("nan"))
        lines.append(f"{name:<11} {ours:>11.1f} {len(mine):>5} {best.removeprefix('Schedule'):<30} {medians[best]:>9.1f} "
                     f"{tokens / ours * 1e3:>13.0f} {tokens / medians[best] * 1e3:>14.0f} {medians[best] / ours:>7.3f}x  "
                     f"{paired.median:.3f}x ({paired.low:.3f}x-{paired.high:.3f}x)  {medians[best] / choice:>13.3f}x")
    print()
    print(header)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
