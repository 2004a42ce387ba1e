"""`octopipe demo`: the whole product on this machine in under three minutes.

Takes a built-in heterogeneous model (DeepSeek-style: dense layers, then MoE layers whose
experts make them several times heavier, and a large-vocabulary head), profiles its layers on
this CPU inside the runtime with both processes busy (`octopipe.bench.profile_in_runtime`), plans it for a local "cluster" of 2 gloo processes (link measured by a ping-pong),
prints the report (OctoPipe vs every baseline, predicted), then trains a few steps with the
OctoPipe plan and with the best baseline — steps interleaved so machine noise hits both alike —
and prints measured step times beside the predictions, the measured speedup, and where the
timeline pictures are.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

DEMO_MODEL = "deepseek"
DEMO_CONFIG = dict(hidden_size=192, num_layers=6, num_dense_layers=2, num_experts=4, top_k=2, num_shared_experts=1,
                   expert_hidden_size=256, intermediate_size=512, vocab_size=6144, num_heads=4, num_kv_heads=2,
                   head_dim=48, max_seq_len=128)
QUICK_CONFIG = dict(DEMO_CONFIG, hidden_size=96, vocab_size=2048, expert_hidden_size=128, intermediate_size=256,
                    head_dim=24, max_seq_len=64)
BATCH_SIZE = 16
NUM_MICROBATCHES = 8
NUM_DEVICES = 2


def run_demo(out_dir: str | Path = "octopipe-demo", steps: int = 4, time_limit_s: float = 20.0, quick: bool = False,
             say=print) -> dict:
    import octopipe
    from octopipe import models, schedules
    from octopipe.bench import calibrate_cpu_cluster, measure_many, profile_in_runtime
    from octopipe.viz import draw_comparison

    started = time.perf_counter()
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = QUICK_CONFIG if quick else DEMO_CONFIG
    torch.manual_seed(0)
    model = models.build(DEMO_MODEL, "tiny", **overrides)
    inputs = models.example_inputs(DEMO_MODEL, "tiny", batch_size=BATCH_SIZE, **overrides)
    target = models.example_target(DEMO_MODEL, "tiny", batch_size=BATCH_SIZE, **overrides)
    params = sum(p.numel() for p in model.parameters())
    say(f"model: DeepSeek-style, {overrides['num_dense_layers']} dense + "
        f"{overrides['num_layers'] - overrides['num_dense_layers']} MoE layers, vocabulary {overrides['vocab_size']}, "
        f"{params / 1e6:.1f}M parameters; batch {BATCH_SIZE} x {overrides['max_seq_len']} tokens in "
        f"{NUM_MICROBATCHES} microbatches; {NUM_DEVICES} CPU processes (gloo)")

    cluster = calibrate_cpu_cluster(NUM_DEVICES)
    say(f"link: {cluster.latency_s * 1e6:.0f} us latency, {cluster.intra_node_bandwidth / 1e9:.2f} GB/s (measured)")
    costs = profile_in_runtime(model, inputs, target, models.lm_loss, NUM_MICROBATCHES, num_procs=NUM_DEVICES,
                               op_overhead_ms=cluster.op_overhead_ms)
    say(f"profiled {len(costs)} layers in the runtime under load: " + ", ".join(f"{layer.name} {layer.forward_ms + layer.backward_ms:.1f}" for layer in costs)
        + " (F+B ms per microbatch)")

    result = octopipe.plan(costs, cluster, NUM_MICROBATCHES, time_limit_s=time_limit_s, quiet=True)
    say("")
    say(str(result.report))
    best_name = result.report.best_baseline.name
    family, partition = best_name.split("/")
    baseline_plan = schedules.build(family, costs, cluster, NUM_MICROBATCHES, partition=partition)

    def compiled(plan):
        return octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=models.lm_loss,
                                num_microbatches=NUM_MICROBATCHES, costs=costs, plan=plan, quiet=True)

    ours, theirs = compiled(result.plan), compiled(baseline_plan)
    say(f"\ntraining {steps} steps of each plan (interleaved, after one warm-up step) ...")
    timing_ours, timing_theirs = measure_many([ours, theirs], inputs, target, steps=steps, warmup=1)
    rows = [("octopipe", ours, timing_ours), (best_name, theirs, timing_theirs)]
    say(f"{'plan':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>7}   losses")
    for name, pipe, timing in rows:
        predicted = pipe.simulation.iteration_ms
        error = timing.median_ms / predicted - 1
        losses = " ".join(f"{x:.4f}" for x in timing.losses)
        say(f"{name:<24} {predicted:>12.1f} {timing.median_ms:>12.1f} {error:>+7.1%}   {losses}")
    measured = timing_theirs.median_ms / timing_ours.median_ms
    predicted = theirs.simulation.iteration_ms / ours.simulation.iteration_ms
    say(f"speedup over {best_name}: measured {measured:.3f}x, predicted {predicted:.3f}x")
    picture = out / "timelines.png"
    draw_comparison({"octopipe": ours.simulation, best_name: theirs.simulation}, picture,
                    title="predicted timelines (profiled costs)")
    ours.save(out / "octopipe-plan.txt")
    theirs.save(out / f"{family}-{partition}-plan.txt")
    (out / "report.txt").write_text(str(result.report) + "\n")
    say(f"timeline pictures: {picture}; plans and report in {out}/ ({time.perf_counter() - started:.0f} s in all)")
    return {"measured_speedup": measured, "predicted_speedup": predicted, "best_baseline": best_name,
            "ours_ms": timing_ours.median_ms, "baseline_ms": timing_theirs.median_ms,
            "ours_predicted_ms": ours.simulation.iteration_ms, "baseline_predicted_ms": theirs.simulation.iteration_ms}
