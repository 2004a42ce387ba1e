"""OctoPipe: a pipeline-parallel training compiler that co-optimizes partition, placement and
schedule for heterogeneous models. The public names are below; see DESIGN.md."""

from octopipe.cluster import ClusterSpec
from octopipe.errors import (
    ClusterSpecError,
    CostTableError,
    ExecutionError,
    InfeasibleError,
    OctopipeError,
    ParseError,
    PlanError,
    TraceError,
    VerificationError,
)
from octopipe.ir import CostTable, LayerCost, LayerGraph, Op, PipelinePlan, RankProgram, Stage

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec", "CostTable", "LayerCost", "LayerGraph", "Op", "PipelinePlan", "RankProgram", "Stage",
    "OctopipeError", "ParseError", "ClusterSpecError", "CostTableError", "TraceError", "PlanError",
    "InfeasibleError", "VerificationError", "ExecutionError",
]
