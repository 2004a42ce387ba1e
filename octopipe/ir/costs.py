"""LayerCost and CostTable: what each pipeline layer costs (IR level 2).

Consumes a file (JSON/YAML, the keys below) or the analytic/profiling passes' output; produces the
per-layer times and bytes every search component reads. Times are milliseconds per microbatch:
`forward_ms` (F), `backward_ms` (input plus weight gradient, B+W), `backward_weight_ms` (the W
part; when absent the table's `weight_fraction` of `backward_ms` is assumed), and optionally
`backward_full_ms` (B and W as one op, where measured: it can be cheaper than the two apart) and
`forward_no_grad_ms` (F of a stage that recomputes its activations, which runs without autograd:
5.5-8.3% cheaper than `forward_ms` in a run on this project's CPU; absent: `forward_ms`).
Gradient accumulation: `accumulate_ms` is what one microbatch takes to add the layer's parameter
gradients into `.grad` (every microbatch of a step after the first does) and `accumulate_weight_ms`
W's part of it; the backward times include (M-1)/M of them, M being the table's
`num_microbatches` (absent: none of them). `CostTable.for_microbatches` re-costs a table for
another M; `plan` and `simulate` do that for the M they are given.
Selective recomputation (a stage's `Stage.selective`): `selective_activation_bytes` is what the
layer holds from F to B when it keeps only its compute-heavy ops' outputs (matmuls, attention,
convolutions), and `selective_recompute_ms` what recomputing the rest at B costs;
absent: not known, and the planner does not offer it on a stage holding that layer (the analysis
and profiling passes leave it out where selective recomputation cannot run the layer: an
in-place op or a recurrent module, `passes/trace.selective_hazards`).
Bytes are per microbatch: `activation_bytes` kept from F until B/W, `output_bytes` sent to the
next stage, and `param_bytes` of the layer's parameters (in the training dtype).
`weight_stash_bytes` is what a split backward's B leaves for its W: the inputs and output
gradients of the linear layers whose weight gradients W computes (absent: not known, and the
simulator keeps its memory model's `weight_memory_fraction` of the activation bytes).
`unsaved_input_bytes` is what of the layer's inputs from earlier layers its backward does not save
(a loss layer's logits: it keeps their log-softmax): a stage starting with the layer received it,
and the runtime holds what a stage received from its F until its B, so the memory model counts
it there (absent: 0, every input saved or none received). A missing byte
count is `None` and counts as 0. `formulas` keeps sympy expressions (as text) in the batch symbol `b` and the
sequence symbol `s` where the costs came from analysis.

`tied` lists the parameters several layers share (a tied embedding and head): each layer's
`param_bytes` includes it, and a plan that puts its layers on different devices all-reduces its
gradient once per iteration (the simulator charges that; on one device it is held once). Text
form: `tied name=... layers=0,9 bytes=...` lines after the layers; files: a `tied` list of
objects with those keys.

`skips` lists the tensors a layer produces for layers beyond the next one (a vision encoder's
features read by every cross-attention layer): a layer's `output_bytes` counts all its outputs,
and a plan whose stages cut such a tensor's path sends it from the producer's stage straight to
each later stage that reads it (and its gradient back), as the runtime does. Text form:
`skip name=... from=6 to=10,13 bytes=...` lines after the layers; files: a `skips` list of
objects with keys name, from, to, bytes.
"""

from __future__ import annotations

import difflib
import functools
import json
import keyword
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sympy

from octopipe.errors import CostTableError, ParseError
from octopipe.ir.files import parse_json, parse_yaml, read_text
from octopipe.ir.text import FieldReader, format_fields, parse_fields, record

DEFAULT_WEIGHT_FRACTION = 0.5
"""W's share of a layer's backward when a table does not say: input- and weight-gradient matmuls
cost the same (the zero-bubble papers' F = B = W assumption for transformer blocks)."""

MAX_LAYER_MS = 1e9
"""A layer's time per microbatch is at most this (11.6 days): the solvers' integer times must fit
64 bits."""

_TIME_FIELDS = ("forward_ms", "backward_ms")
_OPTIONAL_TIME_FIELDS = ("backward_weight_ms", "backward_full_ms", "accumulate_ms", "accumulate_weight_ms",
                         "selective_recompute_ms", "forward_no_grad_ms")
_BYTE_FIELDS = ("activation_bytes", "output_bytes", "param_bytes", "selective_activation_bytes", "weight_stash_bytes",
                "unsaved_input_bytes")
_LAYER_KEYS = ("name", "kind", *_TIME_FIELDS, *_OPTIONAL_TIME_FIELDS, *_BYTE_FIELDS, "formulas")
_TABLE_KEYS = ("model", "weight_fraction", "num_microbatches", "layers", "tied", "skips")
_FORMULA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_FORMULA_TOKEN = re.compile(r"\s*(?:(?P<number>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
                            r"|(?P<name>[A-Za-z][A-Za-z0-9_]*)|(?P<op>\*\*|[-+*/(),]))")
MAX_BYTES = 2**62
"""A layer's byte counts are below this (a float holds them exactly enough; 10**400 does not fit one)."""
MAX_FORMULA_EXPONENT = 16
"""The largest exponent a cost formula may use (s**2 is typical)."""
MAX_FORMULA_TOKENS = 200
"""The most numbers, names and operators a cost formula may have (the analytic pass's longest has 37)."""
MAX_FORMULA_ARGUMENTS = 32
"""The most commas (function arguments after the first) a cost formula may have."""
FORMULA_FUNCTIONS = frozenset({"Min", "Max", "ceiling", "floor", "sqrt", "log", "exp", "Abs"})
"""The functions a cost formula may call; its other names are symbols (b, s, ...)."""


@dataclass(frozen=True, slots=True)
class LayerCost:
    name: str
    kind: str = "block"
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    backward_weight_ms: float | None = None
    activation_bytes: int | None = None
    output_bytes: int | None = None
    param_bytes: int | None = None
    formulas: tuple[tuple[str, str], ...] = ()
    """(name, sympy expression text) pairs, e.g. ("forward_flops", "24*b*s*h**2")."""
    backward_full_ms: float | None = None
    """B and W run as one op (a full backward, as 1F1B runs it) where measured apart from
    `backward_ms`, the two run separately (W deferred, its inputs no longer in cache); absent:
    `backward_ms`."""
    accumulate_ms: float | None = None
    """One microbatch's addition of this layer's parameter gradients into `.grad`; the backward
    times carry the table's accumulating share of it (see the module docstring). None: not known."""
    accumulate_weight_ms: float | None = None
    """W's part of `accumulate_ms` (the gradients W computes; the rest is B's)."""
    selective_activation_bytes: int | None = None
    """Bytes held from F to B under selective recomputation (see the module docstring)."""
    selective_recompute_ms: float | None = None
    """What B pays first under selective recomputation: the forward of the ops it recomputes."""
    forward_no_grad_ms: float | None = None
    """F on a stage that recomputes its activations: it keeps no autograd graph (its B runs the
    forward again, at `forward_ms`). None: `forward_ms`."""
    weight_stash_bytes: int | None = None
    """Bytes a split backward's B leaves for its W (see the module docstring). None: not known,
    the memory model's `weight_memory_fraction` of `activation_bytes`."""
    unsaved_input_bytes: int | None = None
    """Bytes of the layer's inputs from earlier layers that its backward does not save, held from F
    to B where the layer starts a stage (see the module docstring). None: 0."""

    def formula(self, name: str) -> sympy.Expr:
        for key, text in self.formulas:
            if key == name:
                return parse_formula(text, f"layer {self.name!r}: formula {key!r}")
        raise KeyError(f"layer {self.name!r} has no formula {name!r}; it has {[k for k, _ in self.formulas]}")

    def _fields(self) -> list[tuple[str, object]]:
        return [
            ("name", self.name), ("kind", self.kind), ("forward_ms", self.forward_ms),
            ("backward_ms", self.backward_ms), ("backward_weight_ms", self.backward_weight_ms),
            ("backward_full_ms", self.backward_full_ms), ("accumulate_ms", self.accumulate_ms),
            ("accumulate_weight_ms", self.accumulate_weight_ms), ("activation_bytes", self.activation_bytes),
            ("output_bytes", self.output_bytes), ("param_bytes", self.param_bytes),
            ("selective_activation_bytes", self.selective_activation_bytes),
            ("selective_recompute_ms", self.selective_recompute_ms), ("forward_no_grad_ms", self.forward_no_grad_ms),
            ("weight_stash_bytes", self.weight_stash_bytes), ("unsaved_input_bytes", self.unsaved_input_bytes),
            *(("f." + key, text) for key, text in self.formulas),
        ]

    def __str__(self) -> str:
        return "layer " + format_fields(self._fields())

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {key: value for key, value in self._fields()
                                if value is not None and not key.startswith("f.")}
        if self.formulas:
            data["formulas"] = dict(self.formulas)
        return data


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """A parameter several layers read (a tied embedding and head)."""

    name: str
    layers: tuple[int, ...]
    """Indices of the layers that read it (two or more, ascending)."""
    bytes: int
    """Its size in the training dtype: the gradient all-reduced when its layers sit on different devices."""

    def __str__(self) -> str:
        return "tied " + format_fields([("name", self.name), ("layers", ",".join(map(str, self.layers))),
                                        ("bytes", self.bytes)])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers), "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class SkipTensor:
    """A tensor one layer produces for layers beyond the next one."""

    name: str
    producer: int
    """Index of the layer that produces it."""
    consumers: tuple[int, ...]
    """Indices of the layers that read it: ascending, after the producer, the last beyond the next layer."""
    bytes: int
    """Its size per microbatch (its gradient, sent back, is as big)."""

    def __str__(self) -> str:
        return "skip " + format_fields([("name", self.name), ("from", self.producer),
                                        ("to", ",".join(map(str, self.consumers))), ("bytes", self.bytes)])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "from": self.producer, "to": list(self.consumers), "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class CostTable:
    layers: tuple[LayerCost, ...]
    model: str = ""
    weight_fraction: float = DEFAULT_WEIGHT_FRACTION
    tied: tuple[TiedParameter, ...] = ()
    """Parameters shared by several layers (see the module docstring)."""
    skips: tuple[SkipTensor, ...] = ()
    """Tensors that skip layers (see the module docstring)."""
    num_microbatches: int | None = None
    """The step's microbatch count M whose gradient accumulation, (M-1)/M of each layer's
    `accumulate_ms`, the backward times include (None: they include none)."""
    _derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
            raise CostTableError(f"cost table {self.model!r}: layers must be a list of LayerCost, got "
                                 f"{type(self.layers).__name__}")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise CostTableError(f"cost table {self.model!r}: has no layers")
        if not is_finite_number(self.weight_fraction):
            raise CostTableError(f"cost table {self.model!r}: weight_fraction must be a number in [0, 1], got "
                                 f"{self.weight_fraction!r:.40}")
        for name, items, kind in (("layers", self.layers, LayerCost), ("tied", self.tied, TiedParameter),
                                  ("skips", self.skips, SkipTensor)):
            wrong = next((item for item in (items or ()) if not isinstance(item, kind)), None)
            if wrong is not None:
                raise CostTableError(f"cost table {self.model!r}: {name} must hold {kind.__name__} objects (files: "
                                     f"CostTable.load), got {type(wrong).__name__}")
        seen: dict[str, int] = {}
        for index, layer in enumerate(self.layers):
            where = f"cost table {self.model!r}: layer {index} ({layer.name!r})"
            _check_layer(layer, where)
            if layer.name in seen:
                raise CostTableError(f"{where}: name already used by layer {seen[layer.name]}; names must be unique")
            seen[layer.name] = index
        if not 0 <= self.weight_fraction <= 1:
            raise CostTableError(f"cost table {self.model!r}: weight_fraction must be in [0, 1], got {self.weight_fraction}")
        object.__setattr__(self, "tied", tuple(self.tied))
        for tied in self.tied:
            _check_tied(tied, len(self.layers), f"cost table {self.model!r}: tied parameter {tied.name!r}")
        object.__setattr__(self, "skips", tuple(self.skips))
        for skip in self.skips:
            _check_skip(skip, len(self.layers), f"cost table {self.model!r}: skip tensor {skip.name!r}")
        m = self.num_microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise CostTableError(f"cost table {self.model!r}: num_microbatches must be a positive integer (the "
                                 f"microbatches its gradient accumulation was costed for) or absent, got {m!r}")
        share = _accumulating(m)
        for index, layer in enumerate(self.layers):
            if share and layer.accumulate_ms is not None:
                _check_accumulation(layer, share, m, self.weight_fraction,
                                    f"cost table {self.model!r}: layer {index} ({layer.name!r})")

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerCost]:
        return iter(self.layers)

    def __getitem__(self, index: int) -> LayerCost:
        return self.layers[index]

    # -- derived per-layer arrays (cached: the simulator and tuner read them in hot loops) ----
    def _array(self, key: str, values: Iterable[float]) -> tuple[float, ...]:
        cached = self._derived.get(key)
        if cached is None:
            cached = self._derived[key] = tuple(values)
        return cached

    @property
    def forward(self) -> tuple[float, ...]:
        """F time of each layer, ms."""
        return self._array("forward", (layer.forward_ms for layer in self.layers))

    @property
    def forward_no_grad(self) -> tuple[float, ...]:
        """F time of each layer on a stage that recomputes (no autograd graph kept), ms."""
        return self._array("forward_no_grad", (layer.forward_ms if layer.forward_no_grad_ms is None
                                               else layer.forward_no_grad_ms for layer in self.layers))

    @property
    def forward_least(self) -> tuple[float, ...]:
        """The least F time of each layer, with or without autograd, ms (for lower bounds)."""
        return self._array("forward_least", map(min, self.forward, self.forward_no_grad))

    @property
    def weight(self) -> tuple[float, ...]:
        """W time of each layer, ms (stated or `weight_fraction` of the backward)."""
        return self._array("weight", (self.weight_ms(layer) for layer in self.layers))

    @property
    def backward_input(self) -> tuple[float, ...]:
        """B time of each layer when W is split off, ms."""
        return self._array("backward_input", (layer.backward_ms - w for layer, w in zip(self.layers, self.weight)))

    @property
    def backward_full(self) -> tuple[float, ...]:
        """Time of each layer's full backward (B and W in one op), ms."""
        return self._array("backward_full", (layer.backward_ms if layer.backward_full_ms is None
                                             else layer.backward_full_ms for layer in self.layers))

    @property
    def activation(self) -> tuple[float, ...]:
        return self._array("activation", (float(layer.activation_bytes or 0) for layer in self.layers))

    @property
    def output(self) -> tuple[float, ...]:
        return self._array("output", (float(layer.output_bytes or 0) for layer in self.layers))

    @property
    def params(self) -> tuple[float, ...]:
        return self._array("params", (float(layer.param_bytes or 0) for layer in self.layers))

    def weight_ms(self, layer: LayerCost) -> float:
        if layer.backward_weight_ms is not None:
            return layer.backward_weight_ms
        return layer.backward_ms * self.weight_fraction

    @property
    def selective_activation(self) -> tuple[float, ...]:
        """Bytes each layer holds from F to B under selective recomputation (its activation bytes
        where the table does not say)."""
        return self._array("selective_activation", (
            float(layer.activation_bytes or 0) if layer.selective_activation_bytes is None
            else float(layer.selective_activation_bytes) for layer in self.layers))

    @property
    def weight_stash(self) -> tuple[float, ...]:
        """Bytes each layer's B leaves for its W where the table says (0 where it does not)."""
        return self._array("weight_stash", (float(layer.weight_stash_bytes or 0) for layer in self.layers))

    @property
    def weight_stash_unknown(self) -> tuple[float, ...]:
        """The activation bytes of each layer whose weight stash the table does not say (0 where it
        does): what the memory model's `weight_memory_fraction` applies to."""
        return self._array("weight_stash_unknown", (float(layer.activation_bytes or 0) if layer.weight_stash_bytes is None
                                                    else 0.0 for layer in self.layers))

    @property
    def unsaved_input(self) -> tuple[float, ...]:
        """Bytes of each layer's inputs its backward does not save (held where it starts a stage)."""
        return self._array("unsaved_input", (float(layer.unsaved_input_bytes or 0) for layer in self.layers))

    def weight_stash_with(self, fraction: float) -> tuple[float, ...]:
        """Bytes each layer's B leaves for its W: stated, or `fraction` of its activation bytes."""
        return tuple(known + fraction * unknown for known, unknown in zip(self.weight_stash, self.weight_stash_unknown))

    @property
    def selective_recompute(self) -> tuple[float, ...]:
        """Each layer's B's extra time under selective recomputation, ms (0 where not known)."""
        return self._array("selective_recompute", (layer.selective_recompute_ms or 0.0 for layer in self.layers))

    @property
    def has_selective_info(self) -> bool:
        """Whether the table knows what selective recomputation holds and costs (some layer says)."""
        return any(layer.selective_activation_bytes is not None for layer in self.layers)

    def selective_unknown(self, start: int, end: int) -> int | None:
        """The first layer of [start, end) whose selective recomputation the table does not know
        (no `selective_activation_bytes`): a stage holding it is not recomputed selectively. None: all known."""
        missing = self._derived.get("selective_unknown")
        if missing is None:
            missing = self._derived["selective_unknown"] = tuple(
                index for index, layer in enumerate(self.layers) if layer.selective_activation_bytes is None)
        return next((index for index in missing if start <= index < end), None)

    def without_selective(self, layers: Iterable[int]) -> CostTable:
        """This table with what selective recomputation holds and costs removed from `layers`
        (layers it cannot run), so that no plan of it recomputes them selectively."""
        drop = set(layers)
        if not any(self.layers[i].selective_activation_bytes is not None for i in drop):
            return self
        return self.replace_layers(replace(layer, selective_activation_bytes=None, selective_recompute_ms=None)
                                   if index in drop else layer for index, layer in enumerate(self.layers))

    @property
    def has_memory_info(self) -> bool:
        return any(layer.activation_bytes is not None for layer in self.layers)

    def total_ms(self) -> float:
        return sum(self.forward) + sum(self.backward_full)

    def prefix(self, key: str) -> tuple[float, ...]:
        """Prefix sums of a per-layer array (`forward`, `backward_full`, ...): O(1) range sums."""
        cache_key = "prefix:" + key
        cached = self._derived.get(cache_key)
        if cached is None:
            total, sums = 0.0, [0.0]
            for value in getattr(self, key):
                total += value
                sums.append(total)
            cached = self._derived[cache_key] = tuple(sums)
        return cached

    def range_sum(self, key: str, start: int, end: int) -> float:
        sums = self.prefix(key)
        return sums[end] - sums[start]

    def replace_layers(self, layers: Iterable[LayerCost]) -> CostTable:
        return replace(self, layers=tuple(layers), _derived={})

    @property
    def accumulates(self) -> bool:
        """Whether the table knows what gradient accumulation costs (some layer's `accumulate_ms`)."""
        known = self._derived.get("accumulates")
        if known is None:
            known = self._derived["accumulates"] = any(layer.accumulate_ms is not None for layer in self.layers)
        return known

    def for_microbatches(self, num_microbatches: int) -> CostTable:
        """This table for a step of `num_microbatches`: each layer's backward carries (M-1)/M of
        its `accumulate_ms` (W its `accumulate_weight_ms` share) in place of the share it was
        costed with. A table that does not know accumulation's cost is returned as it is."""
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise CostTableError(f"cost table {self.model!r}: for_microbatches needs a positive integer, got "
                                 f"{num_microbatches!r}")
        if num_microbatches == self.num_microbatches or not self.accumulates:
            return self
        key = f"microbatches:{num_microbatches}"
        cached = self._derived.get(key)
        if cached is None:
            had = _accumulating(self.num_microbatches)
            change = _accumulating(num_microbatches) - had
            layers = []
            for layer in self.layers:
                if layer.accumulate_ms is None:
                    layers.append(layer)
                    continue
                total, weight = layer.accumulate_ms, layer.accumulate_weight_ms or 0.0
                # (the table was checked to hold its share: max/min only absorb rounding)
                backward = max(0.0, layer.backward_ms + change * total)
                stated = layer.backward_weight_ms
                if stated is None and layer.accumulate_weight_ms is not None:
                    stated = self.weight_fraction * layer.backward_ms  # made explicit: W's share moves apart
                layers.append(replace(
                    layer, backward_ms=backward,
                    backward_weight_ms=None if stated is None else min(backward, max(0.0, stated + change * weight)),
                    backward_full_ms=(None if layer.backward_full_ms is None
                                      else max(0.0, layer.backward_full_ms + change * total))))
            cached = self._derived[key] = replace(self, layers=tuple(layers), num_microbatches=num_microbatches,
                                                  _derived={})
        return cached

    # -- text form --------------------------------------------------------------------------
    def __str__(self) -> str:
        head = "costs " + format_fields(
            [("model", self.model or None), ("weight_fraction", self.weight_fraction),
             ("num_microbatches", self.num_microbatches), ("layers", len(self.layers))]
        )
        return "\n".join([head, *(str(layer) for layer in self.layers), *(str(tied) for tied in self.tied),
                          *(str(skip) for skip in self.skips)]) + "\n"

    @classmethod
    def parse(cls, text: str) -> CostTable:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines:
            raise ParseError("cost table text is empty")
        keyword, tokens, where = record("costs", lines[0][1], lines[0][0])
        if keyword != "costs":
            raise ParseError(f"{where}: expected 'costs ...', got {keyword!r}")
        head = FieldReader(parse_fields(tokens, where), where)
        model = head.str("model", default="")
        weight_fraction = head.float("weight_fraction", DEFAULT_WEIGHT_FRACTION)
        num_microbatches = head.optional_int("num_microbatches")
        count = head.int("layers")
        head.done()
        layers = []
        tied: list[TiedParameter] = []
        skips: list[SkipTensor] = []
        for number, line in lines[1:]:
            keyword, tokens, where = record("layer", line, number)
            if keyword == "tied":
                reader = FieldReader(parse_fields(tokens, where), where)
                tied.append(TiedParameter(reader.str("name"), reader.ints("layers"), reader.int("bytes")))
                reader.done()
                continue
            if keyword == "skip":
                reader = FieldReader(parse_fields(tokens, where), where)
                skips.append(SkipTensor(reader.str("name"), reader.int("from"), reader.ints("to"), reader.int("bytes")))
                reader.done()
                continue
            if keyword != "layer":
                raise ParseError(f"{where}: expected 'layer ...', 'tied ...' or 'skip ...', got {keyword!r}")
            if tied or skips:
                raise ParseError(f"{where}: 'layer' line after a '{'tied' if tied else 'skip'}' line; tied parameters "
                                 "and skip tensors come after the layers")
            reader = FieldReader(parse_fields(tokens, where), where)
            layer = LayerCost(
                name=reader.str("name"),
                kind=reader.str("kind"),
                forward_ms=reader.float("forward_ms"),
                backward_ms=reader.float("backward_ms"),
                backward_weight_ms=reader.optional_float("backward_weight_ms"),
                backward_full_ms=reader.optional_float("backward_full_ms"),
                accumulate_ms=reader.optional_float("accumulate_ms"),
                accumulate_weight_ms=reader.optional_float("accumulate_weight_ms"),
                activation_bytes=reader.optional_int("activation_bytes"),
                output_bytes=reader.optional_int("output_bytes"),
                param_bytes=reader.optional_int("param_bytes"),
                selective_activation_bytes=reader.optional_int("selective_activation_bytes"),
                selective_recompute_ms=reader.optional_float("selective_recompute_ms"),
                forward_no_grad_ms=reader.optional_float("forward_no_grad_ms"),
                weight_stash_bytes=reader.optional_int("weight_stash_bytes"),
                unsaved_input_bytes=reader.optional_int("unsaved_input_bytes"),
            )
            formulas: list[tuple[str, str]] = []
            for key, value in reader.rest().items():
                if not key.startswith("f.") or value is None:
                    raise ParseError(f"{where}: unknown field {key!r}")
                formulas.append((key[2:], value))
            layers.append(replace(layer, formulas=tuple(formulas)))
        if len(layers) != count:
            raise ParseError(f"cost table header says layers={count}, found {len(layers)} layer lines")
        try:
            return cls(tuple(layers), model=model, weight_fraction=weight_fraction, tied=tuple(tied), skips=tuple(skips),
                       num_microbatches=num_microbatches)
        except CostTableError as exc:
            raise ParseError(str(exc)) from None

    # -- JSON / YAML ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.model:
            data["model"] = self.model
        data["weight_fraction"] = self.weight_fraction
        if self.num_microbatches is not None:
            data["num_microbatches"] = self.num_microbatches
        data["layers"] = [layer.to_dict() for layer in self.layers]
        if self.tied:
            data["tied"] = [tied.to_dict() for tied in self.tied]
        if self.skips:
            data["skips"] = [skip.to_dict() for skip in self.skips]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: Any, source: str = "cost table") -> CostTable:
        """Build from the file form. Top-level keys beyond the known ones (like `source`) are notes
        and ignored, unless they look like a misspelt known key; a layer's unknown keys are refused."""
        if not isinstance(data, dict):
            raise CostTableError(f"{source}: expected an object with a 'layers' list, got {type(data).__name__}")
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list) or not raw_layers:
            raise CostTableError(f"{source}: 'layers' must be a non-empty list of layer objects")
        weight_fraction = data.get("weight_fraction", DEFAULT_WEIGHT_FRACTION)
        if not is_finite_number(weight_fraction) or not 0 <= weight_fraction <= 1:
            raise CostTableError(f"{source}: 'weight_fraction' must be a number in [0, 1], got {weight_fraction!r}")
        for key in data:
            close = difflib.get_close_matches(str(key), _TABLE_KEYS, n=1, cutoff=0.75)
            if key not in _TABLE_KEYS and close:
                raise CostTableError(f"{source}: unknown key {key!r}; did you mean {close[0]!r}? (other keys, like "
                                     "'source', are kept as notes and ignored)")
        layers = []
        seen: dict[str, int] = {}
        for index, raw in enumerate(raw_layers):
            layer = _layer_from_dict(raw, index, source)
            if layer.name in seen:
                raise CostTableError(
                    f"{source}: layer {index} ({layer.name!r}): name already used by layer {seen[layer.name]}; names must be unique"
                )
            seen[layer.name] = index
            layers.append(layer)
        raw_tied = data.get("tied", [])
        if not isinstance(raw_tied, list):
            raise CostTableError(f"{source}: 'tied' must be a list of {{name, layers, bytes}} objects, got {type(raw_tied).__name__}")
        tied = tuple(_tied_from_dict(raw, index, source, len(layers)) for index, raw in enumerate(raw_tied))
        raw_skips = data.get("skips", [])
        if not isinstance(raw_skips, list):
            raise CostTableError(f"{source}: 'skips' must be a list of {{name, from, to, bytes}} objects, got "
                                 f"{type(raw_skips).__name__}")
        skips = tuple(_skip_from_dict(raw, index, source, len(layers)) for index, raw in enumerate(raw_skips))
        num_microbatches = data.get("num_microbatches")
        if num_microbatches is not None and (not is_finite_number(num_microbatches) or not float(num_microbatches).is_integer()
                                             or not 1 <= num_microbatches <= 2**31):
            raise CostTableError(f"{source}: 'num_microbatches' must be a positive integer (the microbatches its "
                                 f"gradient accumulation was costed for), got {num_microbatches!r}")
        model = data.get("model") or ""
        if not isinstance(model, str):
            raise CostTableError(f"{source}: 'model' must be the model's name (a string), got {model!r}")
        return cls(tuple(layers), model=model, weight_fraction=float(weight_fraction), tied=tied,
                   skips=skips, num_microbatches=None if num_microbatches is None else int(num_microbatches))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        path = Path(path)
        text = read_text(path, CostTableError, "cost table")
        if text.lstrip().startswith("costs "):  # the text form (what `octopipe dump --level costs` writes)
            try:
                table = cls.parse(text)
            except ParseError as exc:
                raise CostTableError(f"{path}: {exc}") from None
            return table if table.model else replace(table, model=path.stem, _derived={})
        if path.suffix in (".yaml", ".yml"):
            data = parse_yaml(text, str(path), CostTableError)
        else:
            data = parse_json(text, str(path), CostTableError)
        table = cls.from_dict(data, source=str(path))
        if not table.model:
            table = replace(table, model=path.stem, _derived={})
        return table


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that a float holds finitely: no NaN, no inf, no 400-digit int."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _check_accumulation(layer: LayerCost, share: float, num_microbatches: int | None, weight_fraction: float,
                        where: str) -> None:
    """A table costed for M microbatches carries (M-1)/M of each layer's accumulation in its
    backward times: they cannot be less than that share (else re-costing it would go negative)."""
    total, weight = layer.accumulate_ms or 0.0, layer.accumulate_weight_ms or 0.0
    stated_weight = layer.backward_weight_ms if layer.backward_weight_ms is not None else (
        weight_fraction * layer.backward_ms if layer.accumulate_weight_ms is not None else None)
    parts = [("backward_ms", layer.backward_ms, total), ("backward_full_ms", layer.backward_full_ms, total),
             ("backward_weight_ms", stated_weight, weight),
             ("backward_ms - backward_weight_ms", None if stated_weight is None else layer.backward_ms - stated_weight,
              total - weight)]
    for name, value, part in parts:
        if value is not None and value < share * part - 1e-9 * max(1.0, abs(value)):
            raise CostTableError(
                f"{where}: {name}={value:g} is less than the gradient accumulation it must include, "
                f"{share:g} x {part:g} ms ((M-1)/M of it, num_microbatches={num_microbatches}); fix the times, "
                "or num_microbatches (the count the table was costed for), or drop the accumulate fields")


def _yaml_hint(value: object) -> str:
    """YAML 1.1 (PyYAML) reads 1e-3 as a string: say how to write it."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return " (YAML reads a number like 1e-3 as text: write 1.0e-3)"
    return ""


def _accumulating(num_microbatches: int | None) -> float:
    """The share of a step's microbatches that add their gradients into `.grad`: all but the first."""
    return 0.0 if num_microbatches is None else (num_microbatches - 1) / num_microbatches


def _layer_from_dict(raw: Any, index: int, source: str) -> LayerCost:
    where = f"{source}: layer {index}"
    if not isinstance(raw, dict):
        raise CostTableError(f"{where}: expected an object with forward_ms/backward_ms, got {type(raw).__name__}")
    name = raw.get("name", f"layer{index}")
    if not isinstance(name, str) or not name:
        raise CostTableError(f"{where}: field 'name' must be a non-empty string, got {name!r}")
    where = f"{source}: layer {index} ({name!r})"
    unknown = [key for key in raw if key not in _LAYER_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), _LAYER_KEYS, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise CostTableError(f"{where}: unknown field {unknown[0]!r}; {hint}a layer's fields are {', '.join(_LAYER_KEYS)}")
    values: dict[str, Any] = {}
    for key in _TIME_FIELDS:
        if key not in raw:
            raise CostTableError(f"{where}: missing field {key!r} (milliseconds per microbatch)")
        values[key] = raw[key]
    for key in (*_OPTIONAL_TIME_FIELDS, *_BYTE_FIELDS):
        if raw.get(key) is not None:
            values[key] = raw[key]
    kind = raw.get("kind", "block")
    if not isinstance(kind, str):
        raise CostTableError(f"{where}: field 'kind' must be a string, got {kind!r}")
    formulas = raw.get("formulas", {})
    if not isinstance(formulas, dict) or not all(isinstance(v, str) for v in formulas.values()):
        raise CostTableError(f"{where}: field 'formulas' must map names to expression strings")
    for key in _BYTE_FIELDS:
        if key in values and is_finite_number(values[key]) and float(values[key]).is_integer():
            values[key] = int(values[key])
    layer = LayerCost(name=name, kind=kind, formulas=tuple(formulas.items()), **values)
    _check_layer(layer, where)
    return layer


def _tied_from_dict(raw: Any, index: int, source: str, num_layers: int) -> TiedParameter:
    where = f"{source}: tied {index}"
    if not isinstance(raw, dict) or set(raw) - {"name", "layers", "bytes"}:
        raise CostTableError(f"{where}: expected an object with keys name, layers, bytes, got {raw!r}")
    name, layers = raw.get("name"), raw.get("layers")
    size: Any = raw.get("bytes")  # a JSON value: _check_tied below says what is wrong with it
    if not isinstance(name, str) or not name:
        raise CostTableError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    if not isinstance(layers, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise CostTableError(f"{where} ({name!r}): 'layers' must be a list of layer indices, got {layers!r}")
    if is_finite_number(size) and float(size).is_integer():
        size = int(size)
    tied = TiedParameter(name, tuple(layers), size)
    _check_tied(tied, num_layers, f"{where} ({name!r})")
    return tied


def _skip_from_dict(raw: Any, index: int, source: str, num_layers: int) -> SkipTensor:
    where = f"{source}: skip {index}"
    if not isinstance(raw, dict) or set(raw) - {"name", "from", "to", "bytes"}:
        raise CostTableError(f"{where}: expected an object with keys name, from, to, bytes, got {raw!r}")
    name, producer, consumers = raw.get("name"), raw.get("from"), raw.get("to")
    size: Any = raw.get("bytes")  # a JSON value: _check_skip below says what is wrong with it
    if not isinstance(name, str) or not name:
        raise CostTableError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    if not isinstance(producer, int) or isinstance(producer, bool):
        raise CostTableError(f"{where} ({name!r}): 'from' must be a layer index, got {producer!r}")
    if not isinstance(consumers, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in consumers):
        raise CostTableError(f"{where} ({name!r}): 'to' must be a list of layer indices, got {consumers!r}")
    if is_finite_number(size) and float(size).is_integer():
        size = int(size)
    skip = SkipTensor(name, producer, tuple(consumers), size)
    _check_skip(skip, num_layers, f"{where} ({name!r})")
    return skip


def _check_skip(skip: SkipTensor, num_layers: int, where: str) -> None:
    if not isinstance(skip.name, str) or not skip.name:
        raise CostTableError(f"{where}: name must be a non-empty string, got {skip.name!r}")
    if not 0 <= skip.producer < num_layers:
        raise CostTableError(f"{where}: producer layer {skip.producer} outside 0..{num_layers - 1}")
    consumers = list(skip.consumers)
    if not consumers or consumers != sorted(set(consumers)) or consumers[0] <= skip.producer:
        raise CostTableError(f"{where}: consumers must be distinct indices in ascending order after the producer "
                             f"{skip.producer}, got {consumers}")
    if consumers[-1] >= num_layers:
        raise CostTableError(f"{where}: consumers {consumers} outside 0..{num_layers - 1}")
    if consumers[-1] <= skip.producer + 1:
        raise CostTableError(f"{where}: only read by the next layer ({consumers}): that is the layer's output, "
                             "not a skip tensor")
    if not isinstance(skip.bytes, int) or isinstance(skip.bytes, bool) or not 0 <= skip.bytes < MAX_BYTES:
        raise CostTableError(f"{where}: bytes must be a non-negative integer below 2**62, got {skip.bytes!r:.40}")


def _check_tied(tied: TiedParameter, num_layers: int, where: str) -> None:
    layers = tied.layers
    if len(layers) < 2 or list(layers) != sorted(set(layers)):
        raise CostTableError(f"{where}: layers must be two or more distinct indices in ascending order, got {list(layers)}")
    if layers[0] < 0 or layers[-1] >= num_layers:
        raise CostTableError(f"{where}: layers {list(layers)} outside 0..{num_layers - 1}")
    if not isinstance(tied.bytes, int) or isinstance(tied.bytes, bool) or not 0 <= tied.bytes < MAX_BYTES:
        raise CostTableError(f"{where}: bytes must be a non-negative integer below 2**62, got {tied.bytes!r:.40}")


def _check_layer(layer: LayerCost, where: str) -> None:
    for key in (*_TIME_FIELDS, *_OPTIONAL_TIME_FIELDS):
        value = getattr(layer, key)
        if value is None and key in _OPTIONAL_TIME_FIELDS:
            continue
        if not is_finite_number(value) or not 0 <= value <= MAX_LAYER_MS:
            raise CostTableError(f"{where}: field {key!r} must be a number of milliseconds in [0, {MAX_LAYER_MS:.0e}] "
                                 f"(per layer and microbatch), got {value!r}{_yaml_hint(value)}")
    if (layer.accumulate_weight_ms or 0.0) > (layer.accumulate_ms or 0.0):
        raise CostTableError(f"{where}: accumulate_weight_ms={layer.accumulate_weight_ms} exceeds accumulate_ms="
                             f"{layer.accumulate_ms}; it is W's part of the accumulation, so it must be part of it")
    if layer.backward_weight_ms is not None and layer.backward_weight_ms > layer.backward_ms:
        raise CostTableError(
            f"{where}: backward_weight_ms={layer.backward_weight_ms} exceeds backward_ms={layer.backward_ms}; "
            "backward_ms is input plus weight gradient, so W must be part of it"
        )
    for key in _BYTE_FIELDS:
        value = getattr(layer, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_BYTES):
            raise CostTableError(f"{where}: field {key!r} must be a non-negative integer of bytes below 2**62, got "
                                 f"{value!r:.40}")
    if not isinstance(layer.name, str) or not layer.name:
        raise CostTableError(f"{where}: name must be a non-empty string")
    if isinstance(layer.formulas, (str, dict)) or not all(isinstance(pair, tuple) and len(pair) == 2
                                                          for pair in layer.formulas):
        raise CostTableError(f"{where}: formulas must be (name, expression) pairs, like (('forward_flops', "
                             f"'24*b*s'),), got {layer.formulas!r:.60}")
    for key, text in layer.formulas:
        if not isinstance(key, str) or not _FORMULA_NAME.fullmatch(key) or not isinstance(text, str):
            raise CostTableError(f"{where}: formula {key!r}: names are letters, digits, '_' and '.' (like "
                                 "forward_flops) and expressions are strings")
        parse_formula(text, f"{where}: formula {key!r}")


def parse_formula(text: str, where: str = "formula") -> sympy.Expr:
    """The sympy expression of a cost formula's text. Only numbers, symbol names, + - * / ** ( ) ,
    and calls of `FORMULA_FUNCTIONS` are accepted, so no text reaches sympy's parser (which
    evaluates Python) that could do more than build an expression; exponents are bounded by
    `MAX_FORMULA_EXPONENT`. Raises CostTableError. Cached by text (every table checks its
    layers' formulas when it is made)."""
    try:
        return _parse_formula(text)
    except _FormulaError as exc:
        raise CostTableError(f"{where}: {exc}") from None


class _FormulaError(Exception):
    pass


@functools.lru_cache(maxsize=8192)
def _parse_formula(text: str) -> sympy.Expr:
    position, previous, count, commas, names = 0, None, 0, 0, {}
    while position < len(text):
        match = _FORMULA_TOKEN.match(text, position)
        if match is None or match.end() == position:
            if text[position:].strip() == "":
                break
            raise _FormulaError(f"cannot read {text[position:position + 20]!r} in {text!r}; a formula is "
                               "numbers, names (b, s, ...), + - * / ** ( ) and " + ", ".join(sorted(FORMULA_FUNCTIONS)))
        if match.group("op") == "(" and previous is not None and previous.group("name") is not None \
                and previous.group("name") not in FORMULA_FUNCTIONS:
            raise _FormulaError(f"{previous.group('name')!r} is not a formula function in {text!r}; use "
                               + ", ".join(sorted(FORMULA_FUNCTIONS)))
        name = match.group("name")
        if name is not None and keyword.iskeyword(name):
            raise _FormulaError(f"{name!r} in {text!r} is a Python keyword, not a symbol")
        if name is not None and name not in FORMULA_FUNCTIONS:
            names[name] = sympy.Symbol(name)
        previous, position, count = match, match.end(), count + 1
        commas += match.group("op") == ","
        if commas > MAX_FORMULA_ARGUMENTS:  # sympy's Min and Max take seconds for a hundred
            raise _FormulaError(f"{text[:40]!r}... passes more than {MAX_FORMULA_ARGUMENTS} function arguments")
        if count > MAX_FORMULA_TOKENS:
            raise _FormulaError(f"{text[:40]!r}... is longer than {MAX_FORMULA_TOKENS} numbers, names and operators")
    if previous is None:
        raise _FormulaError("the formula is empty")
    try:
        unevaluated = sympy.sympify(text, locals=names, evaluate=False)
    except (sympy.SympifyError, SyntaxError, TypeError, ValueError, RecursionError):
        raise _FormulaError(f"cannot parse {text!r} as an expression (unbalanced or misplaced "
                           "parts)") from None
    if not isinstance(unevaluated, sympy.Expr):
        raise _FormulaError(f"{text!r} is not an expression")
    for power in unevaluated.atoms(sympy.Pow):  # 9**9**9 or (9**16)**16... would take sympy hours
        if power.base.atoms(sympy.Pow) or power.exp.atoms(sympy.Pow):
            raise _FormulaError(f"{power} in {text!r}: a power of a power; write the product of the exponents")
        if power.exp.is_Number and abs(power.exp) > MAX_FORMULA_EXPONENT:
            raise _FormulaError(f"exponent {power.exp} in {text!r} is too large (at most {MAX_FORMULA_EXPONENT})")
    return sympy.sympify(text, locals=names)
