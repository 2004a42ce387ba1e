"""Measured runs for the demo and the benchmarks: train a compiled pipeline for a few steps on
local processes and time each step; calibrate the local gloo "cluster"; profile the layers the
way the runtime runs them (`runtime_profile`: inside pipelined steps, also within the rotation
of measured plans, `measure_with_profile`).

Consumes a `Pipeline` (octopipe.compile) and a batch; produces per-step wall times measured on
rank 0 between barriers (median reported), beside the simulator's prediction for the same plan.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from octopipe.cluster import ClusterSpec
from octopipe.simulator import StageCosts

Durations = dict[tuple[Any, ...], list[float]]
"""Instruction durations (ms) by key: (op kind, stage) for compute, (MESSAGE, producer stage,
consumer stage) for sends and receives."""

PROFILE_TRIM = 0.1
"""The share of each op's durations a runtime profile drops at either end before the mean. The
measured step is a median step, and single ops stall up to 5x on this VM (a page fault, another
process): in the fidelity benchmark's five full runs of stops 24-25, a 10%-trimmed profile
predicted with a lower mean error than the plain mean in all five and a lower max in four."""


@dataclass(frozen=True)
class StepTiming:
    step_ms: tuple[float, ...]
    losses: tuple[float, ...]
    busy_ms: tuple[float, ...] = ()
    """Per rank, where recorded (`measure_with_profiles(busy=True)`): the time its instructions ran
    in a step, compute and message posting (waits for a message not counted), median over the
    timed steps (as `median_ms`); the measured counterpart of `SimResult.device_busy_ms`. Empty
    where not recorded."""
    op_ms: tuple[dict[tuple[str, int, int], float], ...] = ()
    """Where recorded (as `busy_ms`), per timed step: every op's measured time, all ranks, keyed
    (op kind "F"/"B"/"W", stage, microbatch); an op's time is its compute plus the posting of the
    messages it sends, as the simulator counts them (`replayed_ms` re-simulates a step from them)."""
    loss_scales: tuple[float | None, ...] = ()
    """Per timed step, with fp16 loss scaling (fp16 autocast or fp16 weights): the scale after
    the step, and whether the step was skipped for an inf or nan gradient (`skipped`); None
    without loss scaling."""
    skipped: tuple[bool, ...] = ()
    """Per timed step: whether the engines dropped its gradients (`Engine.skipped_step`)."""
    evaluations: tuple[tuple[int, float], ...] = ()
    """With validation data (`octopipe.data.TrainingData`): (iterations done, validation loss)
    after each evaluation, outside the timed steps."""
    test_loss: float | None = None
    """With a test part (`TrainingData.test`): its loss after the last step, else None."""
    timelines: tuple[tuple[TimelineEntry, ...], ...] = ()
    """Where asked for (`measure_steps(trace=True)`): every rank's instructions in the last timed
    step, in rank order (`measured_trace` draws them)."""
    exit_reason: str | None = None
    """Where an `ExitCheck` ended the run before its last step: why (the steps run are
    `len(losses)`), else None."""
    activation_peak_bytes: tuple[int, ...] = ()
    """Where asked for (`measure_steps(measure_activations=True)`), per rank: the most activation
    bytes it held in any timed step (`Engine.activation_peak_bytes`), the measured counterpart of
    the simulation's `peak_activation_bytes` of its device."""
    grad_norms: tuple[float | None, ...] = ()
    """Per timed step, with `clip_grad`: the gradients' total norm before clipping
    (`Engine.clip_grad_norm_`), else None."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)


@dataclass(frozen=True)
class PairedSpeedup:
    """How much faster `ours` ran than `theirs`, step by step (steps interleaved in one launch)."""

    median: float
    """Median over steps of theirs / ours for the same round."""
    low: float
    high: float
    """The middle half of those per-step ratios (25th to 75th percentile; min and max below 4 steps)."""

    def __str__(self) -> str:
        return f"per-step pairs {self.median:.3f}x (middle half {self.low:.3f}x-{self.high:.3f}x)"


def paired_speedup(ours: StepTiming, theirs: StepTiming) -> PairedSpeedup:
    """theirs / ours per round of a `measure_many` run (round k of each ran back to back), so the
    machine's drift between rounds cancels; the spread says how far one round's noise moves it."""
    if not ours.step_ms or len(ours.step_ms) != len(theirs.step_ms):
        raise ValueError(f"paired_speedup: need the same number of steps (> 0) of both, got "
                         f"{len(ours.step_ms)} and {len(theirs.step_ms)}")
    ratios = sorted(t / o for o, t in zip(ours.step_ms, theirs.step_ms))
    if len(ratios) < 4:
        return PairedSpeedup(statistics.median(ratios), ratios[0], ratios[-1])
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return PairedSpeedup(statistics.median(ratios), low, high)


_OP_LETTER = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
"""A compute instruction's op kind in the plan (a fused backward is the plan's B)."""

TimelineEntry = tuple[str, "int | None", "int | None", "int | None", float, float]
"""One measured instruction: (kind, stage, microbatch, peer rank, start ms, end ms), the times
from its rank's start of the step (`Engine.timeline`'s, made plain)."""

PREDICTED_PID = 1000
"""`measured_trace`: the predicted step's devices are processes PREDICTED_PID + device."""


def timeline_entries(timeline: Sequence[tuple[Any, float, float]], origin: float) -> tuple[TimelineEntry, ...]:
    """An engine's recorded timeline (`Engine.timeline`: instruction, start s, end s) as plain
    entries in ms from `origin` (perf_counter seconds)."""
    return tuple((instruction.kind.value, instruction.stage, instruction.microbatch, instruction.peer,
                  (begin - origin) * 1e3, (end - origin) * 1e3) for instruction, begin, end in timeline)


def measured_trace(timelines: Sequence[Sequence[TimelineEntry]], predicted: Any = None) -> dict[str, Any]:
    """A Chrome / Perfetto trace of one measured step: a process per rank, its compute thread
    (F, B and W named as the plan names them, "<stage><kind><microbatch>", and its other
    instructions by kind) and its message thread (sends and receives, with the peer rank), in ms
    from the step's start on that rank. With `predicted` (the plan's SimResult), the predicted
    step beside it: a process "predicted device d" (pid PREDICTED_PID + d) per device."""
    events: list[dict[str, Any]] = []
    for rank, entries in enumerate(timelines):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} (measured)"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "messages"}})
        for kind, stage, microbatch, peer, start, end in entries:
            letter = _OP_LETTER.get(kind)
            message = kind.startswith(("send", "recv"))
            if letter is not None:
                name = f"{stage}{letter}{microbatch}"
            elif message:
                name = f"{kind} {stage}:{microbatch} {'to' if kind.startswith('send') else 'from'} rank {peer}"
            else:
                name = kind if stage is None else f"{kind} stage {stage}"
            events.append({"ph": "X", "pid": rank, "tid": 1 if message else 0, "name": name,
                           "cat": letter or ("comm" if message else kind), "ts": start * 1e3,
                           "dur": max(end - start, 0.0) * 1e3,
                           "args": {"stage": stage, "microbatch": microbatch, "peer": peer}})
    if predicted is not None:
        for event in predicted.chrome_trace()["traceEvents"]:
            event = dict(event, pid=PREDICTED_PID + event["pid"])
            if event["ph"] == "M" and event["name"] == "process_name":
                event["args"] = {"name": f"predicted {event['args']['name']}"}
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def replayed_ms(plan: Any, costs: Any, cluster: ClusterSpec, op_ms: dict[tuple[str, int, int], float]) -> float:
    """The simulated iteration time of `plan` with every op at its measured time of one step
    (`StepTiming.op_ms`) instead of its price in `costs`: the simulator's schedule, transfers and
    waits replayed on the real ops. Where it matches the measured step, the rest of a prediction's
    error is in the ops' times (their prices and their op-to-op jitter), not in what the simulator
    makes of them. An op not in `op_ms` keeps its price."""
    from octopipe.simulator import jitter_of, simulate

    priced = simulate(plan, costs, cluster, validated=True)
    ops = list(priced.op_end)
    # what the simulator adds to an op's compute (its messages' posting, the per-op overhead) stays
    fixed = simulate(plan, costs, cluster, validated=True, jitter=jitter_of(plan, dict.fromkeys(ops, 0.0)))
    factors = {}
    for op in ops:
        measured = op_ms.get((op.kind.value, op.stage, op.microbatch))
        constant = fixed.op_end[op] - fixed.op_start[op]
        scaled = priced.op_end[op] - priced.op_start[op] - constant
        if measured is not None and scaled > 0:
            factors[op] = max(0.0, measured - constant) / scaled
    return simulate(plan, costs, cluster, validated=True, jitter=jitter_of(plan, factors)).iteration_ms


OPTIMIZERS = ("sgd", "adamw")


def _check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def training_optimizer(name: str, params: Sequence[Any], learning_rate: float,
                       options: Mapping[str, Any] | None = None) -> Any:
    """The optimizer `octopipe train` and the measured runs step: "sgd" or "adamw", with torch's
    defaults but for `options` (`train`'s Megatron flags): `weight_decay`, which decays only the
    parameters of two or more dimensions (Megatron's rule: no decay on biases and norm weights;
    without it AdamW decays every parameter by torch's 0.01 and SGD none), `betas` and `eps`
    (AdamW), `momentum` (SGD). None for a rank without parameters (a plan may leave one idle)."""
    _check_optimizer(name)
    if not params:
        return None
    settings = dict(options or {})
    decay = settings.pop("weight_decay", None)
    groups: Any = params
    if decay is not None:
        groups = [group for group in ({"params": [p for p in params if p.ndim >= 2], "weight_decay": decay},
                                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0})
                  if group["params"]]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate, **settings)
    return torch.optim.AdamW(groups, lr=learning_rate, **settings)


def attached_optimizer(engine: Any, name: str, learning_rate: float, attach: bool = False,
                       options: Mapping[str, Any] | None = None) -> Any:
    """`training_optimizer` for an engine's parameters; with `shard_optimizer`, attached to the
    engine over its share (every copy of the rank must then step it: the step ends in a
    broadcast among them); with `master_weights`, attached over the fp32 copies (its hooks set
    their gradients and round the weights from them); with `attach`, attached in any case (so
    that the engine's checkpoints hold its state). None for a rank without parameters, unless
    attached."""
    if engine.shard_optimizer or engine.master_weights or attach:
        return engine.attach_optimizer(lambda params: training_optimizer(name, params, learning_rate, options))
    return training_optimizer(name, [p for _, p in engine.named_parameters()], learning_rate, options)


def resume_keeping_settings(engine: Any, optimizer: Any, path: str,
                            scheduled: bool = False) -> tuple[dict[str, Any], str | None]:
    """`engine.load_checkpoint(path)` (its `extra` returned), the optimizer then stepping with
    this run's settings (learning rate, weight decay, betas, eps, momentum), not the ones the
    checkpoint's param groups bring back (`Optimizer.load_state_dict` restores those), and a note
    naming those that differ and whether the parameters were grouped otherwise, None where
    nothing did: a flag given to a resumed run is not dropped. Every rank calls it (the note is
    agreed over all of them: a sharded optimizer's ranks hold different parameters).
    `scheduled`: a schedule sets the learning rate before every update, so it is left out."""
    import torch.distributed as dist

    built = [{key: value for key, value in group.items() if key != "params"}
             for group in (optimizer.param_groups if optimizer is not None else [])]
    extra = engine.load_checkpoint(path)
    kept = [key for key in SETTINGS if not (scheduled and key == "lr")]
    if optimizer is not None:
        for group, settings in zip(optimizer.param_groups, built):
            group.update({key: value for key, value in settings.items() if key in kept})
    load = getattr(engine, "optimizer_load", None)
    local = (bool(load is not None and load.regrouped),
             [(key, pair) for key, pairs in (load.differences if load is not None else ()) if key in kept
              for pair in pairs])
    everyone = [local]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    regrouped = any(flag for flag, _ in everyone)
    changed: dict[str, tuple[list[Any], list[Any]]] = {}
    for _, pairs in everyone:
        for key, (saved, own) in pairs:
            olds, news = changed.setdefault(key, ([], []))
            olds.extend([saved] if saved not in olds else [])
            news.extend([own] if own not in news else [])
    grouping = ("the run that saved it grouped the parameters otherwise (--weight-decay makes two groups: decay "
                "and none), so every parameter's optimizer state was loaded by its name" if regrouped else "")
    if not changed:
        return extra, f"--resume {path}: {grouping}" if grouping else None

    def listed(which: int) -> str:
        return ", ".join(f"{key} {' and '.join(map(str, values[which]))}" for key, values in changed.items())

    return extra, (f"--resume {path}: its optimizer stepped with {listed(0)}; this run steps with {listed(1)} (its "
                   "flags; give the saved run's to go on as it did)" + (f"; {grouping}" if grouping else ""))


def loop_state(iteration: int, data: Any = None, steps: int = 0) -> dict[str, Any]:
    """What a training loop's checkpoint keeps beside the engine's state (`save_checkpoint(extra=...)`):
    the iterations done, and with token data (`octopipe.data.TrainingData`) the sequences consumed
    after `steps` steps of this run and the data's order."""
    return {"iteration": iteration, **(data.saved(steps) if data is not None else {})}


SETTINGS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov")
"""The optimizer settings a resumed run takes from its own flags (`resume_keeping_settings`)."""


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's learning-rate schedule (`--lr-warmup-iters`, `--lr-decay-style`,
    `--lr-decay-iters`, `--min-lr`) as a function of the iterations done before an update: a
    linear warm-up from 0 to `lr` over `warmup` iterations, then a `style` decay ("constant",
    "linear" or "cosine") to `min_lr` at `decay_iters`, and `min_lr` after. The update after `k`
    iterations takes `self(k)` (Megatron's first, with a warm-up, takes 0)."""

    lr: float
    warmup: int = 0
    style: str = "constant"
    decay_iters: int | None = None
    min_lr: float = 0.0

    def __call__(self, done: int) -> float:
        if self.warmup > 0 and done <= self.warmup:
            return self.lr * done / self.warmup
        if self.style == "constant" or self.decay_iters is None:
            return self.lr
        if done > self.decay_iters:
            return self.min_lr
        ratio = (done - self.warmup) / (self.decay_iters - self.warmup)
        coefficient = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coefficient * (self.lr - self.min_lr)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """Every param group of `optimizer` (None: a rank without one) at `lr`."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


def saves_after(done: int, steps: int, every: int | None) -> bool:
    """Whether `train --save` writes the checkpoint after `done` of its `steps` steps: after the
    last, and with `--save-interval` = `every` after every `every`-th."""
    return done == steps or bool(every) and done % every == 0  # type: ignore[operator]


@dataclass
class ExitCheck:
    """Megatron's ways to end a run early, asked after every step (`reason(iteration done)`):
    `interval` (--exit-interval: after an iteration divisible by it), `minutes`
    (--exit-duration-in-mins: once that long has passed since `start`) and `on_signal`
    (--exit-signal-handler: once a SIGTERM has arrived, as a scheduler sends before it ends a
    job). The time and the signal are agreed on by every rank (an all-reduce of both after each
    step, where either is asked for), so every rank stops after the same step. Picklable until
    `start`, which the rank that trains calls (it installs the signal handler there)."""

    interval: int | None = None
    minutes: float | None = None
    on_signal: bool = False
    started: float = 0.0
    signalled: bool = False

    def start(self) -> ExitCheck:
        """Start the clock and (`on_signal`) catch SIGTERM in this process from now on (one that
        reached a forked local rank before this is counted: `passing_sigterm`)."""
        import signal

        self.started = time.monotonic()
        if self.on_signal:
            signal.signal(signal.SIGTERM, self._received)
            self.signalled = self.signalled or _EARLY_SIGTERM[0]
        return self

    def _received(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def reason(self, done: int, device: Any = None) -> str | None:
        """Why the run stops after iteration `done` (a collective where `minutes` or `on_signal`
        is set: every rank calls it after every step), else None."""
        import torch.distributed as dist

        timed_out = self.minutes is not None and time.monotonic() - self.started > 60.0 * self.minutes
        signalled = self.signalled
        if (self.minutes is not None or self.on_signal) and dist.is_available() and dist.is_initialized():
            flags = torch.tensor([float(timed_out), float(signalled)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            timed_out, signalled = bool(flags[0].item()), bool(flags[1].item())
        if signalled:
            return "a SIGTERM arrived (--exit-signal-handler)"
        if timed_out:
            return f"{self.minutes:g} minutes have passed (--exit-duration-in-mins)"
        if self.interval and done % self.interval == 0:
            return f"iteration {done} is a multiple of --exit-interval {self.interval}"
        return None


def save_path(save: str, steps_done: int) -> str:
    """Where `train --save` writes after `steps_done` steps: `save` with `{step}` replaced by that
    count (a file per save), or `save` itself."""
    return save.replace("{step}", str(steps_done))


def _train_worker(rank: int, world_size: int, pipes: Sequence[Any], inputs: tuple, target: Any, steps: int,
                  warmup: int, learning_rate: float, probes: Sequence[bool] = (), rewarm: bool = False,
                  optimizer: str = "sgd", clip_grad: float | None = None, link: bool = False,
                  update_in_warmup: bool = True, init: Any = None, loss_scaler: Mapping[str, Any] | None = None,
                  resume: str | None = None, save: str | None = None, save_every: int | None = None,
                  save_sharded: bool = False, save_background: bool = False, first_step: int = 0,
                  lr_schedule: LRSchedule | None = None, data: Any = None,
                  optimizer_options: Mapping[str, Any] | None = None, trace: bool = False,
                  exit_check: ExitCheck | None = None, measure_activations: bool = False
                  ) -> tuple[list[StepTiming], list[Durations], list[list[float]]]:
    import torch.distributed as dist

    from octopipe.runtime.amp import LossScaler

    if exit_check is not None:  # (before anything slow: a SIGTERM from now on stops the run after a step)
        exit_check.start()
    torch.manual_seed(0)
    engines = [pipe.engine(rank, init=init, loss_scaler=LossScaler(**loss_scaler) if loss_scaler else None)
               for pipe in pipes]
    optimizers = [attached_optimizer(e, optimizer, learning_rate, attach=bool(resume or save),
                                     options=optimizer_options) if learning_rate
                  else None for e in engines]
    if save_background:  # (its writer process started now, beside the first steps, not at the first save)
        for engine in engines:
            engine.start_checkpoint_writer()
    if measure_activations:
        for engine in engines:
            engine.measure_activations()
    held: list[int] = [0 for _ in pipes]
    if resume:  # the whole state: weights, optimizer, fp32 copies, loss scale, dropout streams
        for engine, optimizer_ in zip(engines, optimizers):
            note = resume_keeping_settings(engine, optimizer_, resume, scheduled=lr_schedule is not None)[1]
            if note and rank == 0:
                print(f"note: {note}", file=sys.stderr, flush=True)
    times: list[list[float]] = [[] for _ in pipes]
    losses: list[list[float]] = [[] for _ in pipes]
    scales: list[list[float | None]] = [[] for _ in pipes]
    skipped: list[list[bool]] = [[] for _ in pipes]
    norms: list[list[float | None]] = [[] for _ in pipes]
    evaluations: list[list[tuple[int, float]]] = [[] for _ in pipes]
    traced: list[tuple[TimelineEntry, ...]] = [() for _ in pipes]
    busy: list[list[float]] = [[] for _ in pipes]
    op_spans: list[list[dict[tuple[str, int, int], float]]] = [[] for _ in pipes]
    durations: list[Durations] = [{} for _ in pipes]
    link &= world_size > 1  # one process has no link to measure
    link_rounds: list[list[float]] = []
    link_buffers = _link_buffers(LINK_SIZES) if link else []

    def after_step(engine: Any, optimizer: Any, update: bool = True, done: int = 0) -> float | None:
        norm = None
        if update and clip_grad is not None:
            norm = engine.clip_grad_norm_(clip_grad)  # collective: every rank, with or without parameters
        if update and optimizer is not None:
            if lr_schedule is not None:  # (`done`: the iterations before this update)
                set_learning_rate(optimizer, lr_schedule(done))
            optimizer.step()
        engine.zero_grad()  # (the weights', the master copies' and fp32_grads' gradients)
        return norm

    # a warm-up without an update leaves no trace: the buffers it ran through (batch statistics),
    # the stages' dropout streams and the loss scale are put back as they were before it
    before = [copy.deepcopy(engine.state_dict()) for engine in engines] if warmup and not update_in_warmup else []
    exit_reason = None
    for step in range(warmup + steps):
        if before and step == warmup:
            for engine, state in zip(engines, before):
                engine.load_state_dict(state)
        # alternate the pipelines step by step, so drift in machine load hits them alike
        for index, (engine, optimizer) in enumerate(zip(engines, optimizers)):
            if data is not None:  # each step its own batch (the warm-up the first step's), each replica its share
                inputs, target = data.batch(max(step - warmup, 0), engine.replicas.replica)
            probe = index < len(probes) and probes[index] and step >= warmup
            record = trace and step == warmup + steps - 1  # (the last timed step)
            if rewarm:
                engine.step(inputs, target)
                after_step(engine, optimizer)
            engine.timeline = [] if probe or record else None
            dist.barrier()
            start = time.perf_counter()
            loss = engine.step(inputs, target)
            if record:
                traced[index] = timeline_entries(engine.timeline or [], start)
            dist.barrier()
            elapsed = (time.perf_counter() - start) * 1e3
            done = first_step + step - warmup + 1  # (the iteration, counted on from a resumed checkpoint's)
            norm = after_step(engine, optimizer, update=update_in_warmup or step >= warmup, done=max(done - 1, 0))
            if save and step >= warmup and saves_after(done, first_step + steps, save_every):
                # (collective; outside the timed span)
                engine.save_checkpoint(save_path(save, done), sharded=save_sharded, background=save_background,
                                       extra=loop_state(done, data, step - warmup + 1))
            if data is not None and step >= warmup and data.evaluates_after(done, first_step + steps):
                evaluations[index].append((done, data.evaluate(engine)))  # (collective; outside the timed span)
            if step >= warmup:
                times[index].append(elapsed)
                losses[index].append(float(loss))
                scales[index].append(engine.loss_scaler.scale if engine.loss_scaler is not None else None)
                skipped[index].append(engine.skipped_step)
                norms[index].append(norm)
                if measure_activations:
                    held[index] = max(held[index], engine.activation_peak_bytes)
            if record and not probe:
                engine.timeline = None
            if probe:
                busy[index].append(0.0)
                spans: dict[tuple[str, int, int], float] = {}
                last = None
                for instruction, begin, end in engine.timeline:
                    if instruction.is_compute:
                        key = (instruction.kind.value, instruction.stage)
                        last = (_OP_LETTER[instruction.kind.value], instruction.stage, instruction.microbatch)
                        spans[last] = (end - begin) * 1e3
                    elif instruction.is_send or instruction.is_recv:
                        key = (MESSAGE, *sorted((instruction.stage, instruction.peer_stage)))  # producer, consumer
                        if instruction.is_send and last is not None:
                            spans[last] += (end - begin) * 1e3  # its output's posting, part of the op as simulated
                    else:
                        continue
                    durations[index].setdefault(key, []).append((end - begin) * 1e3)
                    busy[index][-1] += (end - begin) * 1e3
                op_spans[index].append(spans)
                engine.timeline = None
        if link and step >= warmup:  # the link in the same minutes as the steps, between rounds
            link_rounds.append(_pingpong(rank, link_buffers, LINK_REPEATS))
        done = first_step + step - warmup + 1
        if exit_check is not None and step >= warmup and step + 1 < warmup + steps:
            exit_reason = exit_check.reason(done)  # (collective where it asks the time or a signal)
            if exit_reason is not None:
                if save and not saves_after(done, first_step + steps, save_every):  # (unless this step's save did)
                    for engine in engines:  # (the checkpoint to resume from)
                        engine.save_checkpoint(save_path(save, done), sharded=save_sharded,
                                               background=save_background,
                                               extra=loop_state(done, data, step - warmup + 1))
                break
    # the test part after the last step (collective; not where the run stopped early)
    tests = [data.evaluate(engine, data.test, data.test_batches)
             if data is not None and data.test_batches and exit_reason is None else None for engine in engines]
    for engine in engines:  # (a background save's index: collective)
        engine.finish_checkpoint()
    return [StepTiming(tuple(t), tuple(values), (statistics.median(b),) if b else (), tuple(o), tuple(sc), tuple(sk),
                       tuple(ev), test, (tr,) if trace else (), exit_reason, (peak,) if measure_activations else (),
                       tuple(gn))
            for t, values, b, o, sc, sk, ev, test, tr, peak, gn in zip(times, losses, busy, op_spans, scales, skipped,
                                                                       evaluations, tests, traced, held, norms)
            ], durations, link_rounds


def measure_steps(pipe: Any, inputs: Sequence[Any], target: Any, *, steps: int = 5, warmup: int = 2,
                  learning_rate: float = 0.0, timeout_s: float = 600.0, optimizer: str = "sgd",
                  clip_grad: float | None = None, update_in_warmup: bool = True, init: Any = None,
                  loss_scaler: Mapping[str, Any] | None = None, resume: str | None = None,
                  save: str | None = None, save_every: int | None = None, save_sharded: bool = False,
                  save_background: bool = False, first_step: int = 0,
                  lr_schedule: LRSchedule | None = None, data: Any = None,
                  optimizer_options: Mapping[str, Any] | None = None, trace: bool = False,
                  exit_check: ExitCheck | None = None, measure_activations: bool = False) -> StepTiming:
    """Run `warmup + steps` training steps of `pipe` on `pipe.world_size` local processes; the
    step times of rank 0 (each step between two barriers). With a `learning_rate`, each step
    ends with `optimizer` ("sgd" or "adamw"), after clipping the gradients' total norm to
    `clip_grad` across ranks (`Engine.clip_grad_norm_`) when given. `update_in_warmup=False`:
    the warm-up steps run forward and backward only (the gradients are dropped) and leave no trace
    (buffers, dropout streams and loss scale are restored after them), so the model takes exactly
    `steps` updates and the steps draw what they would without the warm-up. `init`: every engine's
    (`Engine(init=...)`: a checkpoint's weights, and with master weights its fp32 copies).
    `loss_scaler`: fp16 loss scaling's options (`LossScaler(**loss_scaler)`; default its own).
    `resume`: a checkpoint `save` wrote (`Engine.load_checkpoint`: the whole state, the
    optimizer's too), loaded before the first step; `save`: where to write the engines'
    checkpoint after the last (`Engine.save_checkpoint`), and with `save_every` = N after every
    N-th timed step too (each write replaces the file, atomically; a `{step}` in `save` is
    replaced by the steps done, for a file per save: `save_path`); `save_sharded`: each save a
    directory where every rank writes its own shard (`Engine.save_checkpoint(sharded=True)`),
    with `save_background` by a writer process beside the next steps (finished before returning).
    `first_step`: the iterations done before this run (a resumed checkpoint's `iteration`), from
    which the saves count on: `{step}`, `save_every` and the `iteration` each save keeps.
    `lr_schedule`: each update's learning rate, of the iterations before it (`LRSchedule`).
    `data`: an `octopipe.data.TrainingData`: each step trains on its iteration's batch of token
    data (each replica its share; the warm-up on the first step's) instead of `inputs` and
    `target`, and its validation set is evaluated where it says (the timing's `evaluations`).
    `optimizer_options`: `training_optimizer`'s (weight decay, betas, eps, momentum). `trace`:
    record every rank's instructions in the last timed step (the timing's `timelines`).
    `exit_check`: stop after the step it says to (`ExitCheck`; then, with `save`, the checkpoint
    is written there, and the timing's `exit_reason` says why); with `on_signal`, a SIGTERM to
    this process is passed on to the ranks while they run. `measure_activations`: every rank
    measures the activation bytes it holds (the timing's `activation_peak_bytes`)."""
    return _measure([pipe], (), inputs, target, steps, warmup, learning_rate, timeout_s, False, optimizer,
                    clip_grad, update_in_warmup=update_in_warmup, init=init, loss_scaler=loss_scaler,
                    resume=resume, save=save, save_every=save_every, save_sharded=save_sharded,
                    save_background=save_background, first_step=first_step, lr_schedule=lr_schedule,
                    data=data, optimizer_options=optimizer_options, trace=trace, exit_check=exit_check,
                    measure_activations=measure_activations)[0][0]


def measure_many(pipes: Sequence[Any], inputs: Sequence[Any], target: Any, *, steps: int = 5, warmup: int = 2,
                 learning_rate: float = 0.0, timeout_s: float = 600.0, rewarm: bool = False) -> list[StepTiming]:
    """Like `measure_steps` for several pipelines of the same world size in one launch, their
    steps interleaved (A B A B ...): the fair way to compare them on a noisy machine.

    `rewarm`: each timed step of a pipeline right after an untimed one of its own (A A B B ...),
    so it runs on hot memory, as a training job's steps do. On a VM whose host reclaims memory a
    process left untouched for a second or two (this project's CPU machine), a pipeline's turn
    otherwise starts by faulting its pages back in, at about 20 us per 4 KiB page: up to 0.8 s in
    one op, on random steps."""
    return _measure(pipes, (), inputs, target, steps, warmup, learning_rate, timeout_s, rewarm)[0]


def measure_with_profile(pipes: Sequence[Any], probe: RuntimeProbe, inputs: Sequence[Any], target: Any, *,
                         steps: int = 5, warmup: int = 2, op_overhead_ms: float = 0.0,
                         timeout_s: float = 600.0, rewarm: bool = False) -> tuple[list[StepTiming], RuntimeProfile]:
    """`measure_many` with the runtime profile's pipeline (`runtime_probe`) run as one more
    pipeline in the same rotation: the step timings of `pipes`, and the profile measured in those
    same minutes. Predictions from it are free of the drift of this machine's speed between a
    profile taken earlier and the measured run. `rewarm`: see `measure_many`."""
    timings, (profile,) = measure_with_profiles(pipes, probe, inputs, target, steps=steps, warmup=warmup,
                                                op_overhead_ms=op_overhead_ms, timeout_s=timeout_s, rewarm=rewarm)
    return timings, profile


def measure_with_profiles(pipes: Sequence[Any], probe: RuntimeProbe, inputs: Sequence[Any], target: Any, *,
                          trims: Sequence[float] = (PROFILE_TRIM,), steps: int = 5, warmup: int = 2, op_overhead_ms: float = 0.0,
                          timeout_s: float = 600.0, rewarm: bool = False, busy: bool = False
                          ) -> tuple[list[StepTiming], list[RuntimeProfile]]:
    """`measure_with_profile` with one profile per `trims` entry (`RuntimeProbe.profile`'s
    `trim`), all from the same measured durations. `busy`: also time the instructions of `pipes`
    (each timing's `busy_ms`), to tell an error in the ops' prices from one in the waits."""
    extra = len(probe.pipes)
    timings, durations, link = _measure(list(pipes) + list(probe.pipes), [busy] * len(pipes) + [True] * extra,
                                        inputs, target, steps, warmup, 0.0, timeout_s, rewarm, link=True)
    runs = probe.runs(durations)
    steps = timings[len(pipes)]  # the probe's own pipeline, the first of its pipes
    return timings[:-extra], [probe.profile(runs, op_overhead_ms, trim=trim, link=link, steps=steps) for trim in trims]


def _measure(pipes: Sequence[Any], probes: Sequence[bool], inputs: Sequence[Any], target: Any, steps: int,
             warmup: int, learning_rate: float, timeout_s: float, rewarm: bool = False, optimizer: str = "sgd",
             clip_grad: float | None = None, link: bool = False, update_in_warmup: bool = True, init: Any = None,
             loss_scaler: Mapping[str, Any] | None = None, resume: str | None = None, save: str | None = None,
             save_every: int | None = None, save_sharded: bool = False, save_background: bool = False,
             first_step: int = 0, lr_schedule: LRSchedule | None = None, data: Any = None,
             optimizer_options: Mapping[str, Any] | None = None, trace: bool = False,
             exit_check: ExitCheck | None = None, measure_activations: bool = False
             ) -> tuple[list[StepTiming], list[list[Durations]], list[float] | None]:
    """Rank 0's step timings, every rank's durations, and with `link` the one-way times of the
    LINK_SIZES messages, ping-ponged after each timed round (the least of the rounds' medians;
    None without `link` or with one process)."""
    from octopipe.runtime import launch

    sizes = {pipe.world_size for pipe in pipes}
    if len(sizes) != 1:
        raise ValueError(f"measure_many: pipelines need one world size, got {sorted(sizes)}")
    _check_optimizer(optimizer)  # here, before the workers start, not in each of them
    with passing_sigterm(exit_check is not None and exit_check.on_signal):
        results = launch(_train_worker, sizes.pop(), args=(tuple(pipes), tuple(inputs), target, steps, warmup,
                                                            learning_rate, tuple(probes), rewarm, optimizer, clip_grad,
                                                            link, update_in_warmup, init, loss_scaler, resume, save,
                                                            save_every, save_sharded, save_background, first_step,
                                                            lr_schedule, data, optimizer_options, trace, exit_check,
                                                            measure_activations),
                         timeout_s=timeout_s, backend="gloo")  # CPU processes, also where GPUs are
    rounds = results[0][2]
    # rank 0's step times, with every rank's busy time and op times where recorded
    timings = [replace(timing, busy_ms=tuple(busy for rank in results for busy in rank[0][index].busy_ms),
                       timelines=tuple(line for rank in results for line in rank[0][index].timelines),
                       activation_peak_bytes=tuple(peak for rank in results
                                                   for peak in rank[0][index].activation_peak_bytes),
                       op_ms=tuple({key: ms for rank in results for key, ms in rank[0][index].op_ms[step].items()}
                                   for step in range(len(timing.op_ms))))
               for index, timing in enumerate(results[0][0])]
    return timings, [durations for _, durations, _ in results], _least(rounds) if rounds else None


_EARLY_SIGTERM = [False]
"""Whether a SIGTERM reached this (forked local rank) process before its `ExitCheck.start`."""

_SIGTERM_PASSED = [False]
"""Whether this process passed a SIGTERM on to its ranks (`passing_sigterm`): it is winding down."""


def pass_sigterm_to_ranks() -> None:
    """From now on in this process, a SIGTERM is passed on to the local ranks (`passing_sigterm`
    for the rest of the process: a CLI run that asked for it before its ranks start)."""
    import signal

    signal.signal(signal.SIGTERM, _pass_on)


def _pass_on(signum: int, frame: Any) -> None:
    import multiprocessing
    import os
    import signal

    if multiprocessing.parent_process() is not None:  # a forked rank before its ExitCheck: it will see this
        _EARLY_SIGTERM[0] = True
        return
    _SIGTERM_PASSED[0] = True
    _EARLY_SIGTERM[0] = True  # (ranks not forked yet inherit it: they stop after their first step)
    for child in multiprocessing.active_children():
        if child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)


@contextlib.contextmanager
def passing_sigterm(on: bool) -> Iterator[None]:
    """While on: a SIGTERM to this process is sent on to its child processes (the local ranks,
    whose `ExitCheck` stops them after their step), not taken by this one. Once one has come, the
    process was asked to end and is winding down: further ones stay ignored after the block too."""
    import signal

    if not on:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _pass_on)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN if _SIGTERM_PASSED[0] else previous)


LINK_SIZES = (4, 4 * 2**20)
"""The ping-pong's message sizes (bytes): the small one gives the latency, the large one the
bandwidth (`_link`)."""
LINK_REPEATS = 5
"""Ping-pongs per size in each round of a measured rotation (`RuntimeProfile.latency_s`)."""


def _pingpong_worker(rank: int, world_size: int, sizes: Sequence[int], repeats: int, rounds: int = 1
                     ) -> list[float]:
    """One-way time of each message size: the median of `repeats` ping-pongs, in each of
    `rounds` rounds (sizes alternating), and the least of the round medians."""
    buffers = _link_buffers(sizes)
    return _least(_pingpong(rank, buffers, repeats) for _ in range(rounds))


def _least(rounds: Iterable[Sequence[float]]) -> list[float]:
    """Per message size, the least of the rounds' one-way times (a round now and then lands on a
    moment this VM is busy elsewhere)."""
    return [min(values) for values in zip(*rounds)]


def _link_buffers(sizes: Sequence[int]) -> list[torch.Tensor]:
    return [torch.zeros(size // 4, dtype=torch.float32) for size in sizes]


def _pingpong(rank: int, buffers: Sequence[torch.Tensor], repeats: int) -> list[float]:
    """Per buffer, the median one-way time (s) of `repeats` ping-pongs between ranks 0 and 1
    (other ranks only join the barriers)."""
    import torch.distributed as dist

    result = []
    for buffer in buffers:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            samples.append((time.perf_counter() - start) / 2)
        result.append(statistics.median(samples))
    return result


def _link(one_way: Sequence[float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) from the one-way times of the LINK_SIZES messages."""
    latency = max(one_way[0], 1e-6)
    return latency, LINK_SIZES[1] / max(one_way[1] - latency, 1e-9)


def calibrate_cpu_cluster(num_devices: int, base: ClusterSpec | None = None) -> ClusterSpec:
    """The local gloo 'cluster' with latency and bandwidth measured by a ping-pong between two
    processes (one small and one 4 MB message; the least median of 3 rounds, as a round now and
    then lands on a moment this VM is busy elsewhere: one such round measured 3.2 ms where 0.1 ms
    is usual) and the runtime's per-op overhead measured by
    running a model of tiny layers as 1 stage and as one stage per layer on one process. The host
    time of a message depends on the model's activation sizes: `RuntimeProfile.calibrate` sets it
    from the profiled steps."""
    from octopipe.runtime import launch

    latency, bandwidth = _link(launch(_pingpong_worker, 2, args=(LINK_SIZES, 20, 3), backend="gloo")[0])
    base = base or ClusterSpec.preset("cpu", num_devices=num_devices)
    return replace(base, num_devices=num_devices, latency_s=latency, intra_node_bandwidth=bandwidth,
                   inter_node_bandwidth=bandwidth, message_copy_bandwidth=bandwidth, op_overhead_ms=measure_op_overhead_ms(),
                   name=f"cpux{num_devices}-measured")


class _TinyLayers(torch.nn.Module):
    def __init__(self, num_layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def measure_op_overhead_ms(num_layers: int = 16, num_microbatches: int = 8, repeats: int = 7) -> float:
    """Runtime cost per compute op beyond the layer's own work: the step time of layers so small
    their compute is negligible, run as one stage per layer minus run as one stage, per extra op."""
    import octopipe
    from octopipe.ir.plan import B, F, PipelinePlan

    torch.manual_seed(0)
    model = _TinyLayers(num_layers, 8)
    x, y = torch.randn(num_microbatches, 8), torch.randn(num_microbatches, 8)
    cluster = ClusterSpec.preset("cpu", num_devices=1)
    graph_layers = num_layers + 1  # the blocks and the loss
    pipes = []
    for stages in (1, graph_layers):
        bounds = [graph_layers * k // stages for k in range(stages + 1)]
        ops = []
        for mb in range(num_microbatches):
            ops += [F(s, mb) for s in range(stages)] + [B(s, mb) for s in reversed(range(stages))]
        plan = PipelinePlan.build(num_microbatches, bounds, [0] * stages, [ops], num_devices=1)
        pipes.append(octopipe.compile(model, cluster, example_inputs=(x,), example_target=y, loss_fn=_mse,
                                      num_microbatches=num_microbatches, plan=plan,
                                      costs=_zero_costs(graph_layers)))
    one, many = measure_many(pipes, (x,), y, steps=repeats, warmup=2)
    extra_ops = 2 * num_microbatches * (graph_layers - 1)
    return max(0.0, (many.median_ms - one.median_ms) / extra_ops)


def _zero_costs(num_layers: int):
    from octopipe.ir.costs import CostTable, LayerCost

    return CostTable([LayerCost(f"l{i}", forward_ms=0.0, backward_ms=0.0) for i in range(num_layers)])


SPREAD_MIN_MS = 1.0
"""Ops shorter than this stay out of a profile's `spread`: their relative jitter (a 0.05 ms
embedding lookup stalling to 0.3 ms) says nothing about a stage op of tens of milliseconds."""

MESSAGE = "message"
"""The durations key under which a probe's sends and receives are recorded: (MESSAGE, producer
stage, consumer stage)."""


@dataclass(frozen=True)
class RuntimeProfile:
    """What the runtime profile measured inside pipelined steps."""

    costs: Any
    """Per-layer F, B and W (CostTable; bytes from `profile_costs`)."""
    message_overhead_ms: float | None
    """Mean host time of one send or receive instruction in those steps, with real activation
    sizes and both processes busy (None when the probe exchanged no message)."""
    message_bytes: float | None = None
    """Mean size of those messages (None: not known)."""
    latency_s: float | None = None
    bandwidth: float | None = None
    """The link between the processes (s, bytes/s), ping-ponged between the rounds of the same
    rotation (`LINK_SIZES`; the least of the rounds' medians); None: not measured."""
    spread: tuple[float, ...] = ()
    """Op-to-op jitter: every timed compute op of at least SPREAD_MIN_MS, its duration over its
    (layer, kind)'s price (the trimmed mean), pooled over layers and kinds, sorted; for
    `simulator.jittered_iterations`."""
    plan: Any = None
    steps: StepTiming | None = None
    """The probe's plan and its timed steps, every op's time recorded (None: not kept): the host
    time of a step outside its ops, what `calibrate` sets `step_overhead_ms` to."""

    def calibrate(self, cluster: ClusterSpec) -> ClusterSpec:
        """`cluster` with this profile's link, per-message host time and host time of a step outside
        its ops (`step_overhead_ms`: the median over the probe's steps of measured minus replayed
        with their ops' measured times, `replayed_ms`) (each unchanged when not measured). The link replaces the latency and both bandwidths, and the host-copy bandwidth
        where `cluster` has one (gloo on CPU): a profile's minutes, not an earlier calibration's,
        price a message (this VM's ping-pong bandwidth moved 1.8-4.9 GB/s between launches, and
        a plan sending 12 MB logits across moved 12% with it). A send instruction's time includes
        the sender's copy of the bytes, which the simulator charges separately where
        `cluster.message_copy_bandwidth` is set: that copy, half the instructions' share, comes out
        of the posting time."""
        if self.latency_s is not None and self.bandwidth is not None:
            cluster = replace(cluster, latency_s=self.latency_s, intra_node_bandwidth=self.bandwidth,
                              inter_node_bandwidth=self.bandwidth,
                              message_copy_bandwidth=self.bandwidth if cluster.message_copy_bandwidth else 0.0)
        if self.message_overhead_ms is not None:
            overhead = self.message_overhead_ms
            if cluster.message_copy_bandwidth and self.message_bytes:
                overhead = max(0.0, overhead - self.message_bytes / cluster.message_copy_bandwidth * 1e3 / 2)
            cluster = replace(cluster, message_overhead_ms=overhead)
        if self.plan is not None and self.steps is not None and self.steps.op_ms:
            # each probe step against the simulator's replay of it with its ops' measured times:
            # what is left is host time outside the ops, once a step
            bare = replace(cluster, step_overhead_ms=0.0)
            outside = [step - replayed_ms(self.plan, self.costs, bare, ops)
                       for step, ops in zip(self.steps.step_ms, self.steps.op_ms)]
            cluster = replace(cluster, step_overhead_ms=min(max(0.0, statistics.median(outside)), 9999.0))
        return cluster


@dataclass(frozen=True)
class RuntimeProbe:
    """The runtime profile's pipeline (see `runtime_probe`) and the layer sizes it fills in."""

    pipe: Any
    sizes: Any

    fused: Any = None
    """The same layers and groups run with 1F1B's order: each B a full backward (B and W in one
    op), timed for `LayerCost.backward_full_ms` (None: not measured)."""
    no_grad: Any = None
    """`fused` with every stage recomputing its activations: its F runs without autograd, timed
    for `LayerCost.forward_no_grad_ms` (None: not measured)."""

    @property
    def pipes(self) -> tuple[Any, ...]:
        return tuple(pipe for pipe in (self.pipe, self.fused, self.no_grad) if pipe is not None)

    def runs(self, durations: Sequence[Sequence[Durations]]) -> list[Durations]:
        """Every rank's durations of `pipes` (the last len(pipes) of each rank's list) for
        `profile`: the no-grad pipeline's forwards under their own key, the rest of it (its B
        runs the forward again) left out."""
        result = []
        for rank in durations:
            for pipe, run in zip(self.pipes, rank[-len(self.pipes):]):
                if pipe is self.no_grad:
                    run = {("forward_no_grad", key[1]): values for key, values in run.items() if key[0] == "forward"}
                result.append(run)
        return result

    def run(self, inputs: Sequence[Any], target: Any, *, steps: int = 3, warmup: int = 1, op_overhead_ms: float = 0.0,
            timeout_s: float = 600.0, rewarm: bool = True) -> RuntimeProfile:
        """Run `pipes` alone on this batch for `warmup + steps` steps each, alternating: their profile
        (with the link ping-ponged between rounds). `rewarm` (see `measure_many`): each timed step
        right after an untimed one of the same pipe."""
        timings, durations, link = _measure(self.pipes, [True] * len(self.pipes), inputs, target, steps, warmup, 0.0,
                                            timeout_s, rewarm, link=True)
        return self.profile(self.runs(durations), op_overhead_ms, link=link, steps=timings[0])

    def profile(self, durations: Sequence[Durations], op_overhead_ms: float = 0.0, *, trim: float = PROFILE_TRIM,
                link: Sequence[float] | None = None, steps: StepTiming | None = None) -> RuntimeProfile:
        """The profile from the instructions' durations (ms) each rank recorded running `pipes`
        (one dict per rank and pipe, in any order): per layer and op kind, the mean over
        microbatches and steps minus `op_overhead_ms` (the simulator adds that per op); per
        message, the mean time of its send and receive instructions. `trim`: the share of each
        op's durations dropped at either end before the mean (PROFILE_TRIM; 0: the plain mean,
        which the fidelity benchmark compares). `link`: one-way times (s) of the LINK_SIZES messages measured
        beside them, for the profile's latency and bandwidth. `steps`: the timed steps of `pipe` (with
        its ops' times), for the host time of a step outside its ops (`RuntimeProfile.calibrate`)."""
        if not 0 <= trim < 0.5:
            raise ValueError(f"RuntimeProbe.profile: trim must be in [0, 0.5), got {trim!r}")
        merged: Durations = {}
        for run in durations:
            for key, values in run.items():
                merged.setdefault(key, []).extend(values)

        price: dict[tuple[Any, ...], float] = {}  # each op's (trimmed) mean duration
        for key, values in merged.items():
            if key[0] != MESSAGE:
                cut = int(len(values) * trim)
                price[key] = statistics.fmean(sorted(values)[cut:len(values) - cut] if cut else values)

        def time_of(kind: str, stage: int) -> float:
            return max(0.0, price[(kind, stage)] - op_overhead_ms) if (kind, stage) in price else 0.0

        spread = tuple(sorted(value / price[key] for key, values in merged.items()
                              if price.get(key, 0.0) >= SPREAD_MIN_MS for value in values))

        # times measured inside real steps already hold what accumulating the gradients took (and
        # the probe never ran a selective stage): the quick profile's estimates of those go, so
        # nothing re-costs or prices them on top
        costs = replace(self.sizes.replace_layers(
            replace(layer, forward_ms=time_of("forward", i),
                    backward_ms=time_of("backward_input", i) + time_of("backward_weight", i),
                    backward_weight_ms=time_of("backward_weight", i),
                    backward_full_ms=time_of("backward", i) if ("backward", i) in price else None,
                    accumulate_ms=None, accumulate_weight_ms=None,
                    selective_activation_bytes=None, selective_recompute_ms=None,
                    forward_no_grad_ms=time_of("forward_no_grad", i) if ("forward_no_grad", i) in price else None)
            for i, layer in enumerate(self.sizes.layers)
        ), num_microbatches=None)
        latency, bandwidth = _link(link) if link else (None, None)
        messages = {key[1:]: values for key, values in merged.items() if key[0] == MESSAGE}
        message_ms = message_bytes = None
        if messages:
            stages = StageCosts.of(tuple(range(len(self.sizes) + 1)), self.sizes)  # the probe: a stage per layer
            size_of = {(a, a + 1): size for a, size in enumerate(stages.output)}
            size_of.update({(a, c): size for a, c, size in stages.skips})
            count = sum(len(values) for values in messages.values())
            message_ms = sum(sum(values) for values in messages.values()) / count
            message_bytes = sum(size_of.get(pair, 0.0) * len(values) for pair, values in messages.items()) / count
        return RuntimeProfile(costs, message_ms, message_bytes, latency, bandwidth, spread,
                              self.pipe.plan if steps is not None else None, steps)


def runtime_probe(model: Any, inputs: Sequence[Any], target: Any, loss_fn: Any, num_microbatches: int, *,
                  num_procs: int = 2, schedule: str = "zb-h1", fused: bool = True, autocast: Any = None) -> RuntimeProbe:
    """The pipelines the runtime profile times: one stage per layer, the layers split into
    `num_procs` contiguous groups of about equal load (from a quick `profile_costs`, which also
    gives the bytes), one group per process, run with `schedule`'s op order (each of its ops
    expanded into the group's per-layer ops: F in layer order, B and W in reverse) and, with
    `fused`, also with 1F1B's order, whose backward ops compute B and W together, once as it is and
    once with every stage recomputing (its forwards run without autograd). `autocast`: compile's
    (None, "bf16" or "fp16"), so that the layers are timed as the plans will run them."""
    import octopipe
    from octopipe import schedules
    from octopipe.ir.plan import Op, OpKind, PipelinePlan
    from octopipe.passes.codegen import microbatch
    from octopipe.passes.profile import profile_costs

    graph = octopipe.trace(model, tuple(inputs), loss_fn=loss_fn, example_target=target)
    micro = microbatch(tuple(inputs), num_microbatches)
    micro_target = microbatch((target,), num_microbatches)[0]
    sizes = profile_costs(graph, micro, example_target=micro_target, repeats=1, warmup=1, autocast=autocast)
    layers = len(sizes)
    groups = min(num_procs, layers)
    bounds = schedules.balanced_boundaries([layer.forward_ms + layer.backward_ms for layer in sizes], groups)
    members = [range(bounds[g], bounds[g + 1]) for g in range(groups)]
    placement = [group for group in range(groups) for _ in members[group]]

    def compiled(order_of: str, recompute: bool = False) -> Any:
        device_ops = []
        for order in schedules.device_orders(order_of, groups, num_microbatches):
            expanded: list[Op] = []
            for op in order:
                layer_order = members[op.stage] if op.kind is OpKind.F else reversed(members[op.stage])
                expanded += [Op(layer, op.kind, op.microbatch) for layer in layer_order]
            device_ops.append(expanded)
        plan = PipelinePlan.build(num_microbatches, list(range(layers + 1)), placement, device_ops, num_devices=groups,
                                  recompute=[recompute] * layers)
        return octopipe.compile(model, ClusterSpec.preset("cpu", num_devices=groups), example_inputs=tuple(inputs),
                                example_target=target, loss_fn=loss_fn, num_microbatches=num_microbatches, plan=plan,
                                costs=sizes, quiet=True, autocast=autocast)

    return RuntimeProbe(compiled(schedule), sizes, compiled("1f1b") if fused else None,
                        compiled("1f1b", recompute=True) if fused else None)


def runtime_profile(model: Any, inputs: Sequence[Any], target: Any, loss_fn: Any, num_microbatches: int, *,
                    num_procs: int = 2, steps: int = 3, warmup: int = 1, op_overhead_ms: float = 0.0,
                    schedule: str = "zb-h1", timeout_s: float = 600.0, rewarm: bool = True) -> RuntimeProfile:
    """Per-layer F, B, W and full-backward times and the per-message host time measured by the
    runtime itself, inside real pipelined steps (`runtime_probe(...).run(...)`: its pipelines run
    alone for `warmup + steps` steps each, alternating; build the probe yourself to run it again
    later beside measured plans, `measure_with_profile`).

    Every op is thus timed on the code path and under the conditions of a pipeline step: stage
    modules, split linears, several microbatches' activations alive, the other processes running
    other ops of the same step at the same time (a forward here beside a backward there loads the
    shared caches and memory bandwidth differently than two forwards side by side), and the gloo
    threads; waiting for a message is not counted (see `Engine.timeline`). Each layer's time is
    a 10%-trimmed mean over microbatches and steps (`PROFILE_TRIM`; not the median: the first
    microbatches of a step run slower, and a step's time is the sum of all of them; not the plain
    mean, which a stalled op carries). A full backward measures 0-7% below the
    same layer's B plus deferred W on this machine, so both are kept. This is the CPU profile the
    demo and the benchmarks use: on this machine the layer-in-a-loop profile of `profile_costs`
    runs 1.3-1.5x faster than the same layers inside a step, and a one-rank loop of every layer
    about 1.25x faster in the forward. `rewarm` (default on): each timed step right after an
    untimed one of the same pipe (see `measure_many`); without it, the first step of a pipe's
    turn faulted cold memory back in, and one such op (a 16 MB logits gradient, say) could inflate
    a layer's mean 3-4x."""
    probe = runtime_probe(model, inputs, target, loss_fn, num_microbatches, num_procs=num_procs, schedule=schedule)
    return probe.run(inputs, target, steps=steps, warmup=warmup, op_overhead_ms=op_overhead_ms, timeout_s=timeout_s,
                     rewarm=rewarm)
