"""Mixed precision: every stage's forward under `torch.autocast`, as plain autocast training runs it.

`compile(..., autocast="bf16")` (and `Engine(autocast=...)`, `octopipe train --autocast bf16`):
parameters, their gradients and the optimizer stay in the parameters' own dtype (fp32); the ops
autocast lists (matmuls, convolutions, attention) run in bfloat16; tensors cross stages in the
dtype autocast gave them (a linear's bf16 output is sent as bf16: half the bytes); backward runs
outside autocast, as `loss.backward()` after an autocast forward does. The loss and gradients equal
single-device training that runs `loss_fn(model(x), y)` under `torch.autocast(device, bfloat16)`
for each microbatch. The split backward's linears (`passes/split_backward.py`) cast their operands
as autocast would, so W's weight gradients are the same bf16 matmuls.

Only bfloat16: float16 needs loss scaling (a GradScaler whose inf/nan check spans every rank),
which the runtime does not do. A recomputing stage runs its second forward under the same autocast.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from octopipe.errors import ArgumentError

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def autocast_dtype(value: Any, where: str) -> torch.dtype | None:
    """The autocast dtype `value` names (None, "bf16", "bfloat16", torch.bfloat16), or an
    ArgumentError from `where` saying what is taken."""
    if value is None:
        return None
    if value is torch.bfloat16:
        return value
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else None
    if name in _NAMES:
        return _NAMES[name]
    if value is torch.float16 or name in ("fp16", "float16", "half"):
        raise ArgumentError(f"{where}: float16 autocast needs loss scaling (a GradScaler whose inf check spans every "
                            "rank), which octopipe does not do; use 'bf16' (no scaling needed)")
    raise ArgumentError(f"{where}: autocast takes None or 'bf16' (torch.bfloat16), got {value!r}")


def autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast on `device`'s type with `dtype`, or nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
