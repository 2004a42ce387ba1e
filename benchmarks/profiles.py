"""The four GPU-profiled cost tables, with the byte counts the profiles leave out.

`load_profile(name)` reads data/profiles/<name>-seq<S>.json with `octopipe.profiles.load_profile`,
which fills each layer's output and activation bytes for a microbatch of one sequence in bf16
(Korthikanti et al.'s 34 s h per transformer block, Nemotron-H's sub-layers from the same
breakdown; see that module). Hidden sizes are the models' published ones
(`octopipe.profiles.HIDDEN_SIZE`).
"""

from __future__ import annotations

import os
from pathlib import Path

from octopipe.errors import CostTableError
from octopipe.ir.costs import CostTable
from octopipe.profiles import HIDDEN_SIZE
from octopipe.profiles import load_profile as _load

PROFILE_DIR = Path(os.environ.get("OCTOPIPE_PROFILE_DIR", Path(__file__).resolve().parents[1] / "data/profiles"))
"""Where the profiled tables live: the repository's copy of the OctoPipe authors' published
profiles (data/profiles/, identical to ../shared/data/profiles/); override with $OCTOPIPE_PROFILE_DIR."""

MODELS = tuple(HIDDEN_SIZE)


def profile_path(name: str) -> Path:
    matches = sorted(PROFILE_DIR.glob(f"{name}-seq*.json"))
    if len(matches) != 1:
        raise CostTableError(
            f"profile {name!r}: expected one file {name}-seq*.json in {PROFILE_DIR}, found {len(matches)}; "
            f"known models: {', '.join(MODELS)}"
        )
    return matches[0]


def load_profile(name: str) -> CostTable:
    """The profiled CostTable of `name` (one of MODELS) with output and activation bytes filled."""
    if name not in HIDDEN_SIZE:
        raise CostTableError(f"profile {name!r}: no hidden size known; known models: {', '.join(MODELS)}")
    return _load(profile_path(name))
