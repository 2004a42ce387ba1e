"""Put one rank's stage modules on its device, building them there when the model was built on
the meta device.

Consumed by `runtime/engine.py` (Engine(device=..., init=...)); produces nothing new: the stage
modules' parameters and buffers are replaced in place, so the rank's engine, its optimizer and
its state dicts see the materialized tensors.

A model too large for one machine is built on the meta device (`with torch.device("meta")`),
traced, planned and cut like any other; each rank then creates only its own stages' tensors, on
its own device, and fills them from `init`:

- a checkpoint path or a state dict keyed by the original model's names (`Engine.save_checkpoint`
  writes one; a plain `model.state_dict()` works too), or
- a function called once per submodule of the rank's stages, like `nn.Module.apply`
  (`octopipe.models.init_module` does what `octopipe.models.build` does), or
- "reset": each submodule's own `reset_parameters()` (what torch's layers start from).

Non-persistent buffers (tables a module computes in `__init__`, like RoPE's cos/sin) are in no
checkpoint: a module that owns one recomputes it in a `reset_buffers()` method, which is called
first (in place or assigned anew: every holder of the buffer gets the new one). Nothing is left
silently uninitialized: floating-point tensors are created filled with NaN and integer ones with
their type's minimum, and a tensor that still holds that after `init` is an error naming it
(boolean buffers cannot be checked this way).

Glossary: *materialize* = replace a meta tensor by a real one on the device; *tied* = one
parameter object held by several modules (it stays one object).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn

from octopipe.errors import ExecutionError
from octopipe.runtime.stage import StageModule

Init = Union[str, "os.PathLike[str]", Mapping[str, Any], Callable[[nn.Module], None]]
"""What fills a materialized rank: a checkpoint path, a state dict, a per-module function, or "reset"."""

_SHOWN = 5  # names listed in an error message


def materialize(stages: Sequence[StageModule], device: torch.device, init: Init | None, rank: int) -> bool:
    """Move `stages`' tensors to `device`, or, if any is on the meta device, create them there
    and fill them from `init` (required then; on a real model `init` loads or re-initializes it
    the same way). Returns whether tensors were created. If filling fails, the stages are left
    on the meta device as they were, so a second attempt starts clean."""
    modules = _unique_modules(stages)
    tensors = list(_named_tensors(stages))
    on_meta = [name for name, tensor in tensors if tensor.is_meta]
    if not on_meta:
        _move(modules, device)
        if init is not None:
            _fill(stages, modules, init, device, rank)
        return False
    if init is None:
        raise ExecutionError(
            f"rank {rank}: the model was built on the meta device: this rank's stages hold {len(on_meta)} tensors "
            f"with no values ({_names(on_meta)}); give pipe.engine(rank, device=..., init=...) a checkpoint "
            "(path or state dict with the model's names), a function to run on each submodule "
            "(octopipe.models.init_module for the built-in models), or \"reset\" (each module's reset_parameters)")
    mine = {id(tensor) for _, tensor in tensors}  # an owner may hold other ranks' tensors too
    created: dict[int, torch.Tensor] = {}  # old tensor -> its replacement: tied tensors stay one object
    replaced: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in modules:
        for table, make in ((module._parameters, _unset_parameter), (module._buffers, _unset)):
            for name, tensor in list(table.items()):
                if tensor is not None and tensor.is_meta and id(tensor) in mine:
                    if id(tensor) not in created:
                        created[id(tensor)] = make(tensor, device)
                    replaced.append((table, name, tensor))
                    table[name] = created[id(tensor)]
    try:
        _move(modules, device)  # whatever was real already (a buffer built outside the meta context)
        with torch.no_grad():
            _call_each(modules, "reset_buffers")
        _follow_reassigned(replaced, created)
        _fill(stages, modules, init, device, rank)
        _follow_reassigned(replaced, created)
        _check_initialized(stages, rank, init)
    except BaseException:
        for table, name, tensor in reversed(replaced):
            table[name] = tensor
        raise
    return True


def _follow_reassigned(replaced: Sequence[tuple[dict[str, Any], str, torch.Tensor]],
                       created: Mapping[int, torch.Tensor]) -> None:
    """A tensor `reset_buffers` or `init` assigned anew (`self.table = ...`, the usual idiom)
    lands in its owner's table only: every other holder of the tensor it replaced (a stage
    module's own attribute) takes it too."""
    now = {}
    for table, name, old in replaced:
        if table[name] is not created[id(old)]:
            now[id(created[id(old)])] = table[name]
    for table, name, old in replaced:
        if table[name] is created[id(old)] and id(table[name]) in now:
            table[name] = now[id(table[name])]


def is_checkpoint(init: Init) -> bool:
    """Whether `init` names values (a path or a state dict) rather than a way to draw them."""
    return isinstance(init, (Mapping, os.PathLike)) or (isinstance(init, str) and init != "reset")


def checkpoint_state(init: Init, rank: int) -> Mapping[str, Any] | None:
    """The state dict `init` names ({"model": {name: tensor}} as `Engine.load_state_dict` takes
    it), or None when `init` is a function or "reset". A path is a checkpoint file or a sharded
    checkpoint's directory, read on the CPU, memory-mapped: whoever loads it copies out only the
    tensors it holds."""
    if not is_checkpoint(init):
        return None
    if isinstance(init, Mapping):
        state = init
    else:
        path = os.fspath(init)  # type: ignore[arg-type]
        if not os.path.exists(path):
            raise ExecutionError(f"rank {rank}: init checkpoint {path!r} does not exist; give the path of a "
                                 "checkpoint (Engine.save_checkpoint or torch.save(model.state_dict(), path))")
        state = _read_sharded(path, rank) if os.path.isdir(path) else _read_file(path, rank)
    if not isinstance(state, Mapping):
        raise ExecutionError(f"rank {rank}: init checkpoint is a {type(state).__name__}, not a state dict")
    return state if isinstance(state.get("model"), Mapping) else {"model": state}


def _read_file(path: str, rank: int) -> Any:
    """A checkpoint file's contents, memory-mapped on the CPU where torch can (its zip format),
    so a rank reads only the tensors it copies out (and none lands on a GPU whole)."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # (torch's legacy format)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds (pickle, zip, EOF) on a bad file
        # torch's own text may advise weights_only=False (running the file's pickled code): not ours to pass on
        why = ("it holds more than tensors and plain containers; checkpoints are read with "
               "weights_only=True, so no pickled code runs" if "weights_only" in str(exc)
               else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        raise ExecutionError(f"rank {rank}: init checkpoint {path!r} is not a torch checkpoint of tensors "
                             f"({why}); give a file written by Engine.save_checkpoint or "
                             "torch.save(model.state_dict(), path)") from None


def _read_sharded(path: str, rank: int) -> Any:
    """A sharded checkpoint's directory (`Engine.save_checkpoint(path, sharded=True)`): its
    index's shards, each read as a file, merged into one state (`merge_state_dicts`)."""
    from octopipe.runtime.engine import merge_state_dicts

    shards = []
    for name in sharded_index(path, rank)["files"]:
        shard = _read_file(os.path.join(path, name), rank) if os.path.isfile(os.path.join(path, name)) else None
        if not isinstance(shard, Mapping) or not isinstance(shard.get("model"), Mapping):
            raise ExecutionError(f"rank {rank}: checkpoint {path!r}: its index names {name!r}, which is "
                                 + ("missing" if shard is None else "not a shard of Engine.save_checkpoint") +
                                 "; the directory is incomplete: save it again, or give another checkpoint")
        shards.append(shard)
    return merge_state_dicts(shards)


def _first_state(path: str, rank: int) -> Any:
    """A file's state (memory-mapped), or a sharded directory's rank-0 shard, unmerged."""
    if os.path.isdir(path):
        files = sharded_index(path, rank)["files"]
        return _read_file(os.path.join(path, files[0]), rank) if files else {}
    return checkpoint_state(path, rank) or {}


def saved_extra(path: str, rank: int) -> dict[str, Any]:
    """The training loop's state a checkpoint keeps (`Engine.save_checkpoint(extra=...)`), read
    alone: from a file (memory-mapped), or from a sharded directory's rank-0 shard, which holds
    it, without merging the others. Empty where it has none."""
    state = _first_state(path, rank)
    extra = state.get("extra") if isinstance(state, Mapping) else None
    return dict(extra) if isinstance(extra, Mapping) else {}


def saved_optimizer_class(path: str, rank: int) -> str | None:
    """The class name of the optimizer whose state a checkpoint holds (as its rank-0 part records
    it since stop 47), None where it holds none or does not say."""
    state = _first_state(path, rank)
    optimizer = state.get("optimizer") if isinstance(state, Mapping) else None
    kind = optimizer.get("class") if isinstance(optimizer, Mapping) else None
    return kind if isinstance(kind, str) else None


def sharded_index(path: str, rank: int) -> dict[str, Any]:
    """A sharded checkpoint directory's index (`SHARDED_INDEX`: format, world size, the shards'
    file names), checked."""
    import json

    from octopipe.runtime.engine import SHARDED_FORMAT, SHARDED_INDEX

    index_path = os.path.join(path, SHARDED_INDEX)
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
    except FileNotFoundError:
        raise ExecutionError(f"rank {rank}: checkpoint {path!r} is a directory without {SHARDED_INDEX}: not a sharded "
                             "checkpoint (Engine.save_checkpoint(path, sharded=True), train --save-sharded), or "
                             "one whose save did not finish; give a checkpoint file or a complete directory") from None
    except (OSError, ValueError) as exc:
        raise ExecutionError(f"rank {rank}: checkpoint {path!r}: cannot read its index {SHARDED_INDEX} ({exc})") from None
    files = index.get("files") if isinstance(index, dict) else None
    if (not isinstance(index, dict) or index.get("format") != SHARDED_FORMAT or not isinstance(files, list)
            or not all(isinstance(name, str) and os.path.basename(name) == name for name in files)):
        raise ExecutionError(f"rank {rank}: checkpoint {path!r}: its {SHARDED_INDEX} is not an index of "
                             f"{SHARDED_FORMAT!r} (format, world_size and a list of file names); give a directory "
                             "Engine.save_checkpoint(path, sharded=True) wrote")
    return index


def load_named(tensors: Iterable[tuple[str, torch.Tensor, bool]], values: Mapping[str, Any], rank: int,
               what: str) -> None:
    """Copy `values[name]` into each (name, tensor, required) of `tensors`; a required name
    `values` lacks, or a value of another shape, is an error naming them (`what`: the source).
    The one loader of a rank's tensors by the model's names: a checkpoint `init` and
    `Engine.load_state_dict`."""
    missing = []
    with torch.no_grad():
        for name, tensor, required in tensors:
            if name in values:
                if not isinstance(values[name], torch.Tensor):
                    raise ExecutionError(f"rank {rank}: {what}: {name!r} is a {type(values[name]).__name__}, not a "
                                         "tensor: is it this model's state dict?")
                if tuple(values[name].shape) != tuple(tensor.shape):
                    raise ExecutionError(f"rank {rank}: {what}: {name!r} has shape {tuple(values[name].shape)}, the "
                                         f"model's is {tuple(tensor.shape)}: is it this model's?")
                tensor.copy_(values[name])
            elif required:
                missing.append(name)
    if missing:
        raise ExecutionError(f"rank {rank}: {what} has no value for {len(missing)} parameters of this rank's stages "
                             f"({_names(missing)}); is it this model's?")


def _fill(stages: Sequence[StageModule], modules: Sequence[nn.Module], init: Init, device: torch.device,
          rank: int) -> None:
    state = checkpoint_state(init, rank)
    if state is not None:
        params = {id(p) for stage in stages for p in stage.module.parameters()}
        load_named(((name, tensor, id(tensor) in params) for name, tensor in _named_tensors(stages)), state["model"],
                   rank, "init checkpoint")
        return
    with torch.no_grad():
        if init == "reset":
            _call_each(modules, "reset_parameters")
        elif callable(init):
            for module in modules:
                init(module)
        else:
            raise ExecutionError(f"rank {rank}: init must be a checkpoint path, a state dict, a function of a module, "
                                 f"or \"reset\"; got {type(init).__name__} {init!r}")


def _check_initialized(stages: Sequence[StageModule], rank: int, init: Init) -> None:
    """Raise if a tensor `materialize` created still holds its 'not set' marker."""
    unset = [name for name, tensor in _named_tensors(stages) if _is_unset(tensor)]
    if unset:
        how = "the checkpoint lacks them" if is_checkpoint(init) else "init did not set them"
        raise ExecutionError(
            f"rank {rank}: {len(unset)} tensors of this rank's stages were left uninitialized after materializing "
            f"({_names(unset)}): {how}. Give them values in init, or, for a table the module computes itself "
            "(a non-persistent buffer), give its module a reset_buffers() method that recomputes it")


# -- helpers ------------------------------------------------------------------------------------------


def _unique_modules(stages: Sequence[StageModule]) -> list[nn.Module]:
    """The original modules owning the stages' tensors, then the stage modules' own submodules,
    each once: every holder of a tensor, so a replaced tensor is replaced everywhere."""
    seen: set[int] = set()
    modules = []
    for stage in stages:
        for module in [*stage.owners, *stage.module.modules()]:
            if id(module) not in seen:
                seen.add(id(module))
                modules.append(module)
    return modules


def _named_tensors(stages: Sequence[StageModule]) -> Iterator[tuple[str, torch.Tensor]]:
    """(original name, tensor) of every parameter and buffer of `stages`, each object once."""
    seen: set[int] = set()
    for stage in stages:
        named = [*stage.module.named_parameters(remove_duplicate=False), *stage.module.named_buffers(remove_duplicate=False)]
        for local, tensor in named:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield stage.original_name(local), tensor


def _call_each(modules: Sequence[nn.Module], method: str) -> None:
    """`module.method()` for each module that defines it."""
    for module in modules:
        function = getattr(module, method, None)
        if callable(function):
            function()


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _unset_parameter(param: torch.Tensor, device: torch.device) -> nn.Parameter:
    return nn.Parameter(_unset(param, device), requires_grad=param.requires_grad)


def _unset(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device=device)
    if tensor.dtype == torch.bool:
        return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.full(tensor.shape, torch.iinfo(tensor.dtype).min, dtype=tensor.dtype, device=device)


def _is_unset(tensor: torch.Tensor) -> bool:
    if tensor.is_meta or tensor.numel() == 0:
        return tensor.is_meta
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return bool(torch.isnan(tensor.detach()).any())
    if tensor.dtype == torch.bool:
        return False
    return bool((tensor.detach() == torch.iinfo(tensor.dtype).min).any())


def _move(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Every real tensor of `modules` onto `device`, in place: a parameter keeps its identity
    (ties and references held elsewhere stay valid). Meta tensors stay: an owner module may
    hold tensors of other ranks' stages."""
    moved: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in modules:
            for param in module._parameters.values():
                if param is not None and not param.is_meta and param.device != device:
                    param.data = param.data.to(device)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and not buffer.is_meta and buffer.device != device:
                    if id(buffer) not in moved:
                        moved[id(buffer)] = buffer.to(device)
                    module._buffers[name] = moved[id(buffer)]
