"""Does the simulator predict the activation memory real runs hold? Per device, the simulation's
peak activation bytes against what the ranks measured (`Engine.measure_activations`) on 2 CPU
processes (gloo), for several models and plans.

For each model (the CPU configs of benchmarks/cpu_models.py, 8 microbatches of 2 sequences):
profile the layers on this machine (`costs="profile"`: each layer's activation bytes are what
autograd saves in its forward, by saved-tensor hooks), then compile plans on that table (GPipe,
1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipe-V, 1F1B with every stage recomputing, OctoPipe's
own) and run each for 2 steps with the meter on. The meter counts per storage what each rank
really holds for its backward passes: saved tensors, the stage inputs kept from F to B, the
outputs until sent, and what a split B leaves for its W (see `octopipe/runtime/meter.py`). The
simulator counts the same (see `octopipe/simulator.py`): each layer's saved bytes and what its
split B leaves its W, both profiled, and each F's outputs until sent. Memory, unlike time, does
not depend on this machine's speed, but the profiled times (so the balanced partitions and
OctoPipe's plans) vary a little from run to run.

Prints, per plan and device, the predicted and measured MiB and the error, then the mean and max
absolute error over all devices; and what the device held with the stages' outputs kept until
their B, as the engine did before it released them once sent (`Engine(release_outputs=False)`).
`--analytic` also prices the same plans with the analytic costs (`costs="analytic"`, which count
floats at the run's size, 4 bytes here) to show how far the formulas are from what the run holds.

    python benchmarks/memory_fidelity.py [--models ...] [--analytic]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_models import CONFIGS, NUM_MICROBATCHES, build  # noqa: E402

import octopipe  # noqa: E402
from octopipe import models  # noqa: E402
from octopipe.runtime import launch  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")


def _peaks(rank: int, world_size: int, pipes: tuple, inputs: tuple, target: torch.Tensor) -> list[tuple[int, int]]:
    """Per pipeline, this rank's peak with its outputs released once sent (the engine's default)
    and held until B."""
    peaks = []
    for pipe in pipes:
        both = []
        for release in (True, False):
            torch.manual_seed(0)
            engine = pipe.engine(rank, timeout_s=120, release_outputs=release)
            engine.measure_activations()
            held = 0
            for _ in range(2):
                engine.step(inputs, target)
                engine.zero_grad()
                held = max(held, engine.activation_peak_bytes or 0)
            both.append(held)
        peaks.append((both[0], both[1]))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--analytic", action="store_true", help="also the analytic costs' predictions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cluster = octopipe.ClusterSpec.preset("cpux2")
    errors: list[float] = []
    analytic_ratios: list[float] = []
    saved: list[float] = []
    print(f"{'model':<11} {'plan':<18} {'device':>6} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7} "
          f"{'held to B MiB':>14}" + (f" {'analytic MiB':>13}" if args.analytic else ""))
    for name in args.models:
        model, inputs, target = build(name)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)

        def compiled(model=model, inputs=inputs, target=target, **options):
            return octopipe.compile(model, cluster, example_inputs=inputs, example_target=target,
                                    loss_fn=models.lm_loss, num_microbatches=NUM_MICROBATCHES, quiet=True, **options)

        costs = compiled(schedule="1f1b", costs="profile").costs
        pipes = {schedule: compiled(schedule=schedule, costs=costs) for schedule in SCHEDULES}
        recomputing = pipes["1f1b"].plan.with_recompute([True] * pipes["1f1b"].plan.num_stages)
        pipes["1f1b recompute"] = compiled(plan=recomputing, costs=costs)
        pipes["octopipe"] = compiled(costs=costs, time_limit_s=20)
        measured = launch(_peaks, 2, (tuple(pipes.values()), inputs, target), timeout_s=900)
        for index, (label, pipe) in enumerate(pipes.items()):
            analytic = compiled(plan=pipe.plan).simulation.peak_activation_bytes if args.analytic else ()
            for device, predicted in enumerate(pipe.simulation.peak_activation_bytes):
                held, kept = measured[device][index]
                error = (predicted - held) / held
                errors.append(abs(error))
                saved.append(1 - held / kept)
                line = (f"{name:<11} {label:<18} {device:>6} {predicted / 2**20:>14.3f} {held / 2**20:>13.3f} "
                        f"{error:>+7.1%} {kept / 2**20:>14.3f}")
                if args.analytic:
                    analytic_ratios.append(held / analytic[device])
                    line += f" {analytic[device] / 2**20:>13.3f}"
                print(line, flush=True)
    print(f"\nprofiled costs: mean absolute error {statistics.mean(errors):.1%}, max {max(errors):.1%} "
          f"({len(errors)} devices)")
    print(f"released outputs: the peak {statistics.mean(saved):.1%} lower on average, at most {max(saved):.1%}, "
          f"than with outputs held until B")
    if analytic_ratios:
        print(f"analytic costs: measured / predicted {min(analytic_ratios):.2f}-{max(analytic_ratios):.2f} "
              f"(median {statistics.median(analytic_ratios):.2f})")


if __name__ == "__main__":
    main()
