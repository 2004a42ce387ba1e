"""Does the simulator predict real steps on a GPU? Predicted vs measured step time on one GPU.

The four heterogeneous reference models at their paper widths (hidden size, heads, experts, vocabulary)
but few layers, so each fits one GPU with its gradients: the costs come from `costs="profile"`
on that GPU (Triton's `do_bench` per layer: F, B and W), then several plans of one device (1F1B
with one stage; ZB-V and interleaved 1F1B with two stages on the device, and ZB-V's B/W split)
are compiled from that one profile, run by the runtime in one process, steps interleaved, and
timed with CUDA synchronization around each step. The predicted step time is
`pipe.simulation.iteration_ms` of each plan. A control: the 1F1B plan compiled twice and both
copies measured in the rotation; how far apart they measure is this machine's noise floor.
Run with and without bf16 autocast (the profile is then taken under autocast as well).

One GPU cannot check the cross-device parts of a prediction (messages, one device waiting for
another): that needs two GPUs. What it checks: the profile of single layers adds up to the
runtime's step, with the runtime's host work between ops and the per-stage bookkeeping.

`--hide-launches` (an experiment, CUDA only) profiles the layers a second time with each timed run
queued behind a spin kernel (`torch.cuda._sleep`) long enough for the host to enqueue the whole
run, so the events time the GPU's work alone, not kernel launches; it adds a column with that
profile's prediction. It tests one explanation, not proven, of multimodal's bf16 step predicted
26% slow: its small vision layers, timed alone, wait on their launches, which in a step overlap
other layers' GPU work.

    python benchmarks/gpu_one_device.py [--models llama,deepseek,nemotron-h,multimodal] [--steps 5]
    python benchmarks/gpu_one_device.py --device cpu --size tiny   # a dry run of the script on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Iterator

import torch

import octopipe
from octopipe import models

SHAPES = {  # paper widths, few layers: one GPU holds the model, its gradients and the activations
    "llama": dict(num_layers=4),
    "deepseek": dict(num_layers=4),
    "nemotron-h": dict(layer_pattern="M-M*-"),
    "multimodal": dict(num_layers=4, vision_num_layers=4, cross_attention_every=2),
}
SEQ_LEN = {"nemotron-h": 512}
"""Shorter sequences where the default's activations would not fit: the Mamba-2 mixer's quadratic
(matrix) form keeps [microbatch, 128 heads, seq, seq] tensors for backward."""
SCHEDULES = ("1f1b", "zb-v", "interleaved-1f1b")


def _clear(engine) -> None:
    for parameter in engine.parameters():
        parameter.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(pipes, inputs, target, device: torch.device, steps: int, warmup: int) -> list[float]:
    """Median step ms of each pipe, their steps interleaved (one of each in turn)."""
    engines = [pipe.engine(0, device=device) for pipe in pipes]
    times: list[list[float]] = [[] for _ in engines]
    for step in range(warmup + steps):
        for k, engine in enumerate(engines):
            _clear(engine)
            _sync(device)
            start = time.perf_counter()
            engine.step(inputs, target)
            _sync(device)
            if step >= warmup:
                times[k].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


SPIN_CYCLES = 20_000_000
"""The spin kernel before each timed run under --hide-launches: about 10 ms at 2 GHz, longer than
the host takes to enqueue one layer's F, B or W."""


@contextlib.contextmanager
def launches_hidden() -> Iterator[None]:
    """The profile's timer, for CUDA, timing each run behind a spin kernel (see --hide-launches)."""
    from octopipe.passes import profile

    def gpu_time(self, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for run in range(max(self.warmup, 1) + self.repeats):
            torch.cuda.synchronize(self.device)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            if run >= max(self.warmup, 1):
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    original = profile._Timer.__call__
    profile._Timer.__call__ = gpu_time
    try:
        yield
    finally:
        profile._Timer.__call__ = original


def run_model(name: str, args: argparse.Namespace, device: torch.device, autocast: str | None) -> list[float]:
    overrides = SHAPES[name] if args.size == "paper" else {}
    seq_len = min(args.seq_len, SEQ_LEN.get(name, args.seq_len)) if args.size == "paper" else args.seq_len
    torch.manual_seed(0)
    with torch.device(device):
        model = models.build(name, args.size, **overrides)
        inputs = models.example_inputs(name, args.size, batch_size=args.batch_size, seq_len=seq_len, **overrides)
        target = models.example_target(name, args.size, batch_size=args.batch_size, seq_len=seq_len, **overrides)
    common = dict(example_inputs=inputs, example_target=target, loss_fn=models.lm_loss, num_microbatches=args.microbatches,
                  num_devices=1, autocast=autocast, quiet=True)
    clock = time.perf_counter()
    first = octopipe.compile(model, "h100x8", costs="profile", schedule=SCHEDULES[0], **common)
    profile_s = time.perf_counter() - clock
    pipes = [first] + [octopipe.compile(model, "h100x8", costs=first.costs, schedule=s, **common) for s in SCHEDULES[1:]]
    pipes.append(octopipe.compile(model, "h100x8", costs=first.costs, schedule=SCHEDULES[0], **common))  # the control
    hidden = None
    if args.hide_launches:
        with launches_hidden():
            hidden = octopipe.compile(model, "h100x8", costs="profile", schedule=SCHEDULES[0], **common).costs
    measured = measure(pipes, inputs, target, device, args.steps, args.warmup)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    shapes = ", ".join(str(list(t.shape)) for t in inputs)
    print(f"\n{name} ({params:.2f} B parameters, {len(first.costs)} layers, inputs {shapes}, {args.microbatches} "
          f"microbatches, {autocast or 'fp32'}; profiled in {profile_s:.0f} s)")
    extra = f" {'GPU-only ms':>12} {'error':>8}" if hidden is not None else ""
    print(f"  {'plan':<18} {'stages':>6} {'predicted ms':>13} {'measured ms':>12} {'error':>8}{extra}")
    errors = []
    for label, pipe, ms in zip([*SCHEDULES, "1f1b (control)"], pipes, measured):
        predicted = pipe.simulation.iteration_ms
        error = (predicted - ms) / ms
        if label != "1f1b (control)":
            errors.append(abs(error))
        if hidden is not None:
            gpu_only = octopipe.simulate(pipe.plan, hidden, pipe.cluster).iteration_ms
            extra = f" {gpu_only:>12.2f} {(gpu_only - ms) / ms:>+8.1%}"
        print(f"  {label:<18} {pipe.plan.num_stages:>6} {predicted:>13.2f} {ms:>12.2f} {error:>+8.1%}{extra}")
    peak = f"; peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    print(f"  control pair measured {abs(measured[0] - measured[-1]) / measured[0]:.1%} apart{peak}")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--size", default="paper", choices=models.SIZES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--autocast", default="both", choices=("fp32", "bf16", "both"))
    parser.add_argument("--hide-launches", action="store_true",
                        help="also profile with each timed run behind a spin kernel (CUDA only; see above)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.hide_launches and device.type != "cuda":
        parser.error("--hide-launches times CUDA kernels: it needs --device cuda")
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as written; the profile runs the same way
    modes = {"fp32": [None], "bf16": ["bf16"], "both": [None, "bf16"]}[args.autocast]
    errors = []
    for autocast in modes:
        for name in args.models.split(","):
            errors += run_model(name, args, device, autocast)
            gc.collect()  # the pipes and engines of this model (reference cycles) before the next one
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    print(f"\nabsolute error over {len(errors)} plans: mean {statistics.mean(errors):.1%}, max {max(errors):.1%}")


if __name__ == "__main__":
    main()
