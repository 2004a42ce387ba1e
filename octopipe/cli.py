"""`octopipe` command line: demo | plan | simulate | show | train | dump.

Exit codes scripts can rely on: 0 success; 1 an OctoPipe error (bad input, untraceable model);
2 usage error; 3 infeasible (no plan meets the memory limit); 4 invalid plan or programs;
5 execution error (a worker failed or timed out). Errors print one `octopipe: error: ...` block
on stderr, never a traceback (set OCTOPIPE_DEBUG=1 for one).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE, EXIT_INVALID_PLAN, EXIT_EXECUTION = 0, 1, 2, 3, 4, 5


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    from octopipe.errors import ExecutionError, InfeasibleError, OctopipeError, PlanError, VerificationError

    stdout = sys.stdout
    sys.stdout = _ClosedPipeSafe(stdout)
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        _resolve_defaults(args)
        return args.run(args) or EXIT_OK
    except InfeasibleError as exc:
        return _fail(exc, EXIT_INFEASIBLE)
    except (PlanError, VerificationError) as exc:
        return _fail(exc, EXIT_INVALID_PLAN)
    except ExecutionError as exc:
        return _fail(exc, EXIT_EXECUTION)
    except OctopipeError as exc:
        return _fail(exc, EXIT_ERROR)
    except KeyboardInterrupt:
        print("octopipe: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout
        warnings.showwarning = shown


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    """OctoPipe's own warnings as `warning: ...` lines on stderr (not Python's file:line form)."""
    from octopipe.errors import OctopipeWarning

    if issubclass(category, OctopipeWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        print(warnings.formatwarning(message, category, filename, lineno, line), end="", file=sys.stderr)


class _ClosedPipeSafe:
    """stdout that outlives its reader: once the reader stops early (`octopipe plan -o p.json |
    head`), the rest of the output goes nowhere instead of failing, so the command still does
    its work (writes its files) and ends with its own exit code; the interpreter does not fail
    again when it flushes stdout at exit."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _closed(self) -> None:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):  # no descriptor to redirect (a captured stream): drop it all
            self._stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _bounded(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: `convert` the text and keep it when `ok`, else a usage error saying it
    must be `what` (NaN fails every comparison, so it is refused too)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


_positive_int = _bounded(int, lambda value: value >= 1, "a positive integer")
_positive_float = _bounded(float, lambda value: 0 < value < math.inf, "a positive number")
_non_negative_int = _bounded(int, lambda value: value >= 0, "a non-negative integer")
_non_negative_float = _bounded(float, lambda value: 0 <= value < math.inf, "a non-negative number")
_effort = _bounded(float, lambda value: 0 < value < 2**80, "a positive number below 2**80 (a factor on the work)")
_percent = _bounded(float, lambda value: 0 <= value < 100, "a percentage in [0, 100) (2 = 2%)")
_seed = _bounded(int, lambda value: 0 <= value < 2**63, "a non-negative integer")


def _activation_limit_arg(text: str) -> float | str | None:
    """GiB per device, '1f1b' (the 1F1B baselines' busiest device) or 'none'."""
    word = text.strip().lower()
    if word in ("1f1b", "none"):
        return None if word == "none" else word
    try:
        return _positive_float(word)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be GiB per device (a positive number), 1f1b or none, got {text!r}") from None


def _replicas_arg(text: str) -> int | str:
    """A replica count, or 'auto' (plan every count, keep the fastest step)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a replica count (a positive integer) or auto, got {text!r}") from None


def _split_arg(text: str) -> tuple[float, ...]:
    """--split's weights: training, validation and optionally test (Megatron's 949,50,1)."""
    try:
        weights = tuple(float(part) for part in text.replace("/", ",").split(","))
    except ValueError:
        weights = ()
    if len(weights) not in (2, 3) or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights[:2]) <= 0:
        raise argparse.ArgumentTypeError(f"must be 2 or 3 non-negative weights, training,validation[,test], not all "
                                         f"zero (e.g. 98,2 or 949,50,1), got {text!r}")
    return weights


def _resolve_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on other arguments: the microbatch count of a given plan, and a batch
    size that divides into the microbatches. Notes which model options were given, so options
    that would be ignored (a built-in model's with --costs or a factory) are refused."""
    args.model_options = [flag for flag, key in (("--size", "size"), ("--set", "set"), ("--batch-size", "batch_size"),
                                                 ("--seq-len", "seq_len")) if getattr(args, key, None)]
    if getattr(args, "size", "unset") is None:
        args.size = "tiny"
    if args.command in ("simulate", "show"):
        return  # the microbatches (and so the batch size) are each plan file's own, set in _plan_inputs
    plan_file = getattr(args, "plan", None)
    saved = saved_replicas = saved_size = None
    if plan_file and Path(plan_file).exists():  # (a missing one is reported where it is used)
        from octopipe.api import load_saved_plan

        context = load_saved_plan(plan_file)
        saved = context.plan
        saved_replicas = context.cluster.data_parallel if context.cluster is not None else None
        saved_size = context.microbatch_size
    if args.command == "dump" and saved is not None and not args.devices and args.cluster is None:
        args.devices = saved.num_devices  # the plan's devices on the default cluster, as train and simulate take them
    if args.command == "train" and args.data_parallel is None:  # the plan's own replica count, else one
        args.data_parallel = saved_replicas or 1
    if saved is not None and getattr(args, "devices", None) and args.devices != saved.num_devices:
        from octopipe.errors import OctopipeError

        raise OctopipeError(f"--devices {args.devices}: {plan_file} runs on {saved.num_devices} devices (drop the option)")
    if args.command == "train" and (args.global_batch_size is not None or args.micro_batch_size is not None):
        _megatron_batch(args)
    if hasattr(args, "microbatches") and args.microbatches is None:
        args.microbatches = saved.num_microbatches if saved is not None else 4
    if hasattr(args, "nprocs"):
        replicas = getattr(args, "data_parallel", 1)
        if args.nprocs is None:
            args.nprocs = (saved.num_devices if saved is not None else 2) * replicas
        elif saved is not None and args.nprocs != saved.num_devices * replicas:
            from octopipe.errors import OctopipeError

            times = f" x {replicas} replicas" if replicas > 1 else ""
            raise OctopipeError(f"--nprocs {args.nprocs}: {plan_file} runs on {saved.num_devices} devices{times}; drop "
                                "--nprocs (it defaults to the plan's) or plan again for this many")
    if getattr(args, "batch_size", "unset") is None:
        if saved is not None and saved_size and args.microbatches == saved.num_microbatches:
            args.batch_size = saved_size * saved.num_microbatches  # the batch the plan was costed on
        else:
            args.batch_size = _default_batch_size(max(1, getattr(args, "microbatches", 1) or 1))


def _megatron_batch(args: argparse.Namespace) -> None:
    """--global-batch-size G --micro-batch-size b (Megatron's): --batch-size G / D and
    --microbatches G / (D x b) for D replicas, refusing what does not divide or is given twice."""
    from octopipe.errors import OctopipeError

    if args.global_batch_size is None or args.micro_batch_size is None:
        given, other = (("--global-batch-size", "--micro-batch-size") if args.micro_batch_size is None else
                        ("--micro-batch-size", "--global-batch-size"))
        raise OctopipeError(f"train {given}: give {other} too (Megatron sizes a step by both), or size it by "
                            "--batch-size and --microbatches")
    twice = [flag for flag, value in (("--batch-size", args.batch_size), ("--microbatches", args.microbatches))
             if value is not None]
    if twice:
        raise OctopipeError(f"train {twice[0]}: the step is sized by --global-batch-size and --micro-batch-size; give "
                            "those or --batch-size and --microbatches, not both")
    replicas, micro, whole = args.data_parallel, args.micro_batch_size, args.global_batch_size
    if whole % (micro * replicas):
        raise OctopipeError(f"train --global-batch-size {whole}: not a multiple of --micro-batch-size {micro} x "
                            f"{replicas} replica{'s' if replicas > 1 else ''} (each replica takes an equal share, cut "
                            "into whole microbatches)")
    args.batch_size, args.microbatches = whole // replicas, whole // (micro * replicas)
    args.model_options.append("--global-batch-size")


def _default_batch_size(microbatches: int) -> int:
    """8 rounded up to a multiple of the microbatches."""
    return microbatches * max(1, -(-8 // microbatches))


def _writable(path: str | None, option: str, directory: bool = False) -> None:
    """Refuse an output path before any work: its folder must exist and take a file (a folder
    option's path may be created, inside one that does). Tried with a file, not os.access, which
    says yes to root everywhere (/proc)."""
    import tempfile

    from octopipe.errors import OctopipeError

    if path is None:
        return
    if not path:
        raise OctopipeError(f"{option}: the path is empty")
    target = Path(path)
    if directory and target.exists() and not target.is_dir():
        raise OctopipeError(f"{option} {path}: exists and is not a folder; give a folder to write into")
    if not directory and target.is_dir():
        raise OctopipeError(f"{option} {path}: is a folder; give a file name")
    folder = target if directory else target.parent
    while not folder.exists() and directory:
        folder = folder.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist; create it or write elsewhere"
        raise OctopipeError(f"{option} {path}: {folder} {what}")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".octopipe-write-test-"):
            pass
    except OSError as exc:
        raise OctopipeError(f"{option} {path}: cannot write in {folder} ({exc.strerror or exc}); write elsewhere") from None


def _write_error(path: str, exc: OSError):
    from octopipe.errors import OctopipeError

    return OctopipeError(f"cannot write {path}: {exc.strerror or exc}")


def _fail(exc: Exception, code: int) -> int:
    if os.environ.get("OCTOPIPE_DEBUG"):
        raise exc
    print(f"octopipe: error: {exc}", file=sys.stderr)
    return code


# -- shared options -------------------------------------------------------------------------------

def _cluster(args: argparse.Namespace, default: str = "h100x8", devices: int | None = None, flag: str = "--devices",
             whole: str = ""):
    """--cluster (else `default`) on `devices` devices (default: --devices, where the command has
    it): a preset takes any count, a spec file at most the devices it describes. `whole`: the
    command that needs every device's spec, refusing one replica's (a spec with data_parallel
    above 1, as `ClusterSpec.replica` and saved data-parallel plans write it)."""
    from octopipe.cluster import ClusterSpec
    from octopipe.errors import ClusterSpecError

    spec = args.cluster or default
    cluster = ClusterSpec.of(spec, "--cluster")
    if whole and cluster.data_parallel > 1:
        fix = (f"train takes the whole cluster: give a spec of every device, without data_parallel, with "
               f"--data-parallel {cluster.data_parallel}" if whole == "train" else
               f"{whole} shows one pipeline: give a spec of its devices, without data_parallel")
        raise ClusterSpecError(f"--cluster {spec}: it describes one of {cluster.data_parallel} data-parallel replicas "
                               f"(data_parallel: {cluster.data_parallel}); {fix}")
    devices = devices or getattr(args, "devices", None)
    if devices and devices != cluster.num_devices:
        if devices > cluster.num_devices and ClusterSpec.names_file(spec):
            from octopipe.errors import ClusterSpecError

            raise ClusterSpecError(f"{flag} {devices} exceeds the {cluster.num_devices} devices of {spec}; describe "
                                   f"{devices} devices there (num_devices) or use at most {cluster.num_devices}")
        cluster = cluster.with_devices(devices)
    return cluster


def _half_weights(args: argparse.Namespace) -> Any:
    """The dtype `--bf16-weights` or `--fp16-weights` trains the weights in, or None."""
    import torch

    return (torch.bfloat16 if getattr(args, "bf16_weights", False) else
            torch.float16 if getattr(args, "fp16_weights", False) else None)


def _master_weights(args: argparse.Namespace) -> bool:
    """Whether the engines keep fp32 copies of the weights (`--bf16-weights`, `--fp16-weights`)."""
    return bool(getattr(args, "bf16_weights", False) or getattr(args, "fp16_weights", False))


def _weights_dtype(args: argparse.Namespace, model: Any, inputs: tuple) -> tuple[Any, tuple]:
    """`train --bf16-weights` (`--fp16-weights`): the model cast to bf16 (fp16; the engines keep
    fp32 copies for the optimizer), and its floating-point inputs with it (`_inputs_dtype`)."""
    dtype = _half_weights(args)
    return (model.to(dtype) if dtype is not None else model), _inputs_dtype(args, inputs)


def _inputs_dtype(args: argparse.Namespace, inputs: tuple) -> tuple:
    """`--bf16-weights` (`--fp16-weights`): a batch's floating-point inputs in bf16 (fp16), as the
    weights (a vision model's pixels); otherwise the batch as it is."""
    dtype = _half_weights(args)
    if dtype is None:
        return inputs
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _load_model(args: argparse.Namespace):
    """(model, inputs, target, loss_fn) from --model: a built-in name (with --size, --set,
    --batch-size, --seq-len) or `module:factory`, a function of no arguments that returns a dict
    with keys model, inputs, and optionally target and loss_fn (it makes its own batch; it is
    called after torch.manual_seed(0), as the built-in models are built)."""
    import torch
    from torch import nn

    from octopipe import models
    from octopipe.errors import OctopipeError

    spec = args.model
    if spec in models.MODEL_NAMES:
        device = "meta" if args.size == "paper" else "cpu"
        with torch.device(device):
            torch.manual_seed(0)
            model = models.build(spec, args.size, **_overrides(spec, args.size, args.set))
            inputs, target = _builtin_batch(args)
        return (*_weights_dtype(args, model, inputs), target, models.lm_loss)
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise OctopipeError(f"--model {spec!r}: use a built-in model ({', '.join(models.MODEL_NAMES)}) or "
                            "module:factory (a module on the Python path and a function in it)")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        name = Path(module_name).stem
        raise OctopipeError(f"--model {spec!r}: name the module as Python imports it ({name}:{factory_name}, run "
                            "from its folder or with that folder on PYTHONPATH), not as a file path")
    _factory_options(args)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: a factory module in the current folder
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise OctopipeError(f"--model {spec!r}: cannot import {factory_name} from {module_name}: {exc}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failed while importing
        raise OctopipeError(f"--model {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from exc
    if not callable(factory):
        raise OctopipeError(f"--model {spec!r}: {factory_name} is a {type(factory).__name__}, not a function")
    try:
        # seeded as the built-in models are: a factory that draws its weights or its batch
        # without seeding builds the same on every rank of a torchrun job, and locally
        torch.manual_seed(0)
        made = factory()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: report it as theirs (OCTOPIPE_DEBUG=1 shows the traceback)
        raise OctopipeError(f"--model {spec!r}: {factory_name}() raised {type(exc).__name__}: {exc}; the factory "
                            "takes no arguments and returns {'model': ..., 'inputs': ...}") from exc
    if not isinstance(made, dict) or "model" not in made or "inputs" not in made:
        raise OctopipeError(f"--model {spec!r}: the factory must return a dict with 'model' and 'inputs' "
                            f"(and optionally 'target', 'loss_fn'), got {_kind(made)}")
    unknown = sorted(set(made) - {"model", "inputs", "target", "loss_fn"})
    if unknown:
        raise OctopipeError(f"--model {spec!r}: the factory's dict has unknown key(s) {unknown}; its keys are model, "
                            "inputs, target and loss_fn")
    inputs = tuple(made["inputs"]) if isinstance(made["inputs"], (tuple, list)) else (made["inputs"],)
    target, loss_fn = made.get("target"), made.get("loss_fn", models.lm_loss)
    if not isinstance(made["model"], nn.Module):
        raise OctopipeError(f"--model {spec!r}: 'model' must be a torch.nn.Module, got {_kind(made['model'])}")
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise OctopipeError(f"--model {spec!r}: 'inputs' must be a tensor or a tuple of tensors (one batch)")
    if target is not None and not isinstance(target, torch.Tensor):
        raise OctopipeError(f"--model {spec!r}: 'target' must be a tensor (one batch of targets), got {_kind(target)}")
    if not callable(loss_fn):
        raise OctopipeError(f"--model {spec!r}: 'loss_fn' must be a function loss_fn(output, target), got {_kind(loss_fn)}")
    return (*_weights_dtype(args, made["model"], inputs), target, loss_fn)


def _need_target(args: argparse.Namespace, target: Any) -> None:
    """Training needs a target batch: a factory that gives none can be planned and dumped (the
    loss is traced on a guessed one), not trained."""
    from octopipe.errors import OctopipeError

    if target is None:
        raise OctopipeError(f"train --model {args.model}: the factory's dict has no 'target', and training needs one "
                            "(plan, simulate and dump trace the loss on a guessed target); add 'target': one batch of "
                            "targets for its 'inputs'")


def _factory_options(args: argparse.Namespace) -> None:
    """A factory makes its own model and batch: a built-in model's options would be ignored."""
    from octopipe.errors import OctopipeError

    if args.model_options:
        raise OctopipeError(f"--model {args.model}: {', '.join(args.model_options)} appl{'y' if len(args.model_options) > 1 else 'ies'} to the built-in models only; "
                            "a factory makes its own model and batch (change them there)")


def _kind(value: Any) -> str:
    return type(value).__name__


def _builtin_batch(args: argparse.Namespace) -> tuple[tuple, Any]:
    """A built-in model's example batch (inputs, target), on the default device."""
    from octopipe import models

    fields = _overrides(args.model, args.size, args.set)
    batch_size, seq_len = args.batch_size, args.seq_len
    return (models.example_inputs(args.model, args.size, batch_size=batch_size, seq_len=seq_len, **fields),
            models.example_target(args.model, args.size, batch_size=batch_size, seq_len=seq_len, **fields))


def _overrides(model: str, size: str, items: list[str]) -> dict[str, Any]:
    """--set FIELD=VALUE items as a built-in model's config fields, each read as its field's type."""
    import dataclasses

    from octopipe import models
    from octopipe.errors import OctopipeError

    if not items:
        return {}
    types = {field.name: type(getattr(models.config(model, size), field.name))
             for field in dataclasses.fields(models.config(model, size))}
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise OctopipeError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set num_layers=6")
        if key not in types:
            raise OctopipeError(f"--set {item!r}: {model} has no config field {key!r}; its fields: {', '.join(types)}")
        kind = types[key]
        try:
            fields[key] = kind(value) if kind is not int else int(value, 10)
        except ValueError:
            raise OctopipeError(f"--set {item!r}: {model}'s {key} is {'an integer' if kind is int else 'a number'}, "
                                f"got {value!r}") from None
    return fields


def _check_profilable(args: argparse.Namespace, model: Any, instead: str) -> None:
    """--profile times the model's layers: refused for a model built on the meta device, saying
    what dropping it gives (`instead`)."""
    from octopipe.errors import OctopipeError

    if args.profile and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise OctopipeError(f"--profile: the model ({args.model}{' --size paper' if args.size == 'paper' else ''}) is "
                            f"built on the meta device, which holds no data to time; drop --profile ({instead})")


def _on_profiling_device(model: Any, inputs: Any, target: Any) -> tuple[Any, Any, Any]:
    """The model and its batch on this machine's GPU where it has one (a plan for GPUs wants GPU
    costs), else as they are (the CPU); says which on stderr."""
    import torch

    if next(model.parameters(), torch.empty(0)).is_meta:
        return model, inputs, target  # (refused by the profile, with what to do)
    if not torch.cuda.is_available():
        print("note: --profile measures on this machine's CPU (no GPU here), each layer timed alone: the runtime's "
              "host time, which weighs on small models' steps on CPU processes, is not in it (train --profile "
              "times the layers inside pipelined steps)", file=sys.stderr)
        return model, inputs, target
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"note: --profile measures on {device} ({torch.cuda.get_device_name(device)})", file=sys.stderr)
    move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value
    return model.to(device), tuple(move(t) for t in inputs), move(target)


def _costs_from(args: argparse.Namespace, cluster):
    """A CostTable from --costs FILE, or the analytic/profiled costs of --model."""
    from octopipe.errors import OctopipeError

    if args.costs and args.model:
        raise OctopipeError("give --costs FILE or --model, not both")
    if args.costs:
        ignored = args.model_options + (["--profile"] if args.profile else [])
        if ignored:
            raise OctopipeError(f"--costs {args.costs}: {', '.join(ignored)} apply to --model only; a cost table "
                                "carries its own costs")
        return _cost_table(args.costs, args.hidden_size), None
    if args.hidden_size is not None:
        raise OctopipeError("--hidden-size is for a profile given with --costs; a --model's costs carry their bytes")
    if not args.model:
        raise OctopipeError("give --costs FILE (a cost table) or --model NAME|module:factory")
    from octopipe.passes.codegen import microbatch
    from octopipe.passes.costs import analytic_costs
    from octopipe.passes.trace import trace

    model, inputs, target, loss_fn = _load_model(args)
    if args.profile:
        _check_profilable(args, model, "analytic costs) or profile a real model (--size tiny")
        model, inputs, target = _on_profiling_device(model, inputs, target)
    graph = trace(model, inputs, loss_fn=loss_fn if target is not None else None, example_target=target)
    micro = microbatch(inputs, args.microbatches)
    args.microbatch_size = int(micro[0].shape[0]) if micro and hasattr(micro[0], "shape") and micro[0].dim() else None
    if args.profile:
        from octopipe.passes.profile import profile_costs

        micro_target = microbatch((target,), args.microbatches)[0] if target is not None else None
        return profile_costs(graph, micro, example_target=micro_target, num_microbatches=args.microbatches), graph
    return analytic_costs(graph, cluster, batch_size=int(micro[0].shape[0]), num_microbatches=args.microbatches), graph


def _cost_table(path: str, hidden_size: int | None):
    """--costs FILE: a cost table, or a published profile (data/profiles/) with its activation and
    message bytes filled (octopipe.profiles; the hidden size of the four published models is known)."""
    import json

    from octopipe import profiles
    from octopipe.errors import OctopipeError
    from octopipe.ir.costs import CostTable

    data = None
    if not path.endswith((".yaml", ".yml")):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            data = None  # CostTable.load says what is wrong with the file
    if not profiles.is_profile(data):
        if hidden_size is not None:
            raise OctopipeError(f"--hidden-size: {path} is a cost table, not a profile; its bytes are its own")
        return CostTable.load(path)
    model = str(data.get("model", ""))
    if hidden_size is None and model not in profiles.HIDDEN_SIZE:
        print(f"note: {path}: profile of {model!r} with no hidden size known: no activation or message bytes "
              "(memory limits cannot be planned); give --hidden-size to fill them", file=sys.stderr)
        return CostTable.load(path)
    costs = profiles.load_profile(path, hidden_size=hidden_size)
    hidden = hidden_size or profiles.HIDDEN_SIZE[model]
    print(f"note: {path}: profile of {model!r}; activation and message bytes filled for hidden size {hidden}, "
          f"sequence {data['seq_len']}, bf16 (octopipe.profiles)", file=sys.stderr)
    return costs


def _add_costs_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", metavar="FILE", help="cost table (JSON/YAML, keys as in the README's IR levels), or a profile "
                   "from data/profiles/ (activation and message bytes filled from the model's hidden size)")
    p.add_argument("--hidden-size", type=_positive_int, default=None, metavar="H",
                   help="hidden size for a --costs profile of a model not among the four published ones")
    p.add_argument("--model", metavar="NAME|module:factory",
                   help="a built-in model (llama, gemma, deepseek, nemotron-h, multimodal) or a factory")
    p.add_argument("--size", default=None, choices=("tiny", "paper"), help="built-in model size (paper: on the meta device)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a built-in model's config field")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="global batch size of the example batch (default: 8 rounded up to a multiple of the microbatches)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--profile", action="store_true", help="measure costs on this machine instead of analytic ones")


def _add_cluster_options(p: argparse.ArgumentParser, default: str = "h100x8") -> None:
    p.add_argument("--cluster", metavar="FILE|PRESET", default=None,
                   help=f"cluster spec file or preset (h100x8, h100x16, h800x16-roce, a100x32, cpux2, ...; default {default})")
    p.add_argument("--devices", type=_positive_int, default=None, help="number of devices (overrides the preset's count)")


# -- commands -------------------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from octopipe.demo import run_demo

    _writable(args.out, "--out", directory=True)
    run_demo(out_dir=args.out, steps=args.steps, time_limit_s=args.time_limit, quick=args.quick)
    return EXIT_OK


SEARCH_SHARE_FLOOR = 0.1
"""The least share of `plan --time-limit` the search gets when tracing and costing took the rest."""


def cmd_plan(args: argparse.Namespace) -> int:
    from octopipe.api import plan, plan_data_parallel
    from octopipe.errors import OctopipeError

    _writable(args.output, "-o")
    if args.runners_up and not args.output:
        raise OctopipeError("plan --runners-up: they are written beside the plan file; give -o PLAN as well")
    cluster = _cluster(args)
    if cluster.data_parallel > 1 and args.data_parallel is not None:
        raise OctopipeError(f"plan --data-parallel {args.data_parallel}: --cluster {args.cluster} already describes one "
                            f"of {cluster.data_parallel} replicas (data_parallel: {cluster.data_parallel}); drop "
                            "--data-parallel to plan that replica, or give a spec of every device, without "
                            "data_parallel, with --data-parallel")
    replicas = 1 if args.data_parallel is None else args.data_parallel
    _check_state_flags(args, "plan", "--data-parallel D or auto")
    if args.shard_optimizer and args.optimizer_shards > 1:
        raise OctopipeError(f"plan --shard-optimizer --optimizer-shards {args.optimizer_shards}: give one; "
                            "--shard-optimizer shards over the --data-parallel replicas, --optimizer-shards over a "
                            "count you name")
    if replicas == "auto" and (args.devices or args.runners_up):
        raise OctopipeError(f"plan --data-parallel auto: {'--devices' if args.devices else '--runners-up'} applies "
                            "to one replica count; give the count (--data-parallel D) with it")
    if replicas != "auto" and replicas > 1 and args.devices:
        raise OctopipeError(f"plan --devices {args.devices} --data-parallel {replicas}: each replica gets the "
                            f"cluster's devices / {replicas}; drop --devices and give a cluster of "
                            f"{replicas} x the devices a replica should have (--cluster NAME or a spec file)")
    if replicas != "auto" and replicas > 1:  # plan one replica; its devices' gradient all-reduces are priced
        cluster = cluster.replica(replicas)
    started = time.perf_counter()
    costs, graph = _costs_from(args, cluster)
    # --time-limit bounds the whole command: the search gets what tracing and costing a --model
    # left of it, and at least a tenth of it (then it is cut short, and its report says so)
    spent = time.perf_counter() - started
    search_s = max(args.time_limit - spent, SEARCH_SHARE_FLOOR * args.time_limit)
    if args.model and not args.quiet:
        how = "profiled" if args.profile else "costed"
        over = (" (tracing and costing took longer than the limit: the search gets a tenth of it; raise "
                "--time-limit for a full search)" if search_s > args.time_limit - spent else "")
        print(f"note: traced and {how} {args.model} in {spent:.1f}s; the search gets the {search_s:.1f}s left of "
              f"--time-limit {args.time_limit:g}{over}", file=sys.stderr)
    limit: float | str | None = args.activation_limit
    if isinstance(limit, float):
        limit *= 2**30
    options = dict(time_limit_s=search_s,
                   memory_limit_bytes=args.memory_limit * 2**30 if args.memory_limit is not None else None,
                   activation_limit=limit, seed=args.seed, effort=args.effort, quiet=args.quiet,
                   solver=not args.no_solver, min_gain=args.min_gain / 100, recompute=not args.no_recompute)
    if args.shard_optimizer and replicas == "auto":  # each count's replicas hold their share
        options["memory"] = lambda count: _memory_model(args.optimizer, count, graph, costs,
                                                        args.price_optimizer_step, args.overlap_param_gather,
                                                        _master_weights(args), args.fp32_grads)
    else:
        shards = cluster.data_parallel if args.shard_optimizer else args.optimizer_shards
        options["memory"] = _memory_model(args.optimizer, shards, graph, costs, args.price_optimizer_step,
                                          args.overlap_param_gather, _master_weights(args), args.fp32_grads)
    if replicas == "auto":
        chosen = plan_data_parallel(costs, cluster, args.microbatches, **options)
        print(chosen)
        print(f"chosen: {chosen.data_parallel} replica(s) of {chosen.best.plan.num_devices} devices, "
              f"{chosen.best.plan.num_microbatches} microbatches each (train --data-parallel {chosen.data_parallel})")
        result = chosen.best
    else:
        result = plan(costs, cluster, args.microbatches, num_devices=args.devices, **options)
        print(result.report)
    if args.output:
        path = Path(args.output)
        try:
            result.save(path, microbatch_size=getattr(args, "microbatch_size", None))
        except OSError as exc:
            raise _write_error(args.output, exc) from None
        kept = " with the cost table and cluster it was planned on" if path.suffix.lower() == ".json" else ""
        print(f"plan written to {path}{kept}")
        if args.runners_up:
            _save_runners_up(result, path, getattr(args, "microbatch_size", None))
    else:
        print()
        print(result.plan)
    return EXIT_OK


def _save_runners_up(result: Any, path: Path, microbatch_size: int | None) -> None:
    """Each of the planner's runners-up as PLAN.runner-up-N.SUFFIX beside the plan (as the plan
    is saved, with the same microbatch size), to measure on the cluster with `train --plan`; an
    earlier run's runners-up of the same plan file are removed first, so that none is taken for
    one of this plan's."""
    import re

    from octopipe.api import RUNNER_UP_MARGIN, save_plan
    from octopipe.errors import OctopipeError
    from octopipe.simulator import simulate

    earlier = re.compile(re.escape(path.stem) + r"\.runner-up-\d+" + re.escape(path.suffix))
    for old in sorted(path.parent.iterdir()):
        if earlier.fullmatch(old.name) and old.is_file():  # (what the planner writes: files)
            try:
                old.unlink()
            except OSError as exc:
                raise OctopipeError(f"cannot remove {old}, a runner-up of an earlier plan written to {path}: "
                                    f"{exc.strerror or exc}; remove it, or write the plan elsewhere") from None
            print(f"removed {old} (a runner-up of an earlier plan written to {path})")
    if not result.runners_up:
        print(f"no runner-up: no plan of another shape fits within {RUNNER_UP_MARGIN:.0%} of this one")
    for index, runner_up in enumerate(result.runners_up, start=1):
        target = path.with_name(f"{path.stem}.runner-up-{index}{path.suffix}")
        iteration_ms = simulate(runner_up, result.costs, result.simulation.cluster).iteration_ms
        try:
            save_plan(runner_up, target, costs=result.costs, cluster=result.simulation.cluster,
                      iteration_ms=iteration_ms, microbatch_size=microbatch_size)
        except OSError as exc:
            raise _write_error(str(target), exc) from None
        print(f"runner-up {index} written to {target} ({runner_up.num_stages} stages, placement "
              f"{list(runner_up.placement)}, predicted {iteration_ms:.1f} ms)")


def _same(a: Any, b: Any) -> bool:
    """Equal, numbers to rounding (a table re-costed for another microbatch count and back)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9,
                                                                                             abs_tol=1e-12)
    return a == b


def _other_microbatches(given: int, path: str, planned: int):
    """The error for --microbatches that differs from a plan file's own count."""
    from octopipe.errors import OctopipeError

    return OctopipeError(f"--microbatches {given}: {path} runs {planned} microbatches; a plan's microbatch count is "
                         "its own (drop the option, or plan again)")


def _other_layers(where: str, planned: int, source: str, layers: int, fix: str):
    """The error for a plan file whose stages cover another layer count than the model or costs: an
    invalid plan (exit 4) in every command, as compile's own check is."""
    from octopipe.errors import PlanError

    return PlanError(f"{where}: its stages cover {planned} layers, but {source} has {layers}; {fix}")


def _plan_inputs(args: argparse.Namespace, path: str, given: dict | None = None):
    """(plan, costs, cluster, the planner's predicted ms or None, the memory model it was planned
    with) for a plan file: the costs and
    cluster given on the command line, else those saved in the file (`octopipe plan -o x.json`),
    else the defaults (cluster only; costs are required). `given` keeps the command line's costs
    for the next plan file (a --model's analytic costs per cluster)."""
    from octopipe.api import load_saved_plan
    from octopipe.errors import OctopipeError, PlanError

    saved = load_saved_plan(path)
    plan_ = saved.plan
    try:
        plan_.validate()  # (against the costs' layers in simulate)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    if args.microbatches is not None and args.microbatches != plan_.num_microbatches:
        raise _other_microbatches(args.microbatches, path, plan_.num_microbatches)
    if args.devices is not None and args.devices != plan_.num_devices:
        raise OctopipeError(f"--devices {args.devices}: {path} runs on {plan_.num_devices} devices (drop the option)")
    # a --model's costs are for one microbatch of this plan's count
    args = argparse.Namespace(**vars(args))
    args.microbatches = plan_.num_microbatches
    # the batch the plan was costed on: its microbatches of the size saved with it (one replica's
    # share where --data-parallel auto cut a whole batch), else the default batch
    planned_batch = saved.microbatch_size * plan_.num_microbatches if saved.microbatch_size else None
    args.batch_size = args.batch_size or planned_batch or _default_batch_size(plan_.num_microbatches)
    if args.cluster is None and saved.cluster is not None:
        cluster = saved.cluster.with_devices(args.devices) if args.devices else saved.cluster
    else:
        cluster = _cluster(args)
        if saved.cluster is None and args.cluster is None:
            print(f"note: {path} does not say what cluster it was planned on; simulating it on {cluster.name} (give "
                  "--cluster)", file=sys.stderr)
        if saved.cluster is not None and cluster != saved.cluster:
            print(f"note: {path} was planned on cluster {saved.cluster.name}; simulating it on {cluster.name} as asked",
                  file=sys.stderr)
    if cluster.num_devices < plan_.num_devices:
        if args.cluster is not None:
            raise OctopipeError(f"--cluster {args.cluster}: {cluster.num_devices} devices, but {path} runs on "
                                f"{plan_.num_devices}; give a cluster that has them")
        cluster = cluster.with_devices(plan_.num_devices)  # the default preset, grown to the plan
    if args.costs or args.model:
        given = {} if given is None else given
        key = (cluster, args.microbatches) if args.model else None
        if key not in given:
            args.microbatch_size = None
            given[key] = _costs_from(args, cluster)[0], args.microbatch_size
        costs, priced_size = given[key]
        if saved.microbatch_size and priced_size and priced_size != saved.microbatch_size:
            # a module:factory makes its own batch, so its microbatches may not be the planned ones
            print(f"note: {path} was planned for microbatches of {saved.microbatch_size}; --model {args.model} makes "
                  f"microbatches of {priced_size} (its batch over {plan_.num_microbatches}), and they are what is "
                  "priced here", file=sys.stderr)
        if len(costs) != plan_.num_layers:
            source = f"--model {args.model}" if args.model else f"--costs {args.costs}"
            raise _other_layers(path, plan_.num_layers, source, len(costs),
                                "give the costs of the model it was planned for, or plan this one")
        if saved.costs is not None and not _same(costs.for_microbatches(plan_.num_microbatches).to_dict(),
                                                 saved.costs.for_microbatches(plan_.num_microbatches).to_dict()):
            print(f"note: {path} was planned on other costs ({saved.costs.model or 'a saved table'}); simulating it "
                  "on the ones given", file=sys.stderr)
    elif saved.costs is not None:
        costs = saved.costs
    else:
        raise OctopipeError(f"{path} does not carry the costs it was planned on (a text plan, or JSON not written by "
                            "octopipe plan -o FILE.json): give --costs FILE or --model NAME|module:factory")
    same = args.cluster is None and not (args.costs or args.model) and not args.devices
    return plan_, costs, cluster, saved.iteration_ms if same else None, saved.memory


def cmd_simulate(args: argparse.Namespace) -> int:
    from octopipe.simulator import simulate

    _writable(args.trace, "--trace")
    plan_, costs, cluster, planned_ms, memory = _plan_inputs(args, args.plan)
    result = simulate(plan_, costs, cluster, blocking_sends=args.blocking_sends, memory=memory)
    print(result)
    if planned_ms is not None and not args.blocking_sends:
        agrees = "the same" if abs(result.iteration_ms - planned_ms) <= 1e-6 * max(1.0, planned_ms) else "DIFFERENT"
        print(f"planned: {planned_ms:.2f} ms on the saved costs and cluster ({agrees})")
    if args.trace:
        try:
            result.save_trace(args.trace)
        except OSError as exc:
            raise _write_error(args.trace, exc) from None
        print(f"Chrome/Perfetto trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from octopipe.simulator import simulate
    from octopipe.viz import draw_comparison, draw_timeline

    _writable(args.output, "-o")
    results, given = {}, {}
    for path in args.plans:
        plan_, costs, cluster, _, memory = _plan_inputs(args, path, given)
        label = Path(path).stem if Path(path).stem not in results else path  # A/plan.json, B/plan.json
        for copy in range(2, len(args.plans) + 2):
            if label not in results:
                break
            label = f"{path} ({copy})"  # the same file twice
        results[label] = simulate(plan_, costs, cluster, memory=memory)
    try:
        if len(results) == 1:
            draw_timeline(next(iter(results.values())), args.output, title=args.title)
        else:
            draw_comparison(results, args.output, title=args.title)
    except OSError as exc:
        raise _write_error(args.output, exc) from None
    print(f"timeline written to {args.output}")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    import octopipe
    from octopipe.bench import measure_steps, save_path
    from octopipe.errors import ExecutionError, OctopipeError

    if args.clip_grad is not None and not args.clip_grad > 0:
        raise OctopipeError(f"train --clip-grad {args.clip_grad}: the norm to clip to must be > 0")
    if args.plan and args.schedule:
        raise OctopipeError("train: give --plan FILE (a saved plan) or --schedule NAME (a baseline), not both")
    _check_state_flags(args, "train", "--data-parallel D")
    args.first_step = 0  # the iterations done before this run: a --resume checkpoint's, read where it is loaded
    if args.save_interval and not args.save:
        raise OctopipeError(f"train --save-interval {args.save_interval}: give --save PATH too (where to write)")
    if args.resume and args.init:
        raise OctopipeError("train: give --init CHECKPOINT (its weights) or --resume CHECKPOINT (the whole state, "
                            "the optimizer's too), not both")
    if args.resume and not args.torchrun and not os.path.exists(args.resume):  # (printed: the cluster's path)
        raise OctopipeError(f"train --resume {args.resume}: no such file or directory; give a checkpoint train --save "
                            "wrote (or Engine.save_checkpoint)")
    if args.save_sharded and not args.save:
        raise OctopipeError("train --save-sharded: give --save DIRECTORY too (where every rank writes its shard)")
    _check_lr_schedule(args)
    _optimizer_options(args)
    _check_data_flags(args)
    if args.trace and not args.torchrun:  # (before the training; a printed line's path is the cluster's)
        _writable(args.trace, "--trace")
    if args.tensorboard_dir is not None and not args.torchrun:  # (a printed line's folder is the cluster's)
        _writable(args.tensorboard_dir, "train --tensorboard-dir", directory=True)
    if args.tensorboard_dir and not args.torchrun:  # (before the planning; the cluster's may have it)
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise OctopipeError(NO_TENSORBOARD)
    if args.save and not args.torchrun:  # (before the training, not after it; a printed line's path is the cluster's)
        if not args.save_sharded and os.path.isdir(save_path(args.save, 0)):
            raise OctopipeError(f"train --save {args.save}: is a folder; give a file name, or --save-sharded too "
                                "(every rank then writes its own file into the folder)")
        _writable(save_path(args.save, 0), "--save", directory=args.save_sharded)
    if args.async_save and not args.save_sharded:
        raise OctopipeError("train --async-save: each rank writes its own shard beside training, which needs "
                            "--save DIRECTORY --save-sharded too (as Megatron's --async-save needs its torch_dist "
                            "format)")
    given = [flag for flag, name, _ in LOSS_SCALING if getattr(args, name) is not None]
    if given and not (args.fp16_weights or args.autocast == "fp16"):
        raise OctopipeError(f"train {given[0]}: only fp16 scales its loss; give --fp16-weights or --autocast fp16 too")
    if args.loss_scale is not None and args.initial_loss_scale is not None:
        raise OctopipeError("train: give --loss-scale S (a static scale) or --initial-loss-scale S (a dynamic "
                            "one's start), not both")
    if given:
        from octopipe.runtime.amp import LossScaler

        try:
            LossScaler(**_loss_scaling(args))  # type: ignore[arg-type]
        except OctopipeError as exc:
            raise OctopipeError(f"train {' '.join(given)}: {exc}") from None
    if args.nprocs % args.data_parallel:
        raise OctopipeError(f"train --nprocs {args.nprocs}: not a multiple of --data-parallel {args.data_parallel} "
                            "(it counts every rank of every replica)")
    planning_only = [flag for flag, given in (("--time-limit", args.time_limit is not None), ("--profile", args.profile),
                                              ("--candidates", args.candidates > 1), ("--effort", args.effort is not None))
                     if given]
    if (args.plan or args.schedule) and planning_only:
        raise OctopipeError(f"train: {', '.join(planning_only)} appl{'y' if len(planning_only) > 1 else 'ies'} when train plans; with "
                            f"{'--plan' if args.plan else '--schedule'} nothing is planned")
    if args.candidates > 1 and (args.torchrun or "RANK" in os.environ):
        raise OctopipeError("train --candidates: plans are measured against each other on local processes; for a "
                            "cluster, write them with octopipe plan -o PLAN.json --runners-up and run each there "
                            "with train --plan")
    if args.torchrun:
        print(torchrun_command(args))
        return EXIT_OK
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _train_distributed(args)
    if args.exit_signal_handler:  # (from here: a SIGTERM while planning stops the ranks after their first step)
        from octopipe.bench import pass_sigterm_to_ranks

        pass_sigterm_to_ranks()
    if args.size == "paper":
        raise OctopipeError("train --size paper: a paper-size model does not fit this machine; it trains across GPUs "
                            "under torchrun, where each rank creates only its own stages (--torchrun prints the "
                            "line); here use --size tiny")
    cluster = _cluster(args, default=f"cpux{args.nprocs}", devices=args.nprocs, flag="--nprocs", whole="train")
    model, inputs, target, loss_fn = _load_model(args)
    _need_target(args, target)
    data = _token_data(args, model, inputs, target)
    if any(param.is_meta for param in model.parameters()):
        raise OctopipeError(f"train --model {args.model}: the model is on the meta device; local training needs a "
                            "real one (a meta model trains under torchrun, each rank creating its own stages)")
    if args.init:
        from octopipe.runtime import load_into_model
        from octopipe.runtime.materialize import checkpoint_state

        try:
            load_into_model(model, checkpoint_state(args.init, 0))  # type: ignore[arg-type]
        except ExecutionError as exc:  # a bad file given on the command line, not a failed run
            raise OctopipeError(f"--init {args.init}: {exc}") from None
    costs: Any = "analytic"
    if args.profile:
        cluster, costs = _runtime_profiled(args, cluster, model, inputs, target, loss_fn)
    pipe = octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                            num_microbatches=args.microbatches, costs=costs, plan=args.plan, schedule=args.schedule,
                            time_limit_s=args.time_limit or 10.0, effort=args.effort or 1.0, quiet=args.quiet,
                            autocast=args.autocast, data_parallel=args.data_parallel, optimizer=args.optimizer,
                            shard_optimizer=args.shard_optimizer,
                            overlap_param_gather=args.overlap_param_gather,
                            master_weights=_master_weights(args), fp32_grads=args.fp32_grads,
                            loss_weight=_loss_weight(args))
    if args.candidates > 1:
        pipe = _fastest_measured(pipe, args, model, inputs, target, loss_fn)
    print(pipe.dump("plan"))
    if pipe.data_parallel > 1:
        sharded = (("; the optimizer's state sharded over them (ZeRO-1), each share's update "
                    + ("broadcast beside the next step" if pipe.overlap_param_gather else "broadcast after the step"))
                   if pipe.shard_optimizer else "")
        print(f"{pipe.data_parallel} replicas of this {pipe.plan.num_devices}-rank pipeline ({pipe.world_size} "
              f"processes), {'each on its own share of every step' if data else 'each on the same batch here'}; summing their gradients takes up to "
              f"{pipe.data_parallel_ms:.1f} ms a step (in the prediction){sharded}")
    _note_one_replica_shard(pipe)
    if pipe.master_weights and args.fp16_weights:
        print("fp16 weights; the optimizer steps fp32 copies of them, the loss scaled dynamically and the gradients "
              "accumulated, unscaled, summed and clipped in fp32 (--fp16-weights)")
    elif pipe.master_weights:
        print("bf16 weights; the optimizer steps fp32 copies of them (--bf16-weights); "
              + ("the gradients accumulated, summed and clipped in fp32" if pipe.fp32_grads else
                 "bf16 gradients (--grad-reduce-in-bf16)"))
    if data is not None:
        print(_describe_data(data))
    # one warm-up step first, untimed and without an update: `--steps N` is N updates, and step 0's
    # loss is the starting model's, as under torchrun
    # with master weights the engines also start their fp32 copies from the checkpoint's
    if args.resume:
        from octopipe.runtime.materialize import saved_extra

        extra = saved_extra(args.resume, 0)
        args.first_step = _resumed_iteration(extra, args.resume)  # (the workers load the rest)
        _check_resumed_optimizer(args)
        if data is not None:
            note = data.resume(extra, f"train --resume {args.resume}")
            if note:
                print(f"note: {note}", file=sys.stderr)
            if data.consumed:
                print(f"data: resumed after the checkpoint's {data.consumed:,} sequences")
    board = _Board(args, data)  # (its folder made before the training)
    # (with --exit-signal-handler, SIGTERM has gone to the ranks since the run began, and one more
    # while this reports is held: pass_sigterm_to_ranks above)
    timing = measure_steps(pipe, inputs, target, steps=args.steps, warmup=1, learning_rate=args.lr,
                           optimizer=args.optimizer, clip_grad=args.clip_grad, update_in_warmup=False,
                           init=args.init if pipe.master_weights else None, loss_scaler=_loss_scaling(args),
                           resume=args.resume, save=args.save, save_every=args.save_interval,
                           save_sharded=args.save_sharded, save_background=args.async_save,
                           first_step=args.first_step, lr_schedule=_lr_schedule(args), data=data,
                           optimizer_options=_optimizer_options(args), trace=bool(args.trace),
                           exit_check=_exit_check(args), measure_activations=args.measure_activations)
    _report_training(args, timing, data, board, pipe, cluster)
    return EXIT_OK


def _report_training(args: argparse.Namespace, timing: Any, data: Any, board: _Board, pipe: Any, cluster: Any) -> None:
    """Local `train`'s lines after its ranks ran: the steps, evaluations, where it stopped and
    saved, the trace, the measured step beside the prediction."""
    evaluations = dict(timing.evaluations)
    log = _StepLog(args, data)
    ran = len(timing.losses)
    schedule = _lr_schedule(args)
    for step, (loss, ms) in enumerate(zip(timing.losses, timing.step_ms)):
        skipped = step < len(timing.skipped) and timing.skipped[step]
        norm = timing.grad_norms[step] if step < len(timing.grad_norms) else None
        line = log.line(step, loss, ms, skipped, timing.loss_scales[step] if skipped else None,
                        stopping=timing.exit_reason is not None and step + 1 == ran, grad_norm=norm)
        if line:
            print(line)
        done = args.first_step + step + 1
        board.step(done, loss, ms, _step_lr(args, schedule, step),
                   timing.loss_scales[step] if step < len(timing.loss_scales) else None, norm)
        if done in evaluations:
            print(_evaluation_line(done, evaluations[done]))
            board.evaluation(done, evaluations[done])
    if timing.test_loss is not None:
        print(_evaluation_line(args.first_step + args.steps, timing.test_loss, "test"))
        board.evaluation(args.first_step + args.steps, timing.test_loss, "test")
    board.close()
    _print_end(args, args.first_step + ran, timing.exit_reason)
    if args.trace and timing.exit_reason is None:
        _write_trace(args, timing.timelines, pipe.simulation)
    print(f"median step {timing.median_ms:.1f} ms (predicted {pipe.simulation.iteration_ms:.1f} ms from "
          f"{'profiled' if args.profile else 'analytic'} costs)")
    if timing.activation_peak_bytes:
        print(_activations_line(timing.activation_peak_bytes, pipe))
    if not args.profile and not args.plan and timing.median_ms > 3 * pipe.simulation.iteration_ms:
        print(f"note: analytic costs price FLOPs and bytes at {cluster.name}'s rates, not this machine's per-op "
              "overheads (large for small models on CPUs); --profile plans with measured costs, and its prediction "
              "is the one to compare", file=sys.stderr)


def _activations_line(peaks: list[int] | tuple[int, ...], pipe: Any) -> str:
    """`train --measure-activations`: each rank's most activation bytes held in a step, beside the
    simulation's peak for its device (rank r of D replicas is device r // D)."""
    predicted = pipe.simulation.peak_activation_bytes
    replicas = pipe.data_parallel
    ranks = ", ".join(f"rank {rank} {_mib(peak)} (predicted {_mib(predicted[rank // replicas])})"
                      for rank, peak in enumerate(peaks))
    return f"activations held at most, in a step: {ranks} MiB"


def _mib(size: float) -> str:
    return f"{size / 2**20:.3f}" if size < 2**30 else f"{size / 2**20:,.0f}"


LOSS_SCALING = (("--initial-loss-scale", "initial_loss_scale", "init_scale"), ("--loss-scale", "loss_scale", "init_scale"),
                ("--min-loss-scale", "min_loss_scale", "min_scale"),
                ("--loss-scale-window", "loss_scale_window", "growth_interval"), ("--hysteresis", "hysteresis", "hysteresis"))
"""`train`'s fp16 loss-scaling flags (Megatron's names): (flag, argparse name, `LossScaler` option)."""


def _loss_scaling(args: argparse.Namespace) -> dict[str, Any] | None:
    """`train`'s loss-scaling flags as `LossScaler` options (`--loss-scale`: static), or None
    where none is given (the engines' default scaler)."""
    options = {option: getattr(args, name) for _, name, option in LOSS_SCALING if getattr(args, name) is not None}
    if args.loss_scale is not None:
        options["dynamic"] = False
    return options or None


def _saves_at(args: argparse.Namespace, step: int) -> bool:
    """Whether `train --save` writes the checkpoint after this run's step `step` (0-based;
    `bench.saves_after`, on the iterations counted from `args.first_step`)."""
    from octopipe.bench import saves_after

    return bool(args.save) and saves_after(args.first_step + step + 1, args.first_step + args.steps,
                                           args.save_interval)


NO_TENSORBOARD = ("train --tensorboard-dir: needs the tensorboard package, which is not installed: pip install "
                  "tensorboard (or octopipe[tensorboard])")


class _Board:
    """--tensorboard-dir: the run's scalars in TensorBoard event files, each at the iterations done
    (1 after the first update; counted on from a --resume checkpoint's), under Megatron's names.
    Without the flag every call does nothing."""

    def __init__(self, args: argparse.Namespace, data: Any) -> None:
        from octopipe.errors import OctopipeError

        self.writer: Any = None
        self.batch = float(data.train.global_batch if data is not None else args.batch_size * args.data_parallel)
        if args.tensorboard_dir is None:
            return
        if not args.tensorboard_dir:  # (SummaryWriter would pick ./runs/... itself)
            raise OctopipeError("train --tensorboard-dir: the path is empty; give a folder")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise OctopipeError(NO_TENSORBOARD) from None
        try:
            self.writer = SummaryWriter(args.tensorboard_dir)
        except OSError as exc:
            raise OctopipeError(f"train --tensorboard-dir {args.tensorboard_dir}: cannot write there ({exc}); give a "
                                "folder this process can create files in") from None

    def step(self, done: int, loss: float, ms: float, lr: float | None, scale: float | None,
             grad_norm: float | None = None) -> None:
        if self.writer is None:
            return
        if grad_norm is not None:
            self.writer.add_scalar("grad-norm", grad_norm, done)
        self.writer.add_scalar("lm loss", loss, done)
        if lr is not None:
            self.writer.add_scalar("learning-rate", lr, done)
        self.writer.add_scalar("batch-size", self.batch, done)
        self.writer.add_scalar("iteration-time", ms / 1e3, done)
        if scale is not None:
            self.writer.add_scalar("loss-scale", scale, done)

    def evaluation(self, done: int, loss: float, which: str = "validation") -> None:
        if self.writer is not None:
            self.writer.add_scalar(f"lm loss {which}", loss, done)
            self.writer.add_scalar(f"lm loss {which} ppl", math.exp(min(loss, 20.0)), done)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_lr(args: argparse.Namespace, schedule: Any, step: int) -> float | None:
    """The learning rate run step `step`'s update took (None: no update, --lr 0)."""
    if not args.lr:
        return None
    return schedule(args.first_step + step) if schedule is not None else args.lr


def _exit_check(args: argparse.Namespace) -> Any:
    """--exit-interval, --exit-duration-in-mins and --exit-signal-handler as a `bench.ExitCheck`,
    None without them."""
    from octopipe.bench import ExitCheck

    if args.exit_interval is None and args.exit_duration_in_mins is None and not args.exit_signal_handler:
        return None
    return ExitCheck(args.exit_interval, args.exit_duration_in_mins, args.exit_signal_handler)


def _print_end(args: argparse.Namespace, done: int, stopped: str | None) -> None:
    """The run's last lines: where it stopped early (--exit-*), why; where it saved, how to go on."""
    from octopipe.bench import save_path

    if stopped:
        print(f"stopped after iteration {done} of {args.first_step + args.steps}: {stopped}"
              + ("" if args.save else "; nothing saved (no --save)"), flush=True)
        if args.trace:
            print(f"note: train --trace: no trace written; it records the last step ({args.first_step + args.steps - 1}), "
                  "which did not run", file=sys.stderr, flush=True)
    if args.save:
        last = save_path(args.save, done)
        print(f"saved the checkpoint to {last} (train --resume {last} continues from it)", flush=True)


def _saved_note(args: argparse.Namespace, step: int) -> str:
    from octopipe.bench import save_path

    return f"  (saved to {save_path(args.save, args.first_step + step + 1)})"


OPTIMIZER_FLAGS = (("--weight-decay", "weight_decay", None), ("--adam-beta1", "adam_beta1", "adamw"),
                   ("--adam-beta2", "adam_beta2", "adamw"), ("--adam-eps", "adam_eps", "adamw"),
                   ("--sgd-momentum", "sgd_momentum", "sgd"))
"""`train`'s optimizer flags (Megatron's names): (flag, argparse name, the optimizer it applies to, None: both)."""


def _optimizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """`bench.training_optimizer`'s options from the flags given, refusing one for the other
    optimizer (and checking them as the optimizer will, here rather than on every rank)."""
    from octopipe.errors import OctopipeError

    for flag, name, applies in OPTIMIZER_FLAGS:
        if getattr(args, name) is not None and applies not in (None, args.optimizer):
            raise OctopipeError(f"train {flag}: applies to --optimizer {applies}, not {args.optimizer}")
    options: dict[str, Any] = {}
    if args.weight_decay is not None:
        options["weight_decay"] = args.weight_decay
    if args.optimizer == "adamw":
        if args.adam_beta1 is not None or args.adam_beta2 is not None:
            options["betas"] = (0.9 if args.adam_beta1 is None else args.adam_beta1,
                                0.999 if args.adam_beta2 is None else args.adam_beta2)
        if args.adam_eps is not None:
            options["eps"] = args.adam_eps
    elif args.sgd_momentum is not None:
        options["momentum"] = args.sgd_momentum
    for flag, name, _ in OPTIMIZER_FLAGS[1:3]:
        value = getattr(args, name)
        if value is not None and not 0.0 <= value < 1.0:
            raise OctopipeError(f"train {flag} {value:g}: must be in [0, 1) (Megatron's default: "
                                f"{'0.9' if name == 'adam_beta1' else '0.999'})")
    if args.sgd_momentum is not None and not 0.0 <= args.sgd_momentum < 1.0:
        raise OctopipeError(f"train --sgd-momentum {args.sgd_momentum:g}: must be in [0, 1)")
    return options


def _check_lr_schedule(args: argparse.Namespace) -> None:
    """`train`'s Megatron learning-rate flags: a decay needs its end, after the warm-up, and a
    floor below the peak."""
    from octopipe.errors import OctopipeError

    if args.lr_decay_style != "constant" and args.lr_decay_iters is None:
        raise OctopipeError(f"train --lr-decay-style {args.lr_decay_style}: give --lr-decay-iters D too (the "
                            "iteration where it reaches --min-lr)")
    if args.lr_decay_iters is not None and args.lr_decay_style == "constant":
        raise OctopipeError("train --lr-decay-iters: a constant learning rate does not decay; give --lr-decay-style "
                            "linear or cosine too")
    if args.lr_decay_iters is not None and args.lr_decay_iters <= args.lr_warmup_iters:
        raise OctopipeError(f"train --lr-decay-iters {args.lr_decay_iters}: the decay must end after the warm-up "
                            f"(--lr-warmup-iters {args.lr_warmup_iters})")
    if args.min_lr > args.lr:
        raise OctopipeError(f"train --min-lr {args.min_lr:g}: above --lr {args.lr:g}; give a floor below the peak")


def _lr_schedule(args: argparse.Namespace) -> Any:
    """`train`'s `bench.LRSchedule`, or None for a constant --lr."""
    from octopipe.bench import LRSchedule

    if not args.lr_warmup_iters and args.lr_decay_style == "constant":
        return None
    return LRSchedule(args.lr, args.lr_warmup_iters, args.lr_decay_style, args.lr_decay_iters, args.min_lr)


def _lr_note(args: argparse.Namespace, done: int) -> str:
    """What a step line adds under a schedule: the learning rate its update took."""
    schedule = _lr_schedule(args)
    return f"  lr {schedule(done):.4g}" if schedule is not None else ""


def _check_resumed_optimizer(args: argparse.Namespace) -> None:
    """--resume with another --optimizer than the checkpoint's, refused here, before the ranks
    start (each would refuse it as it loads: `runtime.engine.check_optimizer_class`)."""
    from octopipe.errors import OctopipeError
    from octopipe.runtime.materialize import saved_optimizer_class

    saved = saved_optimizer_class(args.resume, 0)
    wanted = {"sgd": "SGD", "adamw": "AdamW"}[args.optimizer]
    if saved is not None and saved != wanted:
        theirs = {"SGD": "sgd", "AdamW": "adamw"}.get(saved)
        raise OctopipeError(f"train --resume {args.resume}: its optimizer state is {saved}'s, but --optimizer is "
                            f"{args.optimizer}; resume with "
                            + (f"--optimizer {theirs}" if theirs else "the optimizer that saved it")
                            + ", or start from its weights alone with --init")


def _resumed_iteration(extra: dict[str, Any], path: str) -> int:
    """The iterations a `--resume` checkpoint had done (the `iteration` train saved beside it; 0
    for a checkpoint without it, one `Engine.save_checkpoint` wrote without `extra`)."""
    iteration = extra.get("iteration", 0)
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        from octopipe.errors import OctopipeError

        raise OctopipeError(f"train --resume {path}: its saved iteration is {iteration!r}, not a count of steps")
    return iteration


class _StepLog:
    """`train`'s step lines: one a step, or with --log-interval N one every N steps and after the
    last (Megatron's --log-interval), its loss and time the means over those steps. With token data
    each line also gives the tokens trained on a second (each step's global batch x sequence)."""

    def __init__(self, args: argparse.Namespace, data: Any) -> None:
        self.args = args
        self.interval = args.log_interval or 1
        self.tokens = data.train.global_batch * data.train.seq_len if data is not None else None
        self.losses: list[float] = []
        self.times: list[float] = []
        self.notes: list[str] = []
        self.skipped = 0
        self.scale: float | None = None

    def line(self, step: int, loss: float, ms: float, skipped: bool, scale: float | None,
             stopping: bool = False, grad_norm: float | None = None) -> str | None:
        """Take step `step` (0-based in this run); the line to print, if one is due. `stopping`:
        the run stops after this step (--exit-*): the line is due, and the checkpoint is saved.
        `grad_norm` (--clip-grad): the step's gradient norm before clipping; a line gives its
        last step's, as Megatron's does."""
        args = self.args
        self.losses.append(loss)
        self.times.append(ms)
        if skipped:
            self.skipped += 1
            self.scale = scale
        if _saves_at(args, step) or (stopping and args.save):
            self.notes.append(_saved_note(args, step))
        # (a window ends at an iteration divisible by N, counted on after a resume, as Megatron's)
        if (args.first_step + step + 1) % self.interval and step + 1 < args.steps and not stopping:
            return None
        count, number = len(self.losses), args.first_step + step
        ms = sum(self.times) / count
        finite = [value for value in self.losses if value == value]  # (nan: a step where no target counted)
        text = f"step {number}: loss {sum(finite) / len(finite) if finite else math.nan:.5f}  {ms:.1f} ms"
        if self.tokens is not None and ms > 0:
            text += f"  {self.tokens / ms * 1e3:,.0f} tokens/s"
        text += _lr_note(args, number)
        if grad_norm is not None:
            text += f"  grad norm {grad_norm:.4g}"
        if count > 1:
            text += f"  (means of steps {number - count + 1}-{number})"
        if 0 < len(finite) < count:
            text += f"  ({count - len(finite)} of them nan, left out of the mean: no target counted)"
        if self.skipped:
            text += (_skipped_note(self.scale) if count == 1 else
                     f"  ({self.skipped} of them skipped: an inf or nan gradient; loss scale now {self.scale:g})")
        text += "".join(self.notes)
        self.losses, self.times, self.notes, self.skipped = [], [], [], 0
        return text


def _skipped_note(scale: float | None) -> str:
    """What a `train` step line adds where fp16 loss scaling skipped the step."""
    return f"  (skipped: an inf or nan gradient; loss scale now {scale:g})"


OPTIMIZERS = ("mixed-adam", "adamw", "adam", "sgd-momentum", "sgd")
"""`plan --optimizer` values (`octopipe.simulator.OPTIMIZER_STATE`'s keys; importing it here would
import torch)."""


def _check_state_flags(args: argparse.Namespace, command: str, replicas: str) -> None:
    """`--overlap-param-gather` without `--shard-optimizer` has nothing to overlap, and
    `--fp32-grads` without `--bf16-weights` no fp32 copies to step: refuse them (and
    `--bf16-weights` with `--fp16-weights`, `--grad-reduce-in-bf16` with `--fp32-grads`, with
    `--fp16-weights` or without `--bf16-weights`). `--fp16-weights` sets `--fp32-grads`, which it
    needs, and `--bf16-weights` does unless `--grad-reduce-in-bf16` is given (Megatron's default
    and its opt-out)."""
    from octopipe.errors import OctopipeError

    if args.overlap_param_gather and not args.shard_optimizer:
        raise OctopipeError(f"{command} --overlap-param-gather: it overlaps the broadcast of a sharded optimizer's "
                            f"updated shares with the next step; give --shard-optimizer (and {replicas}) too")
    if getattr(args, "fp16_weights", False):
        if args.bf16_weights:
            raise OctopipeError(f"{command}: give --bf16-weights or --fp16-weights, not both")
        if args.grad_reduce_in_bf16:
            raise OctopipeError(f"{command} --grad-reduce-in-bf16: fp16 weights' loss-scaled gradients are accumulated "
                                "and unscaled in fp32 (fp16 would flush the small ones to zero); leave it out, or "
                                "train bf16 weights (--bf16-weights)")
        args.fp32_grads = True  # (fp16 weights' loss-scaled gradients are accumulated and unscaled in fp32)
    if args.grad_reduce_in_bf16:
        if not args.bf16_weights:
            raise OctopipeError(f"{command} --grad-reduce-in-bf16: it keeps the gradients of bf16 weights in bf16 "
                                "(their fp32 copies take them cast up); give --bf16-weights too")
        if args.fp32_grads:
            raise OctopipeError(f"{command}: give --fp32-grads or --grad-reduce-in-bf16, not both")
    elif args.bf16_weights:
        args.fp32_grads = True  # (Megatron's default under --bf16: the gradients accumulated and reduced in fp32)
    mixed = command == "plan" and args.optimizer == "mixed-adam"  # (mixed-adam's copies are fp32 already)
    if args.fp32_grads and not _master_weights(args) and not mixed:
        raise OctopipeError(f"{command} --fp32-grads: it accumulates the gradients of bf16 weights in fp32 for their "
                            f"fp32 copies; give --bf16-weights too")


def _memory_model(optimizer: str, shards: int, graph: Any, costs: Any, price_step: bool = False,
                  overlap: bool = False, master_weights: bool = False, fp32_grads: bool = False) -> Any:
    """`plan --optimizer`'s memory model: for a --model (`graph`), sized from its own weights as
    `compile(optimizer=...)` and train size it; for a cost table, on weights held in the dtype it
    counts. `price_step`: with the step's traffic (`plan --price-optimizer-step`); `overlap`: the
    shares' broadcast overlapped with the next step (`plan --overlap-param-gather`; with one
    shard, as `--data-parallel auto`'s single replica has, nothing is broadcast); `master_weights`:
    the optimizer steps fp32 copies of bf16 weights (`plan --bf16-weights`, as train runs them);
    `fp32_grads`: their gradients are fp32 (`plan --fp32-grads`)."""
    from dataclasses import replace

    from octopipe.api import _optimizer_memory
    from octopipe.simulator import MemoryModel

    if graph is not None and graph.module is not None:
        memory = _optimizer_memory(optimizer, graph.module, costs, MemoryModel(), shards, price_step, master_weights,
                                   fp32_grads)
    else:
        memory = MemoryModel.for_optimizer(optimizer, shards, price_step=price_step, master_weights=master_weights,
                                           fp32_grads=fp32_grads)
    return replace(memory, overlap_param_gather=overlap and shards > 1)


def _runtime_profiled(args: argparse.Namespace, cluster: Any, model: Any, inputs: Any, target: Any,
                      loss_fn: Any) -> tuple[Any, Any]:
    """`train --profile` on CPU processes (local, or rank 0 under torchrun, on new processes of its
    node while the others wait): (cluster, costs) measured as the demo measures them. Timing each
    layer alone (`costs="profile"`) and pricing no host time predicted small CPU models' steps
    about 2x fast (llama tiny: 12.7 ms against 27.5 measured); here the link and the runtime's
    per-op host time are measured (`calibrate_cpu_cluster`, into `cluster`'s other figures), and
    every layer and message is timed inside pipelined steps on one pipeline's processes
    (`bench.runtime_probe`)."""
    from octopipe.bench import calibrate_cpu_cluster, runtime_probe

    devices = cluster.num_devices // args.data_parallel
    if not args.quiet:
        print(f"profiling: the link and the runtime's per-op time, then every layer inside pipelined steps on "
              f"{devices} process{'es' if devices > 1 else ''} ...", file=sys.stderr)
    probe = runtime_probe(model, inputs, target, loss_fn, args.microbatches, num_procs=devices, autocast=args.autocast)
    if len(probe.sizes) < devices:  # the planner refuses it (every device needs a layer): say so before measuring
        return cluster, probe.sizes
    measured = calibrate_cpu_cluster(cluster.num_devices, base=cluster)
    profile = probe.run(inputs, target, op_overhead_ms=measured.op_overhead_ms)
    return profile.calibrate(measured), profile.costs


def _fastest_measured(pipe: Any, args: argparse.Namespace, model: Any, inputs: Any, target: Any, loss_fn: Any) -> Any:
    """The fastest, measured on these processes, of the planner's plan and its runners-up
    (`--candidates` in all), each run for a few steps in turn without updating the model."""
    import octopipe
    from octopipe.api import RUNNER_UP_MARGIN
    from octopipe.bench import measure_many

    plans = [pipe.plan, *pipe.runners_up][:args.candidates]
    if len(plans) == 1:
        print(f"note: the planner found no runner-up within {RUNNER_UP_MARGIN:.0%} of its plan; nothing else to measure",
              file=sys.stderr)
        return pipe
    pipes = [pipe] + [octopipe.compile(model, pipe.cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                                       num_microbatches=pipe.num_microbatches, costs=pipe.costs, plan=plan, quiet=True,
                                       autocast=pipe.autocast, data_parallel=pipe.data_parallel,
                                       memory=pipe.simulation.memory, shard_optimizer=pipe.shard_optimizer,
                                       overlap_param_gather=pipe.overlap_param_gather,
                                       master_weights=pipe.master_weights, fp32_grads=pipe.fp32_grads,
                                       loss_weight=pipe.loss_weight)
                      for plan in plans[1:]]
    timings = measure_many(pipes, inputs, target, steps=CANDIDATE_STEPS, warmup=1, rewarm=True)
    fastest = min(range(len(pipes)), key=lambda k: timings[k].median_ms)
    print(f"measured {len(pipes)} plans, {CANDIDATE_STEPS} steps each (no update):")
    for index, (candidate, timing) in enumerate(zip(pipes, timings)):
        label = "the planner's plan" if index == 0 else f"runner-up {index}"
        print(f"  {label:<20} {candidate.plan.num_stages:>3} stages, placement {list(candidate.plan.placement)}: "
              f"predicted {candidate.simulation.iteration_ms:8.1f} ms, measured {timing.median_ms:8.1f} ms"
              f"{'  <- fastest, trained' if index == fastest else ''}")
    return pipes[fastest]


CANDIDATE_STEPS = 3
"""Steps each candidate plan runs in `train --candidates` (after one warm-up step)."""


AUTOCAST_CHOICES = ("bf16", "fp16")

DATA_DTYPES = ("uint16", "uint32", "int32", "int64")
"""`--data-dtype`'s choices: `octopipe.data.DTYPES`, named here so that the parser does not
import numpy and torch."""
DATA_SEED = 1234
"""`--data-seed`'s default (Megatron's --seed)."""
EVAL_ITERS = 4
"""`--eval-iters`' default."""


def _check_data_flags(args: argparse.Namespace) -> None:
    """--data's and --eval-data's companions given without them, refused before any model is
    built; locally, the files must exist (a printed torchrun line's are the cluster's)."""
    from octopipe.errors import OctopipeError

    if args.data is None:
        given = [flag for flag, value in (("--data-dtype", args.data_dtype), ("--data-seed", args.data_seed),
                                          ("--split", args.split), ("--eval-data", args.eval_data),
                                          ("--eod-mask-loss", args.eod_mask_loss)) if value is not None]
        if given:
            raise OctopipeError(f"train {given[0]}: applies to --data FILE (the token ids to train on); give --data "
                                "too")
    if args.data_weights is not None and len(args.data or ()) == 1:
        raise OctopipeError("train --data-weights: blends several --data files; with one there is nothing to weigh")
    if args.data_weights is not None and len(args.data_weights) != len(args.data or ()):
        raise OctopipeError(f"train --data-weights: {len(args.data_weights)} weight(s) for {len(args.data or ())} "
                            "--data file(s); give one weight per file (Megatron's --data-path W1 A W2 B), or none "
                            "to blend them by their sizes")
    if args.split is not None and args.eval_data is not None:
        raise OctopipeError("train: give --eval-data FILE (a validation file) or --split (a validation part of --data), "
                            "not both")
    validates = args.eval_data is not None or (args.split is not None and args.split[1] > 0)
    tests = args.split is not None and len(args.split) > 2 and args.split[2] > 0  # (--eval-iters sizes its evaluation)
    if not validates:
        given = [flag for flag, value in (("--eval-interval", args.eval_interval),
                                          ("--eval-iters", None if tests else args.eval_iters)) if value is not None]
        if given:
            raise OctopipeError(f"train {given[0]}: applies to a validation set; give --eval-data FILE, or --split "
                                "T,V with a validation weight V > 0" if args.split is None else
                                f"train {given[0]}: --split {_weights(args.split)} leaves no validation part; give it "
                                "a validation weight (e.g. 98,2)")
    if not args.torchrun:
        for flag, path in [*(("--data", path) for path in args.data or ()), ("--eval-data", args.eval_data)]:
            if path is not None and not os.path.isfile(path):
                raise OctopipeError(f"train {flag} {path}: no such file; give a file of token ids (a raw binary "
                                    "stream, or a .npy array)")


def _token_data(args: argparse.Namespace, model: Any, inputs: tuple, target: Any, open_files: bool = True,
                scan: bool = True) -> Any:
    """--data's batches (an `octopipe.data.TrainingData`) for this model, None without --data.
    The model must take one tensor of token ids [batch, sequence] and a target of the same shape
    (the next ids); its example batch gives the sequence length and each replica's batch size.
    `open_files=False`: check the model alone (the files are elsewhere). `scan`: read both files
    through once for token ids outside the model's vocabulary (one rank of a job does)."""
    import torch

    from octopipe.errors import OctopipeError

    if args.data is None:
        return None
    ids = inputs[0] if len(inputs) == 1 else None
    integer = [t is not None and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)
               for t in (ids, target)]
    if not (all(integer) and ids.dim() == 2 and tuple(target.shape) == tuple(ids.shape)):
        takes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
        aim = f"{tuple(target.shape)} {str(target.dtype).replace('torch.', '')}" if target is not None else "none"
        raise OctopipeError(f"train --data: --model {args.model} takes inputs {takes} and target {aim}; --data feeds "
                            "token models only: one input of token ids [batch, sequence] and a target of the next ids, "
                            "of the same shape (a model of other inputs trains on its own batches through the API: "
                            "Engine.step(inputs, target))")
    if not open_files:
        return None
    from octopipe.data import BlendedBatches, TokenBatches, TrainingData, split_samples, vocabulary_size

    batch, seq_len = (int(n) for n in ids.shape)
    common: dict[str, Any] = dict(seq_len=seq_len, batch_size=batch, replicas=args.data_parallel,
                                  vocab_size=vocabulary_size(model))

    def raw(path: str) -> str | None:  # --data-dtype is a raw file's; a .npy file names its own
        return None if Path(path).suffix == ".npy" else args.data_dtype

    seed = DATA_SEED if args.data_seed is None else args.data_seed
    trains: list[TokenBatches] = []
    valids: list[TokenBatches] = []
    tests: list[TokenBatches] = []
    for path in args.data:  # each file cut by --split on its own, as Megatron splits each dataset
        whole = TokenBatches(path, seed=seed, dtype=raw(path), what="--data", **common)
        if args.split is None:
            trains.append(whole)
            continue
        parts = split_samples(whole.file_samples, args.split, f"train --split (of {path})")
        trains.append(TokenBatches(path, seed=seed, samples=parts[0], dtype=raw(path), what="--data", **common))
        for held, weight, part, name in ((valids, args.split[1], 1, "validation"),
                                         (tests, args.split[2] if len(args.split) > 2 else 0, 2, "test")):
            if weight > 0:
                held.append(TokenBatches(path, shuffle=False, samples=parts[part], dtype=raw(path),
                                         what=f"--data (its {name} split)", **common))
    valid: Any = (TokenBatches(args.eval_data, shuffle=False, dtype=raw(args.eval_data), what="--eval-data", **common)
                  if args.eval_data else valids[0] if len(valids) == 1 else None)
    test: Any = tests[0] if len(tests) == 1 else None
    train: Any = trains[0]
    if len(trains) > 1:  # a blend by --data-weights, else by the files' sequences
        weights = tuple(args.data_weights) if args.data_weights else tuple(float(t.num_samples) for t in trains)
        train = BlendedBatches(tuple(trains), weights, batch, args.data_parallel, what="--data")
        if valids:
            valid = BlendedBatches(tuple(valids), weights, batch, args.data_parallel, what="--data (its validation splits)")
        if tests:
            test = BlendedBatches(tuple(tests), weights, batch, args.data_parallel, what="--data (its test splits)")
    data = TrainingData(train, valid, args.eval_interval, EVAL_ITERS if args.eval_iters is None else args.eval_iters,
                        eod_mask=args.eod_mask_loss, test=test)
    if scan:
        _scan(data)
    return data


def _scan(data: Any) -> None:
    """One pass over every file of `data`: ids outside the vocabulary refused, and a note for a
    file that never holds the --eod-mask-loss id."""
    for note in data.check_vocabulary():
        print(f"note: train {note}", file=sys.stderr, flush=True)


def _loss_weight(args: argparse.Namespace) -> Any:
    """compile's `loss_weight` for this run: with --eod-mask-loss, the targets that count (so the
    loss is their mean over the whole global batch), else None (each microbatch's mean, equally)."""
    from octopipe import models

    return models.lm_tokens if args.eod_mask_loss is not None else None


def _weights(weights: tuple[float, ...]) -> str:
    return ",".join(f"{w:g}" for w in weights)


def _write_trace(args: argparse.Namespace, timelines: Any, predicted: Any) -> None:
    """--trace: the last step as every rank ran it, beside the prediction (`bench.measured_trace`)."""
    import json

    from octopipe.bench import measured_trace

    Path(args.trace).write_text(json.dumps(measured_trace(timelines, predicted)))
    print(f"trace of step {args.first_step + args.steps - 1} as it ran on {len(timelines)} ranks, beside the predicted "
          f"step, written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)", flush=True)


def _ms(value: float) -> str:
    """Milliseconds to print: one decimal, or three figures below 0.1 ms (a tiny model priced on
    a GPU preset would read 0.0)."""
    return f"{value:.1f}" if value >= 0.1 else f"{value:.3g}"


def _describe_data(data: Any) -> str:
    lines = [f"data: {data.train.describe()}"]
    if data.eod_mask is not None:
        lines.append(f"loss: the targets after each end of document (input token {data.eod_mask}) left out; the mean "
                     "over the rest of the global batch (--eod-mask-loss)")
    if data.valid is not None:
        every = f"every {data.eval_interval} steps and " if data.eval_interval else ""
        lines.append(f"validation: {data.valid.describe()}; the first {data.eval_iters} "
                     f"batch{'es' if data.eval_iters > 1 else ''} evaluated {every}after the last step")
    if data.test is not None:  # (--split's test part: evaluated after the last step, as Megatron does)
        batches = data.test_batches
        lines.append(f"test: {data.test.describe()}; " + (
            f"the first {batches} batch{'es' if batches > 1 else ''} evaluated after the last step" if batches else
            f"less than one batch of {data.test.global_batch} sequences, so it is not evaluated (give the --split's "
            "test part a larger share, or use a smaller batch)"))
    return "\n".join(lines)


def _evaluation_line(done: int, loss: float, which: str = "validation") -> str:
    return f"{which} after {done} step{'s' if done != 1 else ''}: loss {loss:.5f}  perplexity {math.exp(min(loss, 700.0)):.5g}"
"""`--autocast` values (octopipe.runtime.amp takes them; importing it here would import torch)."""


def _train_distributed(args: argparse.Namespace) -> int:
    """One rank of a torchrun job: every rank compiles the same model; rank 0's plan is broadcast
    so all ranks run the same one, then each rank runs its engine."""
    from octopipe.runtime import init_from_env

    rank, world_size = init_from_env()
    try:
        return _train_rank(args, rank, world_size)
    finally:
        # failed or not, the rank leaves its group and (run as `python -m octopipe.cli`) ends
        # without the interpreter's teardown, which aborted ranks whose group was still up
        # (see _end_torchrun_rank)
        _leave_group()


def _leave_group() -> None:
    """Destroy this torchrun rank's process group if it is still up, and mark the rank done."""
    import torch.distributed as dist

    global _TORCHRUN_RANK_DONE
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass
    _TORCHRUN_RANK_DONE = True


def _train_rank(args: argparse.Namespace, rank: int, world_size: int) -> int:
    """The body of `_train_distributed` on an initialized group."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    import octopipe
    from octopipe import models
    from octopipe.bench import (
        attached_optimizer,
        loop_state,
        resume_keeping_settings,
        save_path,
        set_learning_rate,
        timeline_entries,
    )
    from octopipe.ir.plan import PipelinePlan
    from octopipe.runtime.amp import LossScaler

    exit_check = _exit_check(args)
    if exit_check is not None:  # (its clock, and a SIGTERM from now on stops the run after a step)
        exit_check.start()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cluster = _cluster(args, default=f"h100x{world_size}", devices=world_size, flag="the job's world size", whole="train")
    model, inputs, target, loss_fn = _load_model(args)
    _need_target(args, target)
    # a model built on the meta device (--size paper, or a factory's) is traced on meta examples
    # and each rank creates only its own stages, on its own GPU
    on_meta = any(param.is_meta for param in model.parameters())
    if on_meta:
        inputs, target = _real_batch(args, inputs, target)
    examples, example_target = _examples(inputs, target, on_meta)
    data = _token_data(args, model, inputs, target, scan=False)
    plan_text: list[Any] = [None]
    first = None
    board: Any = None
    if rank == 0:
        try:
            board = _Board(args, data)
            if data is not None:  # (a pass over the files: on one rank, before any trains)
                _scan(data)
            planning, costs = cluster, "profile" if args.profile else "analytic"
            if args.profile and device.type == "cpu" and not on_meta:
                # CPU ranks: measured inside pipelined steps on processes of this node, as local
                # train measures them (each layer timed alone misses the runtime's host time)
                planning, costs = _runtime_profiled(args, cluster, model, examples, example_target, loss_fn)
            elif args.profile:  # costs measured where the ranks run: this rank's GPU
                model, examples, example_target = _on_profiling_device(model, examples, example_target)
            first = octopipe.compile(model, planning, example_inputs=examples, example_target=example_target,
                                     loss_fn=loss_fn, num_microbatches=args.microbatches, plan=args.plan,
                                     costs=costs, schedule=args.schedule,
                                     time_limit_s=args.time_limit or 10.0, effort=args.effort or 1.0, quiet=args.quiet,
                                     autocast=args.autocast, data_parallel=args.data_parallel,
                                     optimizer=args.optimizer, shard_optimizer=args.shard_optimizer,
                                     overlap_param_gather=args.overlap_param_gather,
                                     master_weights=_master_weights(args), fp32_grads=args.fp32_grads,
                                     loss_weight=_loss_weight(args))
            plan_text = [str(first.plan)]
        except Exception:
            # the other ranks wait in the broadcast: tell them, so that they stop with one line
            # each rather than a traceback of the group rank 0 leaves
            dist.broadcast_object_list([RANK0_FAILED], src=0)
            raise
    dist.broadcast_object_list(plan_text, src=0)
    if plan_text[0] == RANK0_FAILED:
        # rank 0's error is the job's: this rank leaves quietly, so that torchrun names rank 0's
        # failure (and its exit code) as the root cause
        print(f"note: rank {rank}: rank 0 failed before training (its error says why); this rank ran nothing",
              file=sys.stderr)
        return EXIT_OK
    pipe = octopipe.compile(model, cluster, example_inputs=examples, example_target=example_target, loss_fn=loss_fn,
                            num_microbatches=args.microbatches, plan=PipelinePlan.parse(plan_text[0]), quiet=True,
                            autocast=args.autocast, data_parallel=args.data_parallel, optimizer=args.optimizer,
                            shard_optimizer=args.shard_optimizer,
                            overlap_param_gather=args.overlap_param_gather,
                            master_weights=_master_weights(args), fp32_grads=args.fp32_grads,
                            loss_weight=_loss_weight(args))
    if rank == 0:
        _note_one_replica_shard(pipe)
    init: Any = args.init or args.resume  # (--resume: the weights from it here, the rest after the optimizer)
    if init is None and on_meta and args.model in models.MODEL_NAMES:
        torch.manual_seed(rank // args.data_parallel)  # each pipeline rank draws its own stages' weights
        init = models.init_module
    else:
        # as local train seeds its engines (bench._train_worker): the stages' dropout streams
        # derive from it, so both draw the same masks whatever the factory seeded last
        torch.manual_seed(0)
    scaling = _loss_scaling(args)
    engine = pipe.engine(rank, device=device, init=init, loss_scaler=LossScaler(**scaling) if scaling else None)
    inputs = tuple(t.to(device) for t in inputs)
    target = target.to(device) if target is not None else None
    optimizer = attached_optimizer(engine, args.optimizer, args.lr, attach=bool(args.resume or args.save),
                                   options=_optimizer_options(args))
    schedule = _lr_schedule(args)
    if args.async_save:  # (its writer process started now, beside the first steps, not at the first save)
        engine.start_checkpoint_writer()
    if args.resume:
        extra, note = resume_keeping_settings(engine, optimizer, args.resume, scheduled=schedule is not None)
        if note and rank == 0:
            print(f"note: train {note}", file=sys.stderr, flush=True)
        args.first_step = _resumed_iteration(extra, args.resume)
        if data is not None:
            note = data.resume(extra, f"train --resume {args.resume}")
            if note and rank == 0:
                print(f"note: {note}", file=sys.stderr)
    if first is not None:
        print(first.dump("plan"), flush=True)
        if data is not None:
            print(_describe_data(data), flush=True)
            if data.consumed:
                print(f"data: resumed after the checkpoint's {data.consumed:,} sequences", flush=True)
    step_ms = []
    log = _StepLog(args, data)
    traced: list[Any] = [()]
    stopped = None
    held = 0
    if args.measure_activations:
        engine.measure_activations()
    for step in range(args.steps):
        if data is not None:  # (each replica its share of the step's batch)
            inputs, target = data.batch(step, engine.replicas.replica)
        record = args.trace and step == args.steps - 1
        engine.timeline = [] if record else None
        start = time.perf_counter()
        loss = engine.step(inputs, target)
        if record:
            traced = [timeline_entries(engine.timeline or [], start)]
            engine.timeline = None
        norm = None
        if args.clip_grad is not None:
            norm = engine.clip_grad_norm_(args.clip_grad)  # collective: every rank, with or without parameters
        if optimizer is not None:
            if schedule is not None:
                set_learning_rate(optimizer, schedule(args.first_step + step))
            optimizer.step()
            engine.zero_grad()  # (the weights' gradients: with --bf16-weights the optimizer holds their copies)
        step_ms.append((time.perf_counter() - start) * 1e3)
        if args.measure_activations:
            held = max(held, engine.activation_peak_bytes)
        done = args.first_step + step + 1
        # (collective where it asks the time or a signal: every rank, after every step but the last)
        stopped = exit_check.reason(done, device) if exit_check is not None and step + 1 < args.steps else None
        line = log.line(step, loss, step_ms[-1], engine.skipped_step,
                        engine.loss_scaler.scale if engine.loss_scaler else None, stopping=stopped is not None,
                        grad_norm=norm)
        if line and rank == 0:
            print(line, flush=True)
        if board is not None:
            board.step(done, loss, step_ms[-1], _step_lr(args, schedule, step),
                       engine.loss_scaler.scale if engine.loss_scaler else None, norm)
        if _saves_at(args, step) or (stopped and args.save):
            # (collective: gathered to rank 0, which writes it; or each rank's own shard)
            engine.save_checkpoint(save_path(args.save, done), sharded=args.save_sharded, background=args.async_save,
                                   extra=loop_state(done, data, step + 1))
        if data is not None and data.evaluates_after(done, args.first_step + args.steps):
            loss = data.evaluate(engine)  # (collective)
            if rank == 0:
                print(_evaluation_line(done, loss), flush=True)
                board.evaluation(done, loss)
        if stopped:
            break
    if data is not None and data.test_batches and not stopped:  # (collective)
        loss = data.evaluate(engine, data.test, data.test_batches)
        if rank == 0:
            print(_evaluation_line(args.first_step + args.steps, loss, "test"), flush=True)
            board.evaluation(args.first_step + args.steps, loss, "test")
    if board is not None:
        board.close()
    engine.finish_checkpoint()  # (a background save's index: collective)
    if args.trace and not stopped:  # (collective: every rank's timeline to rank 0, which writes the file)
        timelines: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(traced[0], timelines, dst=0)
        if first is not None and timelines is not None:
            _write_trace(args, timelines, first.simulation)
    if first is not None:
        print(f"median step {statistics.median(step_ms):.1f} ms on rank 0 (predicted "
              f"{_ms(first.simulation.iteration_ms)} ms from {'profiled' if args.profile else 'analytic'} costs)",
              flush=True)
    if args.measure_activations:  # (collective: every rank's peak to rank 0)
        peaks: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(held, peaks, dst=0)
        if first is not None and peaks is not None:
            print(_activations_line(peaks, first), flush=True)
    if rank == 0:
        _print_end(args, args.first_step + len(step_ms), stopped)
    dist.barrier()  # every rank done before any tears its group down (_train_distributed)
    return EXIT_OK


RANK0_FAILED = "rank 0 failed"
"""What rank 0 of a torchrun `train` broadcasts in place of the plan when it cannot make one."""


def _real_batch(args: argparse.Namespace, inputs: tuple, target: Any) -> tuple[tuple, Any]:
    """The training batch for a model built on the meta device: a built-in model's example batch
    made on the CPU; a factory must return real inputs (only the model may be on meta), and its
    weights come from --init (each rank loads its stages' share)."""
    import torch

    from octopipe import models
    from octopipe.errors import OctopipeError

    if args.model in models.MODEL_NAMES:
        with torch.device("cpu"):
            inputs, target = _builtin_batch(args)
        return _inputs_dtype(args, inputs), target
    if any(t.is_meta for t in (*inputs, *([target] if target is not None else []))):
        raise OctopipeError(f"--model {args.model}: the factory's inputs are on the meta device; return a real "
                            "batch (the model alone may be on meta)")
    if not args.init:
        raise OctopipeError(f"train --model {args.model}: the factory's model is on the meta device, which holds no "
                            "weights; give --init CHECKPOINT (each rank loads its own stages' weights from it) or "
                            "build the model on a real device")
    return inputs, target


def torchrun_command(args: argparse.Namespace) -> str:
    """The torchrun line that runs this training on a real cluster (one process per GPU), with
    every option given (checked here as a local run would check them)."""
    import shlex

    from octopipe import models

    builtin = args.model in models.MODEL_NAMES
    if builtin:
        _overrides(args.model, args.size, args.set)  # unknown fields and wrong types fail here, not on every rank
    else:
        _factory_options(args)
    per_node = _check_before_launch(args, builtin)
    words = ["-m", "octopipe.cli", "train", "--model", args.model]
    if builtin:
        words += ["--size", args.size, "--batch-size", str(args.batch_size)]
        words += [word for item in args.set or () for word in ("--set", item)]
        words += ["--seq-len", str(args.seq_len)] if args.seq_len else []
    for flag, value in (("--plan", args.plan), ("--schedule", args.schedule), ("--init", args.init),
                        ("--data", args.data),
                        ("--data-weights", [f"{w:g}" for w in args.data_weights] if args.data_weights else None),
                        ("--data-dtype", args.data_dtype), ("--data-seed", args.data_seed),
                        ("--split", _weights(args.split) if args.split else None),
                        ("--eval-data", args.eval_data), ("--eval-interval", args.eval_interval),
                        ("--eval-iters", args.eval_iters), ("--eod-mask-loss", args.eod_mask_loss),
                        ("--trace", args.trace),
                        ("--resume", args.resume), ("--save", args.save), ("--save-interval", args.save_interval),
                        ("--log-interval", args.log_interval),
                        ("--tensorboard-dir", args.tensorboard_dir), ("--exit-interval", args.exit_interval),
                        ("--exit-duration-in-mins", args.exit_duration_in_mins),
                        ("--cluster", args.cluster), ("--time-limit", args.time_limit), ("--effort", args.effort)):
        if value is not None:
            words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    words += ["--microbatches", str(args.microbatches), "--steps", str(args.steps), "--lr", str(args.lr),
              "--optimizer", args.optimizer]
    words += ["--clip-grad", str(args.clip_grad)] if args.clip_grad is not None else []
    words += [word for flag, name, _ in OPTIMIZER_FLAGS if getattr(args, name) is not None
              for word in (flag, str(getattr(args, name)))]
    words += ["--lr-warmup-iters", str(args.lr_warmup_iters)] if args.lr_warmup_iters else []
    if args.lr_decay_style != "constant":
        words += ["--lr-decay-style", args.lr_decay_style, "--lr-decay-iters", str(args.lr_decay_iters)]
    words += ["--min-lr", str(args.min_lr)] if args.min_lr else []
    words += ["--autocast", args.autocast] if args.autocast else []
    words += [word for flag, name, _ in LOSS_SCALING if getattr(args, name) is not None
              for word in (flag, str(getattr(args, name)))]
    # the replica count travels whenever it is not 1 or a plan file's own count would replace it
    words += ["--data-parallel", str(args.data_parallel)] if args.data_parallel > 1 or args.plan else []
    words += [flag for flag, on in (("--shard-optimizer", args.shard_optimizer),
                                    ("--overlap-param-gather", args.overlap_param_gather),
                                    ("--bf16-weights", args.bf16_weights), ("--fp16-weights", args.fp16_weights),
                                    ("--grad-reduce-in-bf16", args.grad_reduce_in_bf16),
                                    ("--save-sharded", args.save_sharded), ("--async-save", args.async_save),
                                    ("--exit-signal-handler", args.exit_signal_handler),
                                    ("--measure-activations", args.measure_activations),
                                    ("--profile", args.profile),
                                    ("--quiet", args.quiet)) if on]
    nodes, per_node = max(1, -(-args.nprocs // per_node)), min(args.nprocs, per_node)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint $MASTER_ADDR:29500 {shlex.join(words)}")


PLAN_CHECK_EFFORT = 1e-6
"""The planner's effort where `train --torchrun` compiles the model before printing the line:
the baselines and the first plans of the search, not the whole search rank 0 runs."""


def _check_before_launch(args: argparse.Namespace, builtin: bool) -> int:
    """What every rank would refuse at its start, refused here, before a cluster's worth of
    processes is launched: the schedule name, the model, its batch and its target, and, where the
    files are on this machine too, the cluster spec and a plan that does not fit the model or its
    microbatches, then the whole compile as rank 0 will run it (its search cut short). A file
    that is not here is left to the ranks, which may see it where they run: a note says so.
    Returns the processes torchrun starts on each node."""
    from octopipe import schedules
    from octopipe.cluster import ClusterSpec
    from octopipe.errors import OctopipeError

    missing = [f"{flag} {path}" for flag, path in (("--cluster", args.cluster), ("--plan", args.plan),
                                                    ("--init", args.init),
                                                    *(("--data", path) for path in args.data or ()),
                                                    ("--eval-data", args.eval_data))
               if path and not Path(path).exists() and (flag != "--cluster" or ClusterSpec.names_file(path))]
    if missing:
        print(f"note: {', '.join(missing)}: not on this machine, so not checked here; every rank reads it where it "
              "runs", file=sys.stderr)
    cluster = None
    if f"--cluster {args.cluster}" not in missing:
        cluster = _cluster(args, default=f"h100x{args.nprocs}", devices=args.nprocs, flag="--nprocs", whole="train")
    # torchrun starts as many processes on every node: the cluster's nodes (8 GPUs a node where
    # its spec is not on this machine)
    per_node = cluster.devices_per_node if cluster is not None else 8
    if args.nprocs > per_node and args.nprocs % per_node:
        raise OctopipeError(f"--nprocs {args.nprocs}: torchrun starts as many processes on every node (of "
                            f"{per_node} GPUs{f' in {args.cluster}' if cluster is not None and args.cluster else ''}); "
                            f"use {per_node} or fewer, or a multiple of {per_node}")
    if args.schedule and args.schedule not in schedules.NAMES:
        raise OctopipeError(f"--schedule {args.schedule!r}: not a baseline schedule; use one of "
                            f"{', '.join(schedules.NAMES)}")
    if builtin and args.batch_size % args.microbatches:
        raise OctopipeError(f"--batch-size {args.batch_size}: not a multiple of --microbatches {args.microbatches} "
                            "(each microbatch takes an equal share of the batch)")
    model, inputs, target, loss_fn = _load_model(args)  # config fields and values the model refuses
    _need_target(args, target)
    _check_profilable(args, model, "rank 0 then plans with analytic costs")
    on_meta = any(param.is_meta for param in model.parameters())
    if on_meta:
        inputs, target = _real_batch(args, inputs, target)
    examples, example_target = _examples(inputs, target, on_meta)
    _token_data(args, model, inputs, target,
                open_files=not any(item.startswith(("--data ", "--eval-data ")) for item in missing))
    plan_ = None
    if args.plan and f"--plan {args.plan}" not in missing:
        from octopipe.api import _warn_planned_elsewhere, load_saved_plan
        from octopipe.passes.codegen import microbatch
        from octopipe.passes.trace import trace

        plan_ = load_saved_plan(args.plan).plan
        if plan_.num_microbatches != args.microbatches:
            raise _other_microbatches(args.microbatches, args.plan, plan_.num_microbatches)
        graph = trace(model, examples, loss_fn=loss_fn, example_target=example_target)
        layers = len(graph.layers)
        if layers != plan_.num_layers:
            raise _other_layers(f"--plan {args.plan}", plan_.num_layers, f"--model {args.model}", layers,
                                f"plan this model (octopipe plan --model {args.model} -o ...)")
        # what compile warns about on every rank, said once here (--torchrun only prints the line)
        _warn_planned_elsewhere(args.plan, graph.model, layers, microbatch(inputs, args.microbatches), args.microbatches,
                                where=f"--plan {args.plan}")
    if cluster is not None and (plan_ is not None or not args.plan):
        _check_compiles(args, cluster, model, examples, example_target, loss_fn, plan_)
    return per_node


def _examples(inputs: tuple, target: Any, on_meta: bool) -> tuple[tuple, Any]:
    """The example batch a model is traced on: on the meta device where the model is."""
    if not on_meta:
        return inputs, target
    return tuple(t.to("meta") for t in inputs), (target.to("meta") if target is not None else None)


def _check_compiles(args: argparse.Namespace, cluster: Any, model: Any, examples: tuple, example_target: Any,
                    loss_fn: Any, plan: Any) -> None:
    """Compiled here as rank 0 will compile it, on the cluster the ranks take (with analytic
    costs), so a schedule the ranks could not build (too few microbatches or layers for its family
    on this many ranks per replica), a batch that does not split into the microbatches, more
    ranks than layers and replicas the cluster cannot hold are refused before launch. Where rank 0
    plans, the search here is cut to its first steps (`PLAN_CHECK_EFFORT`): its memory verdict is
    left to rank 0's whole search, which may find a plan where the first steps find none."""
    import octopipe
    from octopipe.errors import InfeasibleError

    try:
        octopipe.compile(model, cluster, example_inputs=examples, example_target=example_target, loss_fn=loss_fn,
                         num_microbatches=args.microbatches, plan=plan, schedule=args.schedule, quiet=True,
                         effort=PLAN_CHECK_EFFORT, autocast=args.autocast, data_parallel=args.data_parallel,
                         optimizer=args.optimizer, shard_optimizer=args.shard_optimizer,
                            overlap_param_gather=args.overlap_param_gather,
                            master_weights=_master_weights(args), fp32_grads=args.fp32_grads)
    except InfeasibleError:
        if plan is not None or args.schedule:
            raise


def cmd_dump(args: argparse.Namespace) -> int:
    import octopipe
    from octopipe.errors import OctopipeError

    if args.all is not None and args.level:
        raise OctopipeError("dump: --all writes every level; give --all DIR or --level LEVEL, not both")
    _writable(args.all, "--all", directory=True)
    cluster = _cluster(args, default="cpux2", whole="dump")
    model, inputs, target, loss_fn = _load_model(args)
    schedule = args.schedule or (None if args.plan else "1f1b")  # a given plan, else 1F1B unless named
    pipe = octopipe.compile(model, cluster, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                            num_microbatches=args.microbatches, plan=args.plan, schedule=schedule, quiet=True,
                            autocast=args.autocast)
    if args.all is not None:
        try:
            paths = pipe.dump_all(args.all)
        except OSError as exc:
            raise _write_error(args.all, exc) from None
        for path in paths:
            print(path)
    else:
        print(pipe.dump(args.level or "plan"), end="")
    return EXIT_OK


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def cmd_tokenize(args: argparse.Namespace) -> int:
    import signal

    from octopipe.data import tokenize_files
    from octopipe.errors import OctopipeError

    _writable(args.output, "-o")
    eod: int | str | None = args.eod
    if eod is not None and eod != "eos":
        try:
            eod = int(eod)
        except ValueError:
            raise OctopipeError(f"tokenize --eod {args.eod}: give a token id (an integer >= 0) or eos") from None
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # (a SIGTERM ends it through its cleanup)
        signal.signal(signal.SIGTERM, _exit_on_signal)
    done = tokenize_files(args.inputs, args.output, tokenizer=args.tokenizer, eod=eod, json_key=args.json_key,
                          workers=args.workers)
    raw = not args.output.endswith(".npy") and done.dtype != "uint16"
    print(f"tokenized {done.documents:,} document{'s' if done.documents != 1 else ''} into {done.tokens:,} {done.dtype} "
          f"tokens (a vocabulary of {done.vocab_size:,}) in {args.output}: train --data {args.output}"
          + (f" --data-dtype {done.dtype}" if raw else "")
          + " with a model of at least that vocabulary")
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """`octopipe checkpoint PATH`: what a checkpoint (a file, or a sharded directory) holds; with
    `-o OUT` write it as one gathered file (`--weights-only`: the plain model's state dict,
    `--fp32`: the fp32 master copies where it holds them, the weights' own values elsewhere)."""
    import torch

    from octopipe.errors import OctopipeError
    from octopipe.runtime import atomic_save
    from octopipe.runtime.engine import MASTER_KEY, saved_master
    from octopipe.runtime.materialize import checkpoint_state

    if (args.weights_only or args.fp32) and args.output is None:
        raise OctopipeError("checkpoint: --weights-only and --fp32 choose what -o OUT holds; give -o OUT too")
    if args.fp32 and not args.weights_only:
        raise OctopipeError("checkpoint --fp32: the fp32 copies replace the weights in a plain state dict; give "
                            "--weights-only too (a whole checkpoint keeps both already)")
    from octopipe.errors import ExecutionError

    _writable(args.output, "-o")
    sharded = os.path.isdir(args.path)
    try:
        state = checkpoint_state(args.path, 0)
    except ExecutionError as exc:  # a bad path given on the command line, not a failed run
        raise OctopipeError(f"checkpoint {args.path}: {str(exc).removeprefix('rank 0: ')}") from None
    if state is None:  # ("reset" names no checkpoint)
        raise OctopipeError(f"checkpoint {args.path}: not a checkpoint path")
    model = {name: value for name, value in state["model"].items() if isinstance(value, torch.Tensor)}
    optimizer = state.get("optimizer")
    entries = optimizer.get("state", {}) if isinstance(optimizer, dict) else {}
    masters = sorted(name for name, entry in entries.items() if isinstance(entry, dict) and MASTER_KEY in entry)
    if args.output is None:
        if sharded:
            from octopipe.runtime.materialize import sharded_index

            index = sharded_index(args.path, 0)  # (checked by checkpoint_state above)
            print(f"{args.path}: a sharded checkpoint, {len(index['files'])} shards written by {index['world_size']} "
                  "ranks")
        else:
            print(f"{args.path}: a checkpoint file")
        by_dtype: dict[str, int] = {}
        for value in model.values():
            key = str(value.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + value.numel()
        print(f"model: {len(model)} tensors, " + ", ".join(f"{count:,} {dtype}" for dtype, count in
                                                          sorted(by_dtype.items())))
        if isinstance(optimizer, dict):
            groups = optimizer.get("param_groups", [])
            keys = sorted({key for entry in entries.values() if isinstance(entry, dict) for key in entry
                           if key != MASTER_KEY})
            kind = f"{optimizer['class']}: " if isinstance(optimizer.get("class"), str) else ""
            print(f"optimizer: {kind}state for {len(entries)} parameters ({', '.join(keys) or 'none'}), {len(groups)} "
                  f"param group(s)" + (f"; fp32 master copies of {len(masters)}" if masters else ""))
        else:
            print("optimizer: none (a checkpoint of weights only)")
        if "loss_scaler" in state:
            print(f"loss scale: {state['loss_scaler'].get('scale')}")
        if state.get("random"):
            print(f"dropout streams: {len(state['random'])} stage(s)")
        if isinstance(state.get("extra"), dict):  # (numbers and strings shown, the rest named)
            print("the loop's own state: " + (", ".join(
                f"{key} {value}" if isinstance(value, (int, float, str)) else str(key)
                for key, value in state["extra"].items()) or "none"))
        return EXIT_OK
    if args.weights_only:
        out: Any = {name: (saved_master(state, name) if args.fp32 and name in masters else value)
                    for name, value in model.items()}
        what = f"{len(out)} tensors" + (f", {len(masters)} of them the fp32 copies" if args.fp32 else "")
    else:
        out = state
        what = "the whole state"
    try:
        atomic_save(out, args.output)
    except OSError as exc:
        raise _write_error(args.output, exc) from None
    print(f"wrote {args.output}: {what}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="octopipe", description="Pipeline-parallel training compiler: joint partition, placement and schedule.",
        epilog="Exit codes: 0 ok, 1 error, 2 usage, 3 infeasible, 4 invalid plan, 5 execution error.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="plan a heterogeneous model for 2 CPU processes, train it, compare with the best baseline")
    p.add_argument("--out", default="octopipe-demo", help="folder for the timeline pictures and plans (created with any missing parents)")
    p.add_argument("--steps", type=_positive_int, default=8, help="measured training steps per plan")
    p.add_argument("--time-limit", type=_positive_float, default=20.0, help="planner time limit in seconds")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (for tests)")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("plan", help="search the best plan for a cost table or a model")
    _add_costs_options(p)
    _add_cluster_options(p)
    p.add_argument("--microbatches", type=_positive_int, default=16, help="microbatches per step (default 16)")
    p.add_argument("--time-limit", type=_positive_float, default=60.0,
                   help="seconds for the whole planning (default 60): tracing and costing a --model, then the search "
                        "in what is left (at least a tenth)")
    p.add_argument("--activation-limit", type=_activation_limit_arg, default=None, metavar="GiB|1f1b|none",
                   help="cap on activation memory per device (GiB), or 1f1b: what the 1F1B baselines' busiest device "
                        "holds (default none: only the device memory)")
    p.add_argument("--memory-limit", type=_positive_float, default=None, metavar="GiB", help="device memory (default: the cluster's)")
    p.add_argument("--no-solver", action="store_true", help="skip the CP-SAT refinement")
    p.add_argument("--min-gain", type=_percent, default=0.0, metavar="PCT",
                   help="return the best baseline that fits unless the searched plan is at least PCT%% faster on paper")
    p.add_argument("--no-recompute", action="store_true",
                   help="never recompute activations, fully or selectively (by default the search may, where memory "
                        "holds microbatches back)")
    p.add_argument("--data-parallel", type=_replicas_arg, default=None, metavar="D|auto",
                   help="plan one of D replicas over the cluster's devices (default 1, or a --cluster spec's own "
                        "data_parallel, which describes one replica; each device's gradients all-reduced "
                        "over its D copies every step, in the plan's time; --microbatches is then each replica's); "
                        "auto: plan every count that divides the devices and --microbatches (the whole batch's), "
                        "keep the fastest step")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="mixed-adam",
                   help="the optimizer the job steps, for the memory limit: what each device holds per byte of "
                        "weights the costs count, on weights held in that dtype (bf16 in the published profiles and "
                        "analytic costs): mixed-adam (default; bf16 weights and gradients, fp32 master copy and "
                        "moments: 8), adamw or adam (two moments: 4), sgd-momentum (3), sgd (2). train sizes it from "
                        "the model's own weights (fp32 AdamW on analytic costs: 8)")
    p.add_argument("--optimizer-shards", type=_positive_int, default=1, metavar="N",
                   help="the optimizer's own state split over N data-parallel replicas (ZeRO-1, Megatron's "
                        "distributed optimizer) where the job that runs the plan shards it (default 1); with "
                        "--data-parallel the gradients are priced reduce-scattered onto their shares and each share "
                        "broadcast after the step, as OctoPipe's runtime runs it")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="the optimizer's own state split over the --data-parallel replicas, as train "
                        "--shard-optimizer runs it (ZeRO-1); with --data-parallel auto, each count's replicas hold "
                        "their share, so more replicas hold less each")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="with --shard-optimizer: price the shares' broadcast beside the next step (each stage's first "
                        "forward waits for its own) instead of at the step's end, as train --overlap-param-gather "
                        "runs it (Megatron's --overlap-param-gather)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="the job trains bf16 weights, its optimizer stepping fp32 copies of them (train "
                        "--bf16-weights, Megatron's --bf16): --optimizer's memory counts the copies and its state in "
                        "fp32 (a --model is cast to bf16 first)")
    p.add_argument("--fp32-grads", action="store_true",
                   help="with the default mixed-adam: the gradients are fp32 (Megatron's "
                        "--accumulate-allreduce-grads-in-fp32): 4 bytes a weight in memory (mixed-adam 18 bytes a "
                        "weight, not 16) and twice the bytes in every gradient reduction; --bf16-weights implies it "
                        "unless --grad-reduce-in-bf16 is given")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16-weights: the gradients stay bf16, as train --grad-reduce-in-bf16 runs them "
                        "(Megatron's flag of that name)")
    p.add_argument("--fp16-weights", action="store_true",
                   help="the job trains fp16 weights with fp32 copies and fp32 gradients (train --fp16-weights, "
                        "Megatron's --fp16): the memory of --bf16-weights --fp32-grads (a --model is cast to fp16 "
                        "first)")
    p.add_argument("--price-optimizer-step", action="store_true",
                   help="price each device's optimizer step: its state's traffic (--optimizer's; 28 bytes a weight "
                        "for Adam, 1/D of it sharded) at the cluster's memory bandwidth, after its last gradient "
                        "reduction (off by default: the step is not priced)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--effort", type=_effort, default=1.0,
                   help="scale the search's work budget (tuner and CP-SAT; default 1): the plan depends on the input, "
                        "--effort and --seed, not on the machine, unless --time-limit cuts the search short")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan (.json, or the text form otherwise)")
    p.add_argument("--runners-up", action="store_true",
                   help="also write the planner's runners-up (other shapes predicted within 10%%) as "
                        "PLAN.runner-up-N.json, to measure beside the plan (train --plan)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("simulate", help="simulate a plan file on a cost table")
    p.add_argument("plan", help="plan file (.json or text form)")
    _add_costs_options(p)
    _add_cluster_options(p)
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="(for --model costs) microbatches of the batch; default and only value: the plan's")
    p.add_argument("--blocking-sends", action="store_true", help="senders wait for their sends (no overlap)")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.set_defaults(run=cmd_simulate)

    p = sub.add_parser("show", help="draw the timeline of one plan, or several on one time axis")
    p.add_argument("plans", nargs="+", help="plan files")
    _add_costs_options(p)
    _add_cluster_options(p)
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="(for --model costs) microbatches of the batch; default and only value: the plan's")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG or SVG")
    p.add_argument("--title", default=None)
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("train", help="train a model with a plan on local processes (or print the torchrun line)")
    p.add_argument("--model", required=True, metavar="NAME|module:factory")
    p.add_argument("--size", default=None, choices=("tiny", "paper"))
    p.add_argument("--set", action="append", metavar="FIELD=VALUE")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="default: 8 rounded up to a multiple of the microbatches")
    p.add_argument("--seq-len", type=_positive_int, default=None)
    p.add_argument("--nprocs", type=_positive_int, default=None,
                   help="local processes (devices; default: the plan's with --plan, else 2); with --torchrun, GPUs in all")
    p.add_argument("--microbatches", type=_positive_int, default=None, help="default: the plan's (with --plan), else 4")
    p.add_argument("--plan", metavar="FILE", help="a saved plan (default: plan now)")
    p.add_argument("--schedule", metavar="NAME", help="run a baseline schedule instead (1f1b, zb-v, ...)")
    p.add_argument("--steps", type=_positive_int, default=5)
    p.add_argument("--global-batch-size", type=_positive_int, default=None, metavar="G",
                   help="with --micro-batch-size, Megatron's way to size a step: G samples a step over all "
                        "--data-parallel replicas, each replica's G / D cut into microbatches of "
                        "--micro-batch-size (sets --batch-size G / D and --microbatches G / (D x b))")
    p.add_argument("--micro-batch-size", type=_positive_int, default=None, metavar="b",
                   help="with --global-batch-size: the samples of one microbatch (Megatron's flag)")
    p.add_argument("--trace", metavar="OUT.json", default=None,
                   help="write a Chrome / Perfetto trace of the last step as it ran: every rank's ops and messages "
                        "(ms from the step's start on each rank), beside the plan's predicted step")
    p.add_argument("--log-interval", type=_positive_int, default=None, metavar="N",
                   help="print a step line after every iteration divisible by N (counted on from a --resume "
                        "checkpoint's) and after the last, its loss and time the means over the steps since the line "
                        "before (Megatron's --log-interval; default 1)")
    p.add_argument("--data", metavar="FILE", nargs="+", default=None,
                   help="train on the token ids in FILE instead of the model's one example batch: a raw binary "
                        "stream (uint16 unless --data-dtype, as Megatron's and nanoGPT's preprocessing write) or a "
                        ".npy array, memory-mapped; cut into sequences of --seq-len + 1 tokens (input, and the next "
                        "token as target), shuffled per epoch (--data-seed), each step the next --batch-size per "
                        "replica (every replica its own); a resumed run reads on from its iteration. For token "
                        "models: one input of ids, the next ids as target")
    p.add_argument("--data-weights", type=_positive_float, nargs="+", default=None, metavar="W",
                   help="with several --data files: blend them by these weights, one a file (Megatron's --data-path "
                        "W1 A W2 B; default: by their sequences), each file read in its own order; every 1000 "
                        "sequences take the weights' share of each, rounded")
    p.add_argument("--data-dtype", choices=tuple(DATA_DTYPES), default=None,
                   help="the token type of a raw --data / --eval-data file (default uint16); a .npy file names its own, "
                        "and this does not apply to it")
    p.add_argument("--data-seed", type=_non_negative_int, default=None, metavar="S",
                   help="the shuffle's seed: epoch e's order is a permutation drawn from S + e (default 1234, "
                        "Megatron's --seed)")
    p.add_argument("--split", type=_split_arg, default=None, metavar="T,V[,TEST]",
                   help="with --data: cut its sequences, in file order, into consecutive training, validation and "
                        "test parts by these weights (Megatron's --split, e.g. 98,2 or 949,50,1); the validation "
                        "part is evaluated as --eval-data would be, and the test part once, after the last step, on "
                        "its first --eval-iters batches (as many whole ones as it holds, where fewer), as Megatron "
                        "evaluates its test split")
    p.add_argument("--eval-data", metavar="FILE", default=None,
                   help="with --data: validation tokens; after the last step (and every --eval-interval steps) the "
                        "loss over the first --eval-iters batches of FILE in file order, forwards only with dropout "
                        "off (Engine.evaluate), with its perplexity")
    p.add_argument("--eval-interval", type=_positive_int, default=None, metavar="N",
                   help="with --eval-data: also evaluate after every N-th step, counted over the whole run "
                        "(Megatron's --eval-interval)")
    p.add_argument("--eval-iters", type=_positive_int, default=None, metavar="K",
                   help="with --eval-data or a --split's validation or test part: the batches each evaluation "
                        "reads (default 4; Megatron's --eval-iters)")
    p.add_argument("--eod-mask-loss", type=_non_negative_int, default=None, metavar="ID",
                   help="with --data: leave out of the loss every target whose input token is ID, the end-of-"
                        "document id the data was tokenized with (octopipe tokenize --eod), so no document's first "
                        "token is predicted from the one before it (Megatron's --eod-mask-loss, which takes the "
                        "tokenizer's); the loss is then the mean over the targets that count in the whole global "
                        "batch (Megatron's --calculate-per-token-loss), and so is the validation loss")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate (positive; the peak of a schedule)")
    p.add_argument("--lr-warmup-iters", type=_non_negative_int, default=0, metavar="W",
                   help="warm the learning rate up linearly from 0 to --lr over the first W iterations (Megatron's "
                        "flag; counted on from a --resume checkpoint's iteration)")
    p.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="after the warm-up, decay the learning rate to --min-lr at --lr-decay-iters (Megatron's "
                        "flag; default constant)")
    p.add_argument("--lr-decay-iters", type=_positive_int, default=None, metavar="D",
                   help="the iteration where a linear or cosine decay reaches --min-lr (it stays there after)")
    p.add_argument("--min-lr", type=_non_negative_float, default=0.0, help="the learning rate a decay ends at")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--weight-decay", type=_non_negative_float, default=None, metavar="WD",
                   help="weight decay on the parameters of two or more dimensions only (Megatron's flag and rule: "
                        "none on biases and norm weights): decoupled with AdamW, added to the gradient with SGD "
                        "(torch's, as Megatron's SGD); default: torch's (AdamW 0.01 on every parameter, SGD none)")
    p.add_argument("--adam-beta1", type=float, default=None, help="AdamW's beta1 (default 0.9)")
    p.add_argument("--adam-beta2", type=float, default=None, help="AdamW's beta2 (default 0.999)")
    p.add_argument("--adam-eps", type=_positive_float, default=None, help="AdamW's eps (default 1e-8)")
    p.add_argument("--sgd-momentum", type=float, default=None, help="SGD's momentum (default 0)")
    p.add_argument("--clip-grad", type=float, default=None, metavar="NORM",
                   help="clip the gradients' total norm, across ranks, to NORM before each step; each step line "
                        "gives the norm before clipping (Megatron's grad norm)")
    p.add_argument("--profile", action="store_true",
                   help="plan with measured costs: on CPU processes, every layer timed inside pipelined steps "
                        "(under torchrun, on new processes of rank 0's node) and the link and per-op host time "
                        "measured; on GPUs, every layer timed on rank 0's GPU")
    p.add_argument("--autocast", choices=AUTOCAST_CHOICES, default=None,
                   help="mixed precision: every forward under torch.autocast in bfloat16, or float16 with dynamic loss "
                        "scaling (fp32 weights and gradients)")
    p.add_argument("--data-parallel", type=_positive_int, default=None, metavar="D",
                   help="D replicas of the pipeline, gradients summed each step (default: a plan file's count, "
                        "else 1; --nprocs counts all ranks: default 2 x D, or the plan's devices x D)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="split the optimizer's state over the --data-parallel replicas (ZeRO-1, Megatron's "
                        "distributed optimizer): each stage's parameters cut evenly at row boundaries, each replica "
                        "gets the summed gradients of its rows only, steps them and sends them to the others; the "
                        "same updates, 1/D of the state per rank, half the gradient traffic of an all-reduce, and "
                        "the plan's memory limit counts that")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="with --shard-optimizer: leave the shares' broadcast after each step running beside the next "
                        "step, each stage's first forward waiting for its own (Megatron's --overlap-param-gather); "
                        "the same updates, and the plan prices it so")
    p.add_argument("--bf16-weights", action="store_true",
                   help="train the model's weights in bf16, the optimizer stepping fp32 copies of them (Megatron's "
                        "--bf16): forwards and backwards in bf16, the gradients accumulated and summed in fp32 "
                        "(--fp32-grads, unless --grad-reduce-in-bf16), each weight rounded from its copy after "
                        "the step; the plan's memory counts the copies (--init loads the weights, rounded to bf16, and "
                        "starts the copies from the checkpoint's fp32 ones where it holds them)")
    p.add_argument("--fp32-grads", action="store_true",
                   help="with --bf16-weights, which implies it: accumulate the gradients over the microbatches, sum "
                        "them over the ranks and clip them in fp32, the copies stepping them as they are (Megatron's "
                        "--accumulate-allreduce-grads-in-fp32, its default under --bf16); the plan counts 4 bytes "
                        "a weight of gradient and prices the fp32 sums")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16-weights: accumulate, sum and clip the gradients in bf16 instead, the copies "
                        "taking them cast up (Megatron's --grad-reduce-in-bf16): 2 bytes a weight less, half the "
                        "bytes in every gradient reduction, the low bits of each microbatch's gradient lost")
    p.add_argument("--fp16-weights", action="store_true",
                   help="train the model's weights in fp16, the optimizer stepping fp32 copies of them (Megatron's "
                        "--fp16): the loss scaled dynamically (GradScaler's rule, across ranks), the gradients "
                        "accumulated, unscaled, summed and clipped in fp32 (--fp32-grads implied), a step with an "
                        "inf or nan gradient anywhere skipped; the plan's memory counts as for --bf16-weights "
                        "--fp32-grads")
    p.add_argument("--initial-loss-scale", type=_positive_float, default=None, metavar="S",
                   help="with --fp16-weights or --autocast fp16: the dynamic loss scale's start (default 65536, "
                        "GradScaler's; Megatron's --initial-loss-scale); a step whose gradients overflow is skipped "
                        "and the scale halved, which the step's line says")
    p.add_argument("--loss-scale", type=_positive_float, default=None, metavar="S",
                   help="with fp16: a static loss scale (Megatron's --loss-scale): it never changes, and a step whose "
                        "gradients overflow is still skipped")
    p.add_argument("--min-loss-scale", type=_positive_float, default=None, metavar="S",
                   help="with fp16: the dynamic scale never backs off below S (Megatron's --min-loss-scale; default "
                        "none, as GradScaler)")
    p.add_argument("--loss-scale-window", type=_positive_int, default=None, metavar="N",
                   help="with fp16: good steps in a row before the dynamic scale doubles (Megatron's "
                        "--loss-scale-window; default 2000, GradScaler's growth_interval)")
    p.add_argument("--hysteresis", type=_positive_int, default=None, metavar="H",
                   help="with fp16: bad steps since the scale last grew before it backs off (Megatron's "
                        "--hysteresis; default 1, GradScaler's: every bad step); each bad step is skipped")
    p.add_argument("--candidates", type=_positive_int, default=1, metavar="K",
                   help="measure the planner's plan and up to K-1 runners-up (other shapes predicted within 10%%) "
                        "for a few steps each, and train with the fastest")
    p.add_argument("--save", metavar="CHECKPOINT", default=None,
                   help="after the last step, write the engines' checkpoint there (Megatron's --save): the weights by "
                        "the model's names, the optimizer's state, fp32 copies, loss scale and dropout streams, "
                        "gathered to rank 0 (--save-sharded: a directory of a file per rank)")
    p.add_argument("--save-sharded", action="store_true",
                   help="with --save: write a directory where every rank writes its own shard and rank 0 an index, "
                        "nothing gathered (as Megatron's ranks write their own files): for models whose state does "
                        "not fit one process; --resume and --init read either kind, on any plan or rank count")
    p.add_argument("--async-save", action="store_true",
                   help="with --save-sharded: each rank copies its shard into shared memory and a process of its "
                        "own writes it while the next steps run; the save is complete (its index written) at the "
                        "next save or the end (Megatron's --async-save)")
    p.add_argument("--save-interval", type=_positive_int, default=None, metavar="N",
                   help="with --save: also write the checkpoint after every N-th step (Megatron's --save-interval); "
                        "each write replaces the file, atomically, unless PATH holds {step}, which becomes the "
                        "steps done (a file per save)")
    p.add_argument("--measure-activations", action="store_true",
                   help="measure the activation bytes each rank holds for its backward passes (what autograd "
                        "saves, the stage inputs and outputs kept from F to B, what B leaves for W; per storage, "
                        "parameters not counted) and print each rank's most in a step beside the simulation's "
                        "peak for its device (a Python call per saved tensor)")
    p.add_argument("--tensorboard-dir", metavar="DIR", default=None,
                   help="also write the run's scalars to TensorBoard event files in DIR, by iteration, under "
                        "Megatron's names: lm loss, learning-rate, batch-size, iteration-time (s), loss-scale (fp16), "
                        "grad-norm (--clip-grad), "
                        "lm loss validation / test and their ppl (needs the tensorboard package: pip install "
                        "tensorboard; under torchrun rank 0 writes)")
    p.add_argument("--exit-interval", type=_positive_int, default=None, metavar="N",
                   help="stop after the first iteration divisible by N (counted on from a --resume checkpoint's), "
                        "saving the checkpoint there with --save (Megatron's --exit-interval)")
    p.add_argument("--exit-duration-in-mins", type=_positive_float, default=None, metavar="M",
                   help="stop after the first step that ends M minutes after training began, saving the "
                        "checkpoint there with --save; every rank stops after the same step (Megatron's flag)")
    p.add_argument("--exit-signal-handler", action="store_true",
                   help="on a SIGTERM (what a scheduler sends before it ends a job; torchrun passes it to every "
                        "rank, and a local run to its processes), finish the step, save the checkpoint with --save "
                        "and stop; every rank stops after the same step (Megatron's flag)")
    p.add_argument("--resume", metavar="CHECKPOINT", default=None,
                   help="continue from a checkpoint --save wrote (Megatron's --load): the whole state, the "
                        "optimizer's too, on any plan, rank or replica count; --init takes only its weights")
    p.add_argument("--init", metavar="CHECKPOINT", default=None,
                   help="start from this checkpoint (a state dict by the model's names); under torchrun a model "
                        "built on the meta device (--size paper) is created from it on each rank (default there: "
                        "the built-in model's own initialization, drawn per rank)")
    p.add_argument("--time-limit", type=_positive_float, default=None, help="planner seconds (default 10)")
    p.add_argument("--effort", type=_effort, default=None,
                   help="scale the planner's work budget (default 1; see plan --effort)")
    p.add_argument("--cluster", default=None,
                   help="cluster spec for planning (default: cpuxN locally, h100xN under torchrun)")
    p.add_argument("--torchrun", action="store_true", help="print the torchrun command for a GPU cluster instead")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(run=cmd_train, devices=None)

    p = sub.add_parser("dump", help="print an IR level of a compiled model")
    p.add_argument("--model", required=True, metavar="NAME|module:factory")
    p.add_argument("--size", default=None, choices=("tiny", "paper"))
    p.add_argument("--set", action="append", metavar="FIELD=VALUE")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="default: 8 rounded up to a multiple of the microbatches")
    p.add_argument("--seq-len", type=_positive_int, default=None)
    p.add_argument("--microbatches", type=_positive_int, default=None, help="default: the plan's (with --plan), else 4")
    p.add_argument("--plan", metavar="FILE")
    p.add_argument("--schedule", metavar="NAME", help="baseline to lower (default 1f1b)")
    p.add_argument("--cluster", default=None)
    p.add_argument("--devices", type=_positive_int, default=None)
    p.add_argument("--level", default=None, choices=("graph", "costs", "plan", "program", "stages"),
                   help="the IR level to print (default plan)")
    p.add_argument("--all", metavar="DIR", help="write every level as NN_<level>.txt into DIR (created with any "
                   "missing parent folders; -o FILE needs its folder to exist)")
    p.add_argument("--autocast", choices=AUTOCAST_CHOICES, default=None,
                   help="compile for bfloat16 or float16 autocast (the stages level shows the dtypes sent between stages)")
    p.set_defaults(run=cmd_dump)

    p = sub.add_parser("tokenize", help="turn text into a token file for train --data")
    p.add_argument("inputs", nargs="+", metavar="FILE",
                   help="text files (each one document) or JSON-lines files (.jsonl: a document a line, its "
                        "--json-key field, as Megatron's preprocess_data.py reads them)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.bin|OUT.npy",
                   help="the token file: raw (uint16 where the vocabulary fits, else uint32) or .npy")
    p.add_argument("--tokenizer", default="byte",
                   help="byte (UTF-8 bytes, ids 0-255: the built-in tiny models' vocabulary holds them; default) or a "
                        "Hugging Face tokenizer's folder or name (needs transformers; offline, a name in its cache)")
    p.add_argument("--eod", default=None, metavar="ID|eos",
                   help="end each document with this token id, or eos for the tokenizer's end-of-sequence token "
                        "(Megatron's --append-eod)")
    p.add_argument("--json-key", default="text", help="the field of a .jsonl line that holds its text (default text)")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                   help="tokenize in N processes, chunks of documents in order (Megatron's --workers; default 1, "
                        "where a Hugging Face fast tokenizer already runs each chunk on every core)")
    p.set_defaults(run=cmd_tokenize)

    p = sub.add_parser("checkpoint", help="show what a checkpoint (file or sharded directory) holds, or write it as "
                                          "one file")
    p.add_argument("path", metavar="CHECKPOINT", help="a file, or a directory train --save-sharded wrote")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="write it as one file, the gathered kind train --save writes (--resume and --init read it)")
    p.add_argument("--weights-only", action="store_true",
                   help="with -o: only the weights, {name: tensor} as model.state_dict() gives them (for "
                        "model.load_state_dict, or another framework; a tied parameter under its first name only, "
                        "so load with strict=False or octopipe.runtime.load_into_model)")
    p.add_argument("--fp32", action="store_true",
                   help="with --weights-only: the fp32 master copies in place of the bf16 or fp16 weights where "
                        "the checkpoint holds them (train --bf16-weights, --fp16-weights)")
    p.set_defaults(run=cmd_checkpoint)
    return parser


_TORCHRUN_RANK_DONE = False
"""Set when a torchrun rank of `train` has ended (trained, or failed) and left its process group."""


def _note_one_replica_shard(pipe: Any) -> None:
    """--shard-optimizer with one replica shards nothing: say so rather than take it silently."""
    if pipe.shard_optimizer and pipe.data_parallel == 1:
        print("note: --shard-optimizer with one replica: nothing to shard, each rank keeps its stages' whole "
              "optimizer state (give --data-parallel N, N > 1, to share it among N replicas)", file=sys.stderr)


def _end_torchrun_rank(code: int) -> None:
    """End a finished torchrun rank now: flush its output and leave without the interpreter's
    teardown. Ranks of 2-process CPU runs aborted there, about once in a hundred runs ("terminate
    called without an active exception", after every step was printed and the group destroyed),
    which torchrun reports as a failed job; its cause inside torch's teardown was not found."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_code = main()
    if _TORCHRUN_RANK_DONE:
        _end_torchrun_rank(exit_code)
    sys.exit(exit_code)
