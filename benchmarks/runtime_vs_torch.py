"""OctoPipe's runtime vs torch.distributed.pipelining: same model, same schedule, same partition,
2 processes (gloo on CPU), step times side by side in one run.

For each schedule (1F1B, interleaved 1F1B, ZB-V) both runtimes train the same LLaMA-style model
(shared parameter objects) on the same batch: ours runs the plan `octopipe.schedules.build` makes
(identical to torch's order, see tests/test_torch_interop.py) through trace -> codegen -> lower ->
Engine; torch runs PipelineStage + Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble
over hand-cut stage modules with the same layer ranges. Each repetition runs ours then torch, each
after a barrier; a step's time is the slowest rank's; the table shows the median after warm-up.

    python benchmarks/runtime_vs_torch.py [--steps 10] [--warmup 3] [--size small|tiny]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from octopipe import models
from octopipe.cluster import ClusterSpec
from octopipe.ir.costs import CostTable, LayerCost
from octopipe.passes.codegen import codegen, links_of, stages_on, tied_parameters
from octopipe.passes.lower import lower
from octopipe.passes.trace import trace
from octopipe.passes.verify import verify
from octopipe.runtime import Engine, launch

SIZES = {
    "tiny": dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, max_seq_len=32,
                 vocab_size=256, num_layers=8),
    "small": dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768, max_seq_len=128,
                  vocab_size=2048, num_layers=8),
}
SCHEDULES = {  # ours -> (torch class name, stages per rank)
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zb-v": ("ScheduleZBVZeroBubble", 2),
}


class Chunk(nn.Module):
    """Blocks [start, end) of a DecoderLM, with the embedding first and norm + head last."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        num_blocks = len(model.layers)
        self.embed = model.embed if start == 0 else None
        self.layers = nn.ModuleList(model.layers[i] for i in range(start, end))
        self.norm = model.norm if end == num_blocks else None
        self.head = model.head if end == num_blocks else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _timed(fn, model: nn.Module) -> float:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, size: str, batch_size: int, num_microbatches: int, steps: int, warmup: int):
    from torch.distributed import pipelining

    overrides = SIZES[size]
    torch.manual_seed(0)
    model = models.build("llama", **overrides)
    inputs = models.example_inputs("llama", batch_size=batch_size, **overrides)
    target = models.example_target("llama", batch_size=batch_size, **overrides)
    graph = trace(model, inputs, loss_fn=models.lm_loss, example_target=target)
    layer_index = {layer.name: layer.index for layer in graph.layers}
    num_blocks = len(model.layers)
    costs = CostTable([LayerCost(name=layer.name, kind=layer.kind, forward_ms=1.0, backward_ms=2.0, backward_weight_ms=1.0)
                       for layer in graph.layers])
    cluster = ClusterSpec(num_devices=world_size, backend="gloo")
    results = {}
    for name, (torch_class, per_rank) in SCHEDULES.items():
        num_stages = world_size * per_rank
        blocks = [num_blocks * k // num_stages for k in range(num_stages + 1)]
        # our layer boundaries for the same block ranges (embed goes with block 0, norm/head/loss last)
        bounds = [0, *(layer_index[f"layers.{b}"] for b in blocks[1:-1]), len(graph.layers)]
        from octopipe import schedules

        plan = schedules.build(name, costs, cluster, num_microbatches, partition=bounds)
        stages = codegen(graph, plan, inputs, target, model=model)
        programs = lower(plan, links_of(stages), tied_parameters(stages, plan))
        verify(programs, plan, links_of(stages))
        engine = Engine(rank, world_size, stages_on(stages, plan, rank), programs[rank], num_microbatches)

        own = [s for s in range(num_stages) if plan.stages[s].device == rank]
        pipeline_stages = [pipelining.PipelineStage(Chunk(model, blocks[s], blocks[s + 1]), s, num_stages,
                                                    torch.device("cpu")) for s in own]
        schedule_class = getattr(pipelining, torch_class)
        if per_rank == 1:
            schedule = schedule_class(pipeline_stages[0], num_microbatches, loss_fn=models.lm_loss)
        else:
            schedule = schedule_class(pipeline_stages, num_microbatches, loss_fn=models.lm_loss)
        has_first, has_last = 0 in own, num_stages - 1 in own

        def run_torch(schedule=schedule, has_first=has_first, has_last=has_last) -> None:
            losses: list[torch.Tensor] = []
            args = inputs if has_first else ()
            if has_last:
                schedule.step(*args, target=target, losses=losses)
            else:
                schedule.step(*args)

        def run_ours(engine: Engine = engine) -> None:
            engine.step(inputs, target)

        ours, theirs = [], []
        for repetition in range(warmup + steps):
            a = _timed(run_ours, model)
            b = _timed(run_torch, model)
            if repetition >= warmup:
                ours.append(a)
                theirs.append(b)
        results[name] = (ours, theirs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    per_rank = launch(worker, 2, (args.size, args.batch_size, args.microbatches, args.steps, args.warmup), timeout_s=1800,
                      backend="gloo")
    print(f"llama-{args.size} ({SIZES[args.size]['num_layers']} blocks, hidden {SIZES[args.size]['hidden_size']}), "
          f"batch {args.batch_size}, {args.microbatches} microbatches, 2 ranks, gloo, CPU, 1 thread per rank; "
          f"median of {args.steps} steps after {args.warmup} warm-up (step = slowest rank)")
    print(f"{'schedule':<18} {'octopipe ms':>12} {'torch ms':>10} {'ours/torch':>11}")
    for name in SCHEDULES:
        ours = [max(r[name][0][k] for r in per_rank) for k in range(args.steps)]
        theirs = [max(r[name][1][k] for r in per_rank) for k in range(args.steps)]
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{name:<18} {a * 1e3:12.1f} {b * 1e3:10.1f} {a / b:11.3f}")


if __name__ == "__main__":
    main()
