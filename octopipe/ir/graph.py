"""LayerGraph: the model as a sequence of pipeline-cuttable layers (IR level 1).

Produced by `passes/trace.py` from an nn.Module; consumed by the cost passes and by codegen. A
*layer* is a unit a stage boundary may fall between: the embedding, each block of a ModuleList,
norms, the head, the loss. Layers are in topological (execution) order. A *tensor edge* is a value
produced by one layer (or a model input, producer -1) and read by later layers; an edge whose
readers go beyond the next layer is a *skip* edge, which a partition pays for. A *shared
parameter* is one tensor used by several layers (a tied embedding and head).

Each layer keeps the names of its fx nodes and the graph keeps the traced module, neither
serialized; the text form is what a user reads (`print(graph)`), and parses back.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from octopipe.errors import ParseError
from octopipe.ir.costs import SkipTensor, TiedParameter
from octopipe.ir.text import FieldReader, format_fields, format_strs, parse_fields, record


@dataclass(frozen=True, slots=True)
class Layer:
    index: int
    name: str
    kind: str
    """embedding | block | norm | head | loss | vision_block | projector | other"""
    module_type: str = ""
    """Class name of the main module (e.g. `LlamaDecoderLayer`, `MoEBlock`), for reports and costs."""
    modules: tuple[str, ...] = ()
    """Qualified module paths grouped into this layer."""
    parameters: tuple[str, ...] = ()
    """Qualified names of the parameters this layer reads."""
    num_params: int = 0
    nodes: tuple[str, ...] = field(default=(), compare=False)
    """fx node names of this layer, in graph order (not part of the text form)."""

    def __str__(self) -> str:
        return f"layer {self.index} " + format_fields([
            ("name", self.name), ("kind", self.kind), ("type", self.module_type or None),
            ("modules", format_strs(self.modules) or None), ("params", format_strs(self.parameters) or None),
            ("num_params", self.num_params),
        ])


@dataclass(frozen=True, slots=True)
class TensorEdge:
    name: str
    producer: int
    """Layer index, or -1 for a model input."""
    consumers: tuple[int, ...]
    shape: tuple[int, ...] = ()
    """Shape for the example batch given to trace; () when unknown."""
    dtype: str = ""

    @property
    def is_skip(self) -> bool:
        return bool(self.consumers) and max(self.consumers) > self.producer + 1 and self.producer >= 0

    def __str__(self) -> str:
        return "edge " + format_fields([
            ("name", self.name), ("from", self.producer), ("to", ",".join(map(str, self.consumers)) or None),
            ("shape", "x".join(map(str, self.shape)) if self.shape else None), ("dtype", self.dtype or None),
        ])


@dataclass(frozen=True, slots=True)
class SharedParameter:
    name: str
    layers: tuple[int, ...]

    def __str__(self) -> str:
        return "shared " + format_fields([("name", self.name), ("layers", ",".join(map(str, self.layers)))])


@dataclass(frozen=True, slots=True)
class LayerGraph:
    model: str
    inputs: tuple[str, ...]
    layers: tuple[Layer, ...]
    edges: tuple[TensorEdge, ...] = ()
    shared: tuple[SharedParameter, ...] = ()
    method: str = "fx"
    """How it was traced: `fx` (torch.fx symbolic trace) or `export` (torch.export)."""
    module: Any = field(default=None, compare=False, repr=False)
    """The traced torch.fx.GraphModule whose nodes the layers name (not part of the text form; not
    pickled: it stays in the process that traced it, and a torch.export one does not pickle)."""

    def __getstate__(self) -> list[Any]:
        return [None if f.name == "module" else getattr(self, f.name) for f in fields(self)]

    def __setstate__(self, state: list[Any]) -> None:
        for f, value in zip(fields(self), state):
            object.__setattr__(self, f.name, value)

    def __copy__(self) -> LayerGraph:  # copies keep the module (only pickling leaves it behind)
        return replace(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> LayerGraph:
        return replace(self, **{f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self)})

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def skip_edges(self) -> tuple[TensorEdge, ...]:
        return tuple(edge for edge in self.edges if edge.is_skip)

    def tied_parameters(self, dtype_bytes: int | None = None) -> tuple[TiedParameter, ...]:
        """The shared parameters as cost-table entries (`CostTable.tied`), sized from the traced
        module: numel x `dtype_bytes` (default: the parameter's own element size)."""
        if not self.shared:
            return ()
        if self.module is None:
            raise ParseError(f"graph {self.model!r}: shared parameters need the traced module for their sizes "
                             "(this graph was parsed from text); trace the model")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        tied = []
        for shared in self.shared:
            param = params.get(shared.name)
            if param is None:
                raise ParseError(f"graph {self.model!r}: shared parameter {shared.name!r} is not a parameter of the "
                                 "traced module")
            size = param.numel() * (param.element_size() if dtype_bytes is None else dtype_bytes)
            tied.append(TiedParameter(shared.name, tuple(sorted(set(shared.layers))), int(size)))
        return tuple(tied)

    def skip_tensors(self, sizes: Mapping[str, int]) -> tuple[SkipTensor, ...]:
        """The skip edges as cost-table entries (`CostTable.skips`), each sized from `sizes`
        (edge name -> bytes per microbatch; an edge missing there is left out)."""
        return tuple(SkipTensor(edge.name, edge.producer, tuple(sorted(set(edge.consumers))), int(sizes[edge.name]))
                     for edge in self.skip_edges if edge.name in sizes)

    def layer_of_node(self) -> dict[str, int]:
        return {node: layer.index for layer in self.layers for node in layer.nodes}

    def __str__(self) -> str:
        head = "graph " + format_fields([
            ("model", self.model), ("method", self.method), ("inputs", format_strs(self.inputs) or None),
            ("layers", len(self.layers)),
        ])
        lines = [head, *map(str, self.layers), *map(str, self.edges), *map(str, self.shared)]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> LayerGraph:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines:
            raise ParseError("graph text is empty")
        keyword, tokens, where = record("graph", lines[0][1], lines[0][0])
        if keyword != "graph":
            raise ParseError(f"{where}: expected 'graph ...', got {keyword!r}")
        head = FieldReader(parse_fields(tokens, where), where)
        model, method, inputs, count = head.str("model"), head.str("method"), head.strs("inputs"), head.int("layers")
        head.done()
        layers: list[Layer] = []
        edges: list[TensorEdge] = []
        shared: list[SharedParameter] = []
        for number, line in lines[1:]:
            keyword, tokens, where = record("layer", line, number)
            if keyword == "layer":
                if not tokens:
                    raise ParseError(f"{where}: layer line needs an index")
                try:
                    index = int(tokens[0])
                except ValueError:
                    raise ParseError(f"{where}: layer index must be an integer, got {tokens[0]!r}") from None
                r = FieldReader(parse_fields(tokens[1:], where), where)
                layers.append(Layer(index, r.str("name"), r.str("kind"), r.str("type", default=""), r.strs("modules"),
                                    r.strs("params"), r.int("num_params", 0)))
                r.done()
            elif keyword == "edge":
                r = FieldReader(parse_fields(tokens, where), where)
                shape_text = r.str("shape", default="")
                try:
                    shape = tuple(int(d) for d in shape_text.split("x")) if shape_text else ()
                except ValueError:
                    raise ParseError(f"{where}: shape must look like 4x16x32, got {shape_text!r}") from None
                edges.append(TensorEdge(r.str("name"), r.int("from"), r.ints("to"), shape, r.str("dtype", default="")))
                r.done()
            elif keyword == "shared":
                r = FieldReader(parse_fields(tokens, where), where)
                shared.append(SharedParameter(r.str("name"), r.ints("layers")))
                r.done()
            else:
                raise ParseError(f"{where}: expected 'layer', 'edge' or 'shared', got {keyword!r}")
        if len(layers) != count:
            raise ParseError(f"graph header says layers={count}, found {len(layers)} layer lines")
        return cls(model, inputs, tuple(layers), tuple(edges), tuple(shared), method)
