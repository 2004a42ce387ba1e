"""OctoPipe: a pipeline-parallel training compiler that co-optimizes partition, placement and
schedule for heterogeneous models. The public names are below; the README is the user's guide."""

from octopipe import profiles, schedules
from octopipe.api import Pipeline, PlanResult, compile, plan, plan_data_parallel
from octopipe.cluster import ClusterSpec
from octopipe.errors import (
    ArgumentError,
    ClusterSpecError,
    CostTableError,
    DataError,
    ExecutionError,
    InfeasibleError,
    OctopipeError,
    OctopipeWarning,
    ParseError,
    PlanError,
    TraceError,
    VerificationError,
)
from octopipe.ir import CostTable, LayerCost, LayerGraph, Op, PipelinePlan, RankProgram, Stage
from octopipe.passes.trace import trace
from octopipe.simulator import MemoryModel, SimResult, simulate

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec", "CostTable", "LayerCost", "LayerGraph", "Op", "PipelinePlan", "RankProgram", "Stage",
    "MemoryModel", "Pipeline", "PlanResult", "SimResult", "compile", "plan", "plan_data_parallel", "simulate", "schedules", "profiles", "trace", "runtime",
    "OctopipeError", "ArgumentError", "ParseError", "ClusterSpecError", "CostTableError", "TraceError", "PlanError",
    "InfeasibleError", "VerificationError", "ExecutionError", "DataError", "OctopipeWarning",
]


_LAZY_MODULES = ("runtime", "bench", "data", "models", "viz", "demo", "solver", "tuner", "report", "passes")
"""Submodules imported on first use (`octopipe.bench.runtime_profile(...)` after `import octopipe`):
some pull in torch.distributed or matplotlib, which `import octopipe` alone should not."""


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"octopipe.{name}")
    raise AttributeError(f"module 'octopipe' has no attribute {name!r}")
