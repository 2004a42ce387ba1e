"""Does the simulator predict real runs? Predicted vs measured step time of several models and
plans on 2 CPU processes (gloo), with costs from `profile` on this machine.

For each model (the CPU configs of benchmarks/cpu_models.py): calibrate the link and the per-op
host overhead (`calibrate_cpu_cluster`), profile the layers and the host time of a message inside
a pipelined step of the runtime (`octopipe.bench.runtime_profile`, each timed step after an untimed
one, as below), build several plans from that
profile (1F1B, ZB-H1, ZB-V, interleaved 1F1B, 1F1B with every stage recomputing its activations,
and OctoPipe's own), then measure them all in one launch,
steps interleaved, with the profiling pipeline itself run as one more pipeline in the same
rotation (`measure_with_profile`), each timed step right after an untimed one of the same
pipeline (`rewarm`: this VM's host reclaims memory a process leaves untouched for a second or
two, and faulting it back costs up to 0.8 s in one op). The predicted step time is `octopipe.simulate` of each plan
with the profile that rotation measured: this machine's speed drifts by 10-40% between launches
minutes apart, so a profile taken earlier predicts the machine of then, not of the run. The
"earlier" column keeps the prediction from the planning profile for comparison.
Prints each error and the mean and max absolute error (target: mean <= 5%, max <= 10%), and the
relative error: each plan's measured time over the model's 1F1B run divided by the same ratio
predicted. A control: the 1F1B plan is compiled twice and both copies run in the rotation; how
far apart the two identical pipelines measure ("noise floor") is what this machine alone adds
to an error in that run. Also printed: the errors had the rotation's profile priced each op at the
plain mean of its durations instead of the 10%-trimmed mean (`PROFILE_TRIM`, the default since
stop 25); and, per plan, where its error comes from: `ops`, the time its instructions ran (compute and message
posting, all ranks, per step) against the simulated busy time (the profile's prices of its
ops), and `idle ms`, the predicted against the measured idle time per rank (the waits, the
simulator's schedule and transfers). `jittered`: the error had each op's time been its price
times a ratio drawn from the rotation's own op-to-op spread (`RuntimeProfile.spread`, median
of JITTER_SAMPLES simulations, `simulator.jittered_iterations`): what that jitter alone adds to
a schedule's waits. `replay`: the error had the simulator run each measured step with every op
at its measured time in that step (`bench.replayed_ms`; median over the steps of measured /
replayed): what is left once the ops' times are right is the simulator's own model of the
schedule, the transfers and the waits.

    python benchmarks/fidelity.py [--models ...] [--steps 6]
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
from octopipe.bench import (  # noqa: E402
    PROFILE_TRIM,
    calibrate_cpu_cluster,
    measure_with_profiles,
    replayed_ms,
    runtime_probe,
)
from octopipe.simulator import jittered_iterations  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")
JITTER_SAMPLES = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=10.0, help="planner seconds per model")
    parser.add_argument("--no-rewarm", action="store_true",
                        help="time each pipeline's first step of its turn (memory it left cold, see bench.measure_many)")
    parser.add_argument("--microbatches", type=int, default=NUM_MICROBATCHES,
                        help="microbatches of each model's batch (a divisor of it)")
    args = parser.parse_args()
    num_microbatches = args.microbatches
    torch.set_num_threads(1)
    calibrated = calibrate_cpu_cluster(2)
    print(f"2 CPU processes (gloo, 1 thread each); link {calibrated.latency_s * 1e6:.0f} us, "
          f"{calibrated.intra_node_bandwidth / 1e9:.2f} GB/s measured; {num_microbatches} microbatches")
    print(f"{'model':<11} {'plan':<26} {'predicted ms':>12} {'measured ms':>12} {'error':>8} {'relative':>9} "
          f"{'earlier ms':>10} {'error':>8} {'ops':>7} {'idle ms':>13} {'jittered':>8} {'replay':>7}")
    errors = []
    relative_errors = []
    earlier_errors = []
    plain_errors = []
    jitter_errors = []
    replay_errors = []
    op_errors = []
    floors = []
    for name in args.models.split(","):
        model, inputs, target = build(name)
        probe = runtime_probe(model, inputs, target, models.lm_loss, num_microbatches)
        profile = probe.run(inputs, target, op_overhead_ms=calibrated.op_overhead_ms, rewarm=not args.no_rewarm)
        costs, cluster = profile.costs, profile.calibrate(calibrated)
        plans = {}
        for schedule in SCHEDULES:
            plans[f"{schedule}/balanced"] = octopipe.schedules.build(schedule, costs, cluster, num_microbatches,
                                                                      partition="balanced")
        one = plans["1f1b/balanced"]
        plans["1f1b/balanced, recompute"] = one.with_recompute([True] * one.num_stages)  # B runs F again
        plans["octopipe"] = octopipe.plan(costs, cluster, num_microbatches, time_limit_s=args.time_limit,
                                          quiet=True).plan
        pipes = [octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                                  num_microbatches=num_microbatches, costs=costs, plan=plan)
                 for plan in [*plans.values(), plans["1f1b/balanced"]]]
        timings, (now, plain) = measure_with_profiles(pipes, probe, inputs, target, trims=(PROFILE_TRIM, 0.0),
                                                        steps=args.steps, warmup=1, op_overhead_ms=cluster.op_overhead_ms,
                                                        rewarm=not args.no_rewarm, busy=True)
        control = timings.pop()
        pipes.pop()
        floors.append(abs(control.median_ms / timings[0].median_ms - 1))
        measured_cluster, plain_cluster = now.calibrate(cluster), plain.calibrate(cluster)  # (each replays the probe's steps)
        simulated = [octopipe.simulate(plan, now.costs, measured_cluster) for plan in plans.values()]
        predictions = [sim.iteration_ms for sim in simulated]
        plain_errors += [abs(timing.median_ms / octopipe.simulate(plan, plain.costs, plain_cluster).iteration_ms - 1)
                         for plan, timing in zip(plans.values(), timings)]
        reference_predicted, reference_measured = predictions[0], timings[0].median_ms
        for (label, _), pipe, timing, sim in zip(plans.items(), pipes, timings, simulated):
            predicted = sim.iteration_ms
            error = timing.median_ms / predicted - 1
            # where the error comes from: the ops' prices (measured instruction time against the
            # simulated busy time, all ranks) or the waits between them (idle per rank)
            ops = sum(timing.busy_ms) / sum(sim.device_busy_ms) - 1
            op_errors.append(abs(ops))
            idle_predicted = statistics.mean(sim.device_idle_ms)
            idle_measured = statistics.mean(timing.median_ms - busy for busy in timing.busy_ms)
            # the same prediction with each op's time drawn from the rotation's op-to-op spread
            jittered = statistics.median(jittered_iterations(sim.plan, now.costs, sim.cluster, now.spread,
                                                             samples=JITTER_SAMPLES))
            jitter_errors.append(abs(timing.median_ms / jittered - 1))
            # each step re-simulated with its own ops' measured times
            replay = statistics.median(step / replayed_ms(sim.plan, now.costs, sim.cluster, ops)
                                       for step, ops in zip(timing.step_ms, timing.op_ms)) - 1
            replay_errors.append(abs(replay))
            errors.append(abs(error))
            relative = (timing.median_ms / reference_measured) / (predicted / reference_predicted) - 1
            if pipe is not pipes[0]:
                relative_errors.append(abs(relative))
            earlier = pipe.simulation.iteration_ms
            earlier_errors.append(abs(timing.median_ms / earlier - 1))
            print(f"{name:<11} {label:<26} {predicted:>12.1f} {timing.median_ms:>12.1f} {error:>+8.1%} {relative:>+9.1%} "
                  f"{earlier:>10.1f} {timing.median_ms / earlier - 1:>+8.1%} {ops:>+7.1%} "
                  f"{idle_predicted:>6.1f}>{idle_measured:<6.1f} {timing.median_ms / jittered - 1:>+8.1%} {replay:>+7.1%}")
        print(f"{name:<11} {'1f1b/balanced, 2nd copy':<26} {'':>12} {control.median_ms:>12.1f} "
              f"{'':>8} {control.median_ms / timings[0].median_ms - 1:>+9.1%}  (noise floor: the same plan again)")
    print(f"\nmean |error| {statistics.mean(errors):.1%}, max |error| {max(errors):.1%} over {len(errors)} runs "
          f"(target: mean <= 5%, max <= 10%)")
    print(f"predicted from the planning profile taken before the run instead: mean |error| "
          f"{statistics.mean(earlier_errors):.1%}, max {max(earlier_errors):.1%}")
    print(f"predicted from the same rotation's profile with each op's time the plain mean instead of a "
          f"{PROFILE_TRIM:.0%}-trimmed one: mean |error| {statistics.mean(plain_errors):.1%}, max "
          f"{max(plain_errors):.1%}")
    print(f"predicted with op-to-op jitter (each op's time its price x a ratio drawn from the rotation's measured "
          f"durations / their op's price, median of {JITTER_SAMPLES} simulations; column 'jittered'): mean |error| "
          f"{statistics.mean(jitter_errors):.1%}, max {max(jitter_errors):.1%}")
    print(f"replayed: each measured step simulated with every op at its measured time in that step (column "
          f"'replay', median over the steps of measured / replayed): mean |error| {statistics.mean(replay_errors):.1%}, "
          f"max {max(replay_errors):.1%}: the simulator's schedule, transfers and waits, once the ops' times are right")
    print(f"the ops' measured time (compute and message posting, all ranks) against the simulated busy time: mean "
          f"|error| {statistics.mean(op_errors):.1%}, max {max(op_errors):.1%} (column 'ops'; 'idle ms' = predicted > "
          f"measured idle per rank: the waits)")
    print(f"noise floor: the same 1F1B plan run twice in one rotation measured {statistics.mean(floors):.1%} apart on "
          f"average, at most {max(floors):.1%} ({', '.join(f'{f:.1%}' for f in floors)})")
    print(f"relative to the same model's {SCHEDULES[0]}/balanced in the same run (machine speed drift cancels): mean |error| "
          f"{statistics.mean(relative_errors):.1%}, max {max(relative_errors):.1%} over {len(relative_errors)} runs")


if __name__ == "__main__":
    main()
