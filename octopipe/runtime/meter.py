"""What a rank really holds for its backward passes: `ActivationMeter`.

The simulator's memory model (see `octopipe/simulator.py`) says each device holds a stage's
activation bytes from the start of its F to the end of its B (with a split backward, what its W
reads until W) and its outputs from F's end until sent, and the planner keeps plans under an
activation limit by it. The
meter measures the same quantity on a running engine (`Engine.measure_activations()`), so the
prediction can be checked against real steps on any device, CPU included:

- every tensor autograd saves during a forward (a saved-tensor hook), every stage input and output
  the engine keeps from F to B, and every tensor a B leaves for its W (the deferred weight
  gradients' inputs and output gradients) is held until the last reference to it is dropped;
- bytes are counted per storage, once however many views or ops hold it (a tensor saved by two
  ops, q, k and v cut from one projection); parameters' storages are not counted (the static
  memory the simulator counts apart), a cast copy of a weight (autocast's) is;
- `live` is what is held now, `peak` the most held since `start_step`; the step's batch (inputs
  and target, held for the whole step in any case) is not counted.

What is not counted: the gradients in flight between a B and the send or the stage that reads
them, the optimizer's state, the allocator's cache. A tensor autograd frees early (the inputs of
an in-place op's consumer) is held until its graph is freed; torch keeps those too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor


class _Hold:
    """One reference to a storage; dropping it (its last holder goes) gives the bytes back."""

    __slots__ = ("key", "meter")

    def __init__(self, meter: ActivationMeter, key: int) -> None:
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        self.meter._release(self.key)


class _Saved:
    """What a saved-tensor hook keeps for autograd: the tensor and its hold."""

    __slots__ = ("hold", "tensor")

    def __init__(self, tensor: Tensor, hold: _Hold | None) -> None:
        self.tensor = tensor
        self.hold = hold


def _unpack(saved: _Saved) -> Tensor:
    return saved.tensor


class ActivationMeter:
    """Bytes of activations held, per storage (see the module docstring)."""

    def __init__(self, parameters: Iterable[Tensor] = ()) -> None:
        self._excluded: set[int] = set()
        self.exclude(parameters)
        self._batch: set[int] = set()
        self._counts: dict[int, list[int]] = {}  # storage address -> [holds, bytes]
        self.live = 0
        self.peak = 0

    def exclude(self, tensors: Iterable[Tensor]) -> None:
        """Never count these tensors' storages (parameters, master copies)."""
        self._excluded.update(t.untyped_storage().data_ptr() for t in tensors)

    def start_step(self, batch: Iterable[Tensor]) -> None:
        """A step begins: its peak starts from what is held now, and the batch's storages (the
        step's inputs and target, held for the whole step in any case) are not counted."""
        self._batch = {t.untyped_storage().data_ptr() for t in batch}
        self.peak = self.live

    def hold(self, tensor: Any) -> _Hold | None:
        """Count `tensor`'s storage until the returned hold is dropped (None: not a tensor held)."""
        if not isinstance(tensor, Tensor) or tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._excluded or key in self._batch:
            return None
        entry = self._counts.get(key)
        if entry is None:
            size = storage.nbytes()
            self._counts[key] = [1, size]
            self.live += size
            if self.live > self.peak:
                self.peak = self.live
        else:
            entry[0] += 1
        return _Hold(self, key)

    def holds(self, tensors: Iterable[Any]) -> list[_Hold]:
        return [hold for hold in (self.hold(t) for t in tensors) if hold is not None]

    def _release(self, key: int) -> None:
        entry = self._counts[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._counts[key]
            self.live -= entry[1]

    def _pack(self, tensor: Tensor) -> _Saved:
        return _Saved(tensor, self.hold(tensor))

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Within this block, what autograd saves for backward is counted until it is freed."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield


def tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors in a nest of tuples, lists and dicts (a weight-gradient stash's arguments)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
