"""The IR data types, one module per level: graph, costs, plan, program."""

from octopipe.ir.costs import DEFAULT_WEIGHT_FRACTION, CostTable, LayerCost, SkipTensor, TiedParameter
from octopipe.ir.graph import Layer, LayerGraph, SharedParameter, TensorEdge
from octopipe.ir.plan import Op, OpKind, PipelinePlan, Stage, render_grid
from octopipe.ir.program import InstrKind, Instruction, RankProgram, format_programs, parse_programs

__all__ = [
    "DEFAULT_WEIGHT_FRACTION", "CostTable", "LayerCost", "SkipTensor", "TiedParameter", "Layer", "LayerGraph", "SharedParameter", "TensorEdge",
    "Op", "OpKind", "PipelinePlan", "Stage", "render_grid", "Instruction", "InstrKind", "RankProgram",
    "format_programs", "parse_programs",
]
