"""Mixed precision: every stage's forward under `torch.autocast`, as plain autocast training runs it.

`compile(..., autocast="bf16")` (and `Engine(autocast=...)`, `octopipe train --autocast bf16`):
parameters, their gradients and the optimizer stay in the parameters' own dtype (fp32); the ops
autocast lists (matmuls, convolutions, attention) run in bfloat16; tensors cross stages in the
dtype autocast gave them (a linear's bf16 output is sent as bf16: half the bytes); backward runs
outside autocast, as `loss.backward()` after an autocast forward does. The loss and gradients equal
single-device training that runs `loss_fn(model(x), y)` under `torch.autocast(device, bfloat16)`
for each microbatch. The split backward's linears (`passes/split_backward.py`) cast their operands
as autocast would, so W's weight gradients are the same bf16 matmuls.

`autocast="fp16"` (torch.float16) adds dynamic loss scaling, as `torch.amp.GradScaler` does it
(`LossScaler`, the same defaults): the loss stage's backward starts from the microbatch's weight
times the current scale, so gradients (the fp16 ones sent between stages too) are scaled; at the
end of `Engine.step` every rank divides its gradients by the scale and checks them, and the ranks
agree (one all-reduce) whether any gradient anywhere is inf or nan. If one is, every rank drops its
gradients (`.grad = None`: an optimizer then steps nothing, as GradScaler skips the step), the
step is marked skipped (`Engine.skipped_step`) and the scale halves; after `growth_interval` good
steps in a row it doubles. So `.grad` after `step` holds true gradients, ready for clipping and any
optimizer. A recomputing stage runs its second forward under the same autocast.

fp16 weights with fp32 master copies (`compile(model.half(), ..., master_weights=True,
fp32_grads=True)`, Megatron's `--fp16`) use the same `LossScaler` without autocast: the loss is
scaled the same way, and the fp32 gradients (`Engine.main_grads()`) are unscaled and checked.
`LossScaler`'s `hysteresis`, `min_scale` and `dynamic=False` are Megatron's fp16 options.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from octopipe.errors import ArgumentError

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16}


def autocast_dtype(value: Any, where: str) -> torch.dtype | None:
    """The autocast dtype `value` names (None, "bf16", "bfloat16", torch.bfloat16, "fp16",
    "float16", torch.float16), or an ArgumentError from `where` saying what is taken."""
    if value is None:
        return None
    if value is torch.bfloat16 or value is torch.float16:
        return value
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else None
    if name in _NAMES:
        return _NAMES[name]
    raise ArgumentError(f"{where}: autocast takes None, 'bf16' (torch.bfloat16) or 'fp16' (torch.float16, with loss "
                        f"scaling), got {value!r}")


class LossScaler:
    """Dynamic loss scaling for float16 (autocast, or fp16 weights with master copies),
    `torch.amp.GradScaler`'s rule and defaults: start at `init_scale`; a step with an inf or nan
    gradient anywhere multiplies the scale by `backoff_factor`; `growth_interval` good steps in a
    row multiply it by `growth_factor`. Megatron's `--fp16` options on top: `hysteresis` (its
    `--hysteresis`; 1, GradScaler's, backs off on every bad step): back off only once that many
    bad steps have come since the scale last grew (or started); `min_scale` (its
    `--min-loss-scale`): never back off below it; `dynamic=False` (its `--loss-scale S`): the
    scale stays `init_scale`, and a bad step is still skipped."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, *, hysteresis: int = 1, min_scale: float = 0.0,
                 dynamic: bool = True) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ArgumentError(f"LossScaler: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                                f"growth_interval >= 1, got {init_scale}, {growth_factor}, {backoff_factor}, "
                                f"{growth_interval}")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1 \
                or not 0 <= min_scale <= init_scale or not isinstance(dynamic, bool):
            raise ArgumentError(f"LossScaler: needs an integer hysteresis >= 1, 0 <= min_scale <= init_scale and a "
                                f"bool dynamic, got {hysteresis!r}, {min_scale!r} (init_scale {init_scale}), "
                                f"{dynamic!r}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.good_steps = 0
        self.hysteresis_left = hysteresis
        """Bad steps still allowed before the next backoff (Megatron's hysteresis tracker)."""

    def update(self, found_inf: bool) -> None:
        """After a step: back off on an inf/nan gradient, grow after enough good steps."""
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, float]:
        state = {"scale": self.scale, "good_steps": self.good_steps}
        if self.hysteresis > 1:
            state["hysteresis_left"] = self.hysteresis_left
        return state

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))


def autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast on `device`'s type with `dtype`, or nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
