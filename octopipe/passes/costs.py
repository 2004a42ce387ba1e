"""analytic costs: LayerGraph + ClusterSpec -> CostTable, the pass `costs`.

Consumes a traced LayerGraph (its GraphModule) and a ClusterSpec; produces a CostTable whose
layers carry forward / input-gradient / weight-gradient times, activation, output and parameter
bytes, and the sympy formulas they came from, in the batch symbol `b` (microbatch size) and the
sequence symbol `s`. Nothing runs on a device: it works for paper-size models built on the meta
device.

Symbolic shapes. Shapes are propagated without compute (meta tensors for a meta model,
FakeTensors otherwise) at three sizes (b0, s0), (b1, s0) and (b0, s1): b0 = the example's batch
(reusing the trace's own propagation) or 2 when that is 1, b1 = b0 + 1, s0 = the example's
sequence length, s1 = s0 // 2. Every dim of every node is then fitted as c * b^i * s^j (exponents
from the ratios between runs, so model dims that happen to equal b or s cannot be mistaken for
them), or, failing that, as b^i * (a*s + k) (padding, `s + 3`). A graph that cannot be re-run at
other sizes (a static torch.export graph) falls back to mapping the example's own sizes: a dim
equal to the example batch is b, to its sequence s, to their product b*s. The batch dim is dim 0
of every input; the sequence dim is dim 1 of 2-D integer ([b, s] ids) and 3-D ([b, s, d]) inputs,
none of 2-D floats ([b, features]) and 4-D (images); `seq_dims` overrides this per input.

Per-op rules (FLOPs count a multiply-add as 2; bytes are reads + writes, floats at `dtype_bytes`,
integer tensors at their own size; cross-entropy and its log-softmax in fp32, as autocast does):
- matmuls (linear, mm/bmm/addmm, matmul, einsum, conv): forward 2*M*K*N. Input gradient: the
  same again for each operand that is an activation needing grad; weight gradient: the same for
  each operand that is a parameter (the weight matmuls). Bytes: operands + output.
- scaled_dot_product_attention: 4*b*h*sq*sk*d forward, sk cut to the causal half when causal and
  to the window when the owning module has `sliding_window` = w (sq*min(s, w) - min(s, w)^2/2
  keys in all). Input gradient 2.5x forward (FlashAttention's backward: five matmuls for two).
  Explicit attention (QK^T, softmax, AV as separate ops) is priced op by op, fully.
- embedding: no FLOPs; bytes of the gathered rows; the weight gradient scatters them back and
  writes the dense gradient table.
- norms 5 FLOPs/element, softmax 5, cross-entropy 5 per logit, transcendental elementwise
  (exp, tanh, silu, gelu, ...) 4, other elementwise 1; views cost nothing; copies move bytes.
  Their input gradient repeats the forward FLOPs with out + 2*input bytes; an elementwise op or
  norm that reads a parameter (norm scale, bias) adds a weight-gradient reduction.
- MoE: in a module with `num_experts` and `top_k` (also `num_local_experts`/
  `num_experts_per_tok`, Hugging Face style), ops on per-expert tensors (an expert dim that is
  not the last dim) are scaled by top_k / num_experts: only the active experts are counted
  (the shared experts are ordinary ops); the expert weights are still all read and all get
  gradients, so their bytes are not scaled, and parameter bytes keep every expert. Hugging Face
  blocks that dispatch tokens by routing (data-dependent shapes) are priced from the example's
  routing as traced.
- Mamba-2: in a module with `d_state`, `num_heads` and `head_dim` (or `ssm_state_size`), ops
  quadratic in s (the reference model's matrix form of SSD) are replaced by the chunked SSD
  algorithm's cost with chunk Q = 256 (`chunk_size` attribute wins): per group C.B^T inside
  chunks 2*T*min(T,Q)*N*G, scores.x 2*T*min(T,Q)*P*H, chunk states and outputs 4*T*N*P*H; input
  gradient 2x forward.
- activation bytes: the tensors autograd saves in the layer's ops that need grad (matmul
  activation operands, inputs of nonlinear elementwise ops and norms, softmax outputs, SDPA q, k,
  v, out, fp32 log-softmax of cross-entropy, dropout masks, indices), each tensor counted once.
- weight stash bytes (what a split backward's B leaves for W): the inputs (each tensor once) and
  output gradients of the linear ops the runtime splits (`split_backward.split_operands`).
- output bytes: the layer's outgoing edges; parameter bytes: num_params * dtype_bytes.

Gradient accumulation (with `num_microbatches` = M > 1, as `compile` passes it): every microbatch
after the first adds its gradients into `.grad`, reading both and writing one, memory-bound: the
layer's gradient bytes (its parameters' own dtype, fp32 under autocast) x 3 / memory bandwidth,
(M-1)/M of it in B, and in W the share of the parameters that are linear layers' (what the split
backward defers); the layer's `accumulate_ms` keeps the whole of it, so the table can be re-costed
for another M (`CostTable.for_microbatches`). Measured on an H200 (benchmarks/gpu_one_device.py), where leaving it out put
bf16 steps 7-12% under the measured ones.

Roofline: an op is compute-bound or memory-bound, whichever takes longer:
time = max(flops / (peak_flops * flops_efficiency), bytes / memory_bandwidth); a layer's F, B and W
times are the sums over its ops (ops do not overlap each other). B here is the input gradient;
the table's `backward_ms` is B + W and `backward_weight_ms` is W.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import fx, nn

from octopipe.cluster import ClusterSpec
from octopipe.errors import ArgumentError, OctopipeError
from octopipe.ir.costs import CostTable, LayerCost
from octopipe.ir.graph import LayerGraph
from octopipe.passes.split_backward import split_operands
from octopipe.passes.trace import ValueInfo, _get_attr, _NodeFailure, kept_buffers, propagate_shapes, selective_hazards

__all__ = [
    "FORMULA_NAMES",
    "RATIO_FILE",
    "Poly",
    "analytic_costs",
    "b",
    "layer_formulas",
    "paper_graph",
    "ratio_rows",
    "ratio_table",
    "s",
    "symbolic_shapes",
]

b, s = sympy.symbols("b s", positive=True, integer=True)
"""The batch (microbatch size) and sequence-length symbols of every formula."""

FORMULA_NAMES = (
    "forward_flops",
    "forward_bytes",
    "backward_input_flops",
    "backward_input_bytes",
    "backward_weight_flops",
    "backward_weight_bytes",
    "activation_bytes",
    "weight_stash_bytes",
    "output_bytes",
    "param_bytes",
)
SSD_CHUNK = 256
"""Mamba-2 SSD chunk length when the mixer does not say (the reference kernels' default)."""


# ---------------------------------------------------------------------------- polynomials in b, s


Monomial = tuple[tuple[str, int], ...]


class Poly:
    """A polynomial with rational coefficients in the atoms `b`, `s` and `min:W` (= min(s, W)).

    Fast to build, add, multiply and evaluate for thousands of ops; `to_sympy` gives the formula.
    """

    __slots__ = ("terms",)

    def __init__(self, terms: Mapping[Monomial, Fraction] | None = None) -> None:
        self.terms: dict[Monomial, Fraction] = {k: v for k, v in (terms or {}).items() if v != 0}

    @classmethod
    def const(cls, value: int | Fraction) -> Poly:
        return cls({(): Fraction(value)})

    @classmethod
    def atom(cls, name: str, power: int = 1) -> Poly:
        return cls({((name, power),) if power else (): Fraction(1)})

    def __add__(self, other: Poly | int | Fraction) -> Poly:
        other = _poly(other)
        terms = dict(self.terms)
        for key, value in other.terms.items():
            terms[key] = terms.get(key, Fraction(0)) + value
        return Poly(terms)

    __radd__ = __add__

    def __neg__(self) -> Poly:
        return Poly({k: -v for k, v in self.terms.items()})

    def __sub__(self, other: Poly | int | Fraction) -> Poly:
        return self + (-_poly(other))

    def __mul__(self, other: Poly | int | Fraction) -> Poly:
        if not isinstance(other, Poly):
            factor = Fraction(other)
            return Poly({k: v * factor for k, v in self.terms.items()})
        terms: dict[Monomial, Fraction] = {}
        for k1, v1 in self.terms.items():
            for k2, v2 in other.terms.items():
                key = _merge(k1, k2)
                terms[key] = terms.get(key, Fraction(0)) + v1 * v2
        return Poly(terms)

    __rmul__ = __mul__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (int, Fraction)):
            other = Poly.const(other)
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.terms.items())))

    def __repr__(self) -> str:
        return f"Poly({self.to_sympy()})"

    @property
    def is_const(self) -> bool:
        return all(not key for key in self.terms)

    @property
    def const_value(self) -> Fraction:
        return self.terms.get((), Fraction(0))

    def degree(self, atom: str) -> int:
        best = 0
        for key in self.terms:
            power = sum(p for a, p in key if a == atom or (atom == "s" and a.startswith("min:")))
            best = max(best, power)
        return best

    def evaluate(self, batch: float, seq: float) -> float:
        total = 0.0
        for key, coeff in self.terms.items():
            value = float(coeff)
            for atom, power in key:
                value *= _atom_value(atom, batch, seq) ** power
            total += value
        return total

    def to_sympy(self) -> sympy.Expr:
        parts = []
        for key, coeff in self.terms.items():
            term: sympy.Expr = sympy.Rational(coeff.numerator, coeff.denominator)
            for atom, power in key:
                term = term * _atom_symbol(atom) ** power
            parts.append(term)
        return sympy.Add(*parts) if parts else sympy.Integer(0)


def _poly(value: Poly | int | Fraction) -> Poly:
    return value if isinstance(value, Poly) else Poly.const(value)


def _merge(k1: Monomial, k2: Monomial) -> Monomial:
    if not k1:
        return k2
    if not k2:
        return k1
    powers = dict(k1)
    for atom, power in k2:
        powers[atom] = powers.get(atom, 0) + power
    return tuple(sorted((atom, power) for atom, power in powers.items() if power))


def _atom_value(atom: str, batch: float, seq: float) -> float:
    if atom == "b":
        return batch
    if atom == "s":
        return seq
    return min(seq, float(atom[4:]))


def _atom_symbol(atom: str) -> sympy.Expr:
    if atom == "b":
        return b
    if atom == "s":
        return s
    return sympy.Min(s, sympy.Integer(int(atom[4:])))


def _min_s(extent: Poly, window: int) -> Poly | None:
    """min(extent, window) when extent is a constant or exactly `s`."""
    if extent.is_const:
        return Poly.const(min(extent.const_value, Fraction(window)))
    if extent.terms == {(("s", 1),): Fraction(1)}:
        return Poly.atom(f"min:{window}")
    return None


ZERO = Poly()
ONE = Poly.const(1)


def _prod(values: Iterable[Poly]) -> Poly:
    total = ONE
    for value in values:
        total = total * value
    return total


# ---------------------------------------------------------------------------- symbolic shapes


@dataclass(frozen=True, slots=True)
class SymValue:
    """A node's value with symbolic dims (tensor), or a non-tensor (shape ())."""

    shape: tuple[Poly, ...]
    dtype: str
    is_tensor: bool = True
    items: tuple[SymValue | None, ...] = ()

    @property
    def numel(self) -> Poly:
        return _prod(self.shape)


def _check_seq_dims_type(seq_dims: Any) -> None:
    """seq_dims is None or a mapping (the caches key on its items)."""
    if seq_dims is not None and not isinstance(seq_dims, Mapping):
        raise ArgumentError(f"seq_dims must map input names to a dim or None, like {{'input_ids': 1}}, got "
                            f"{type(seq_dims).__name__}")


def _input_axes(
    graph: LayerGraph, seq_dims: Mapping[str, int | None] | None
) -> dict[str, tuple[int | None, int | None]]:
    """Per input: (batch dim, sequence dim)."""
    _check_seq_dims_type(seq_dims)
    names = [node.name for node in graph.module.graph.nodes if node.op == "placeholder"]
    if seq_dims is not None:
        unknown = sorted(set(seq_dims) - set(names), key=str)
        if unknown:
            raise ArgumentError(f"seq_dims names {unknown}, which are not inputs of the traced model; its inputs are "
                                f"{names}")
    axes = {}
    for node in graph.module.graph.nodes:
        if node.op != "placeholder":
            continue
        info: ValueInfo | None = node.meta.get("octopipe.value")
        rank = len(info.shape) if info is not None and info.is_tensor else 0
        wanted = seq_dims.get(node.name) if seq_dims is not None else None
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 < wanted < rank):
            raise ArgumentError(f"seq_dims[{node.name!r}] must be None or a dim of the input other than the batch "
                                f"dim 0 (1..{rank - 1}), got {wanted!r}")
        batch_dim = 0 if rank >= 1 else None
        # [b, s] token ids and [b, s, d] embeddings have a sequence; [b, features] floats do not
        integer = info is not None and info.is_tensor and not info.dtype.startswith(("float", "bfloat", "complex"))
        seq_dim: int | None = 1 if rank == 3 or (rank == 2 and integer) else None
        if seq_dims is not None and node.name in seq_dims:
            seq_dim = seq_dims[node.name]
        axes[node.name] = (batch_dim, seq_dim)
    return axes


def _example_sizes(graph: LayerGraph, axes: Mapping[str, tuple[int | None, int | None]]) -> tuple[int, int | None]:
    batches, seqs = set(), set()
    for node in graph.module.graph.nodes:
        if node.op != "placeholder":
            continue
        info = node.meta.get("octopipe.value")
        batch_dim, seq_dim = axes[node.name]
        if info is None or not info.is_tensor:
            continue
        if batch_dim is not None:
            batches.add(info.shape[batch_dim])
        if seq_dim is not None:
            seqs.add(info.shape[seq_dim])
    if len(batches) > 1 or len(seqs) > 1:
        raise OctopipeError(
            f"costs: the example inputs disagree on the batch {sorted(batches)} or sequence {sorted(seqs)} size; "
            "pass seq_dims={input_name: dim or None} (compile(..., seq_dims=...), analytic_costs(..., seq_dims=...)) "
            "to say which input dims are the sequence"
        )
    return (batches.pop() if batches else 1), (seqs.pop() if seqs else None)


def _resized_inputs(
    graph: LayerGraph, axes: Mapping[str, tuple[int | None, int | None]], batch: int, seq: int | None
) -> list[Any]:
    """The example inputs cut or tiled to (batch, seq), keeping valid values (token ids)."""
    args = []
    for node in graph.module.graph.nodes:
        if node.op != "placeholder":
            continue
        example = node.meta.get("octopipe.example")
        info: ValueInfo | None = node.meta.get("octopipe.value")
        batch_dim, seq_dim = axes[node.name]
        if example is None:
            assert info is not None
            dtype = getattr(torch, info.dtype)
            example = torch.zeros(info.shape, dtype=dtype, device="meta")
        value = example
        for dim, size in ((batch_dim, batch), (seq_dim, seq)):
            if dim is None or size is None or dim >= value.dim():
                continue
            index = torch.arange(size, device=value.device) % value.shape[dim]
            value = value.index_select(dim, index)
        args.append(value)
    return args


CHEAP_TO_RUN_PARAMETERS = 4_000_000
CHEAP_TO_RUN_INPUT_ELEMENTS = 8192
"""Below both (parameter elements; elements of each input), shape propagation runs the model on
real tensors: 10-20x faster than FakeTensors on small models (0.012 s against 0.19 s a pass on
the tiny LLaMA), in a few MB."""


def _propagate(graph: LayerGraph, args: Sequence[Any]) -> dict[str, ValueInfo | None]:
    gm = graph.module
    tensors = [*gm.parameters(), *gm.buffers()]
    if tensors and all(t.is_meta for t in tensors):
        return propagate_shapes(gm, args, mode="meta")
    cheap = (sum(p.numel() for p in gm.parameters()) <= CHEAP_TO_RUN_PARAMETERS
             and all(a.numel() <= CHEAP_TO_RUN_INPUT_ELEMENTS for a in args if isinstance(a, torch.Tensor)))
    if not cheap:
        try:
            return propagate_shapes(gm, args, mode="fake")
        except _NodeFailure:
            pass  # (a value-dependent shape, as MoE routing's: run it)
    # as the trace's own run does: the buffers it changes (running statistics, counters) and the
    # random numbers it draws (dropout) are given back
    with kept_buffers(gm), torch.random.fork_rng(devices=[]):
        return propagate_shapes(gm, args, mode="real")


def symbolic_shapes(
    graph: LayerGraph, *, seq_dims: Mapping[str, int | None] | None = None
) -> dict[str, SymValue | None]:
    """Every node's value with dims as polynomials in b and s (see the module docstring)."""
    if graph.module is None:
        raise OctopipeError("costs: this LayerGraph has no traced module (it was parsed from text); trace the model")
    cache = graph.module.meta.setdefault("octopipe.symbolic", {})
    _check_seq_dims_type(seq_dims)
    key = tuple(sorted((seq_dims or {}).items()))
    if key in cache:
        return cache[key]
    axes = _input_axes(graph, seq_dims)
    batch_ex, seq_ex = _example_sizes(graph, axes)
    b0, b1 = (batch_ex, batch_ex + 1) if batch_ex >= 2 else (2, 3)
    s0 = seq_ex
    s1 = (seq_ex // 2 if seq_ex >= 4 else seq_ex + 1) if seq_ex is not None else None
    try:
        if b0 == batch_ex:  # the trace already propagated the example: reuse it as the base point
            base = {n.name: n.meta.get("octopipe.value") for n in graph.module.graph.nodes}
        else:
            base = _propagate(graph, _resized_inputs(graph, axes, b0, s0))
        by_b = _propagate(graph, _resized_inputs(graph, axes, b1, s0))
        by_s = _propagate(graph, _resized_inputs(graph, axes, b0, s1)) if s1 is not None else base
        fitted = {name: _fit_value(base[name], by_b.get(name), by_s.get(name), (b0, b1), (s0, s1)) for name in base}
    except (_NodeFailure, RuntimeError, ValueError, IndexError):
        values = {n.name: n.meta.get("octopipe.value") for n in graph.module.graph.nodes}
        fitted = {name: _map_value(v, batch_ex, seq_ex) for name, v in values.items()}
    cache[key] = fitted
    return fitted


def _fit_value(
    v0: ValueInfo | None,
    vb: ValueInfo | None,
    vs: ValueInfo | None,
    bs: tuple[int, int],
    ss: tuple[int | None, int | None],
) -> SymValue | None:
    if v0 is None:
        return None
    if not v0.is_tensor:
        if v0.items and vb is not None and vs is not None and len(vb.items) == len(v0.items) == len(vs.items):
            items = tuple(_fit_value(a, c, d, bs, ss) for a, c, d in zip(v0.items, vb.items, vs.items))
            return SymValue((), v0.dtype, False, items)
        return SymValue((), v0.dtype, False)
    if vb is None or vs is None or len(vb.shape) != len(v0.shape) or len(vs.shape) != len(v0.shape):
        return SymValue(tuple(Poly.const(d) for d in v0.shape), v0.dtype)
    dims = tuple(_fit_dim(d0, d1, d2, bs, ss) for d0, d1, d2 in zip(v0.shape, vb.shape, vs.shape))
    return SymValue(dims, v0.dtype)


def _exponent(ratio: Fraction, base: Fraction) -> int | None:
    if ratio == 1:
        return 0
    for power in range(1, 5):
        if base**power == ratio:
            return power
    return None


def _fit_dim(d0: int, db: int, ds: int, bs: tuple[int, int], ss: tuple[int | None, int | None]) -> Poly:
    b0, b1 = bs
    s0, s1 = ss
    if d0 == db == ds:
        return Poly.const(d0)
    if d0 == 0:
        return Poly.const(0)
    i = _exponent(Fraction(db, d0), Fraction(b1, b0))
    if s0 is None or s1 is None or ds == d0:
        j: int | None = 0
    else:
        j = _exponent(Fraction(ds, d0), Fraction(s1, s0))
    if i is not None and j is not None:
        c = Fraction(d0, b0**i * (s0 or 1) ** j)
        if c * b1**i * (s0 or 1) ** j == db and (s1 is None or c * b0**i * s1**j == ds):
            return Poly.const(c) * Poly.atom("b", i) * Poly.atom("s", j) if (i or j) else Poly.const(c)
    if i is not None and s0 is not None and s1 is not None and s1 != s0:  # b^i * (a*s + k)
        a = Fraction(ds - d0, b0**i * (s1 - s0))
        k = Fraction(d0, b0**i) - a * s0
        if b1**i * (a * s0 + k) == db:
            return (
                Poly.atom("b", i) * (Poly.const(a) * Poly.atom("s") + Poly.const(k))
                if i
                else Poly.const(a) * Poly.atom("s") + Poly.const(k)
            )
    if j is not None and db != d0:  # s^j * (a*b + k)
        a = Fraction(db - d0, (b1 - b0) * (s0 or 1) ** j)
        k = Fraction(d0, (s0 or 1) ** j) - a * b0
        poly = Poly.const(a) * Poly.atom("b") + Poly.const(k)
        return poly * Poly.atom("s", j) if j else poly
    return Poly.const(d0)


def _map_value(value: ValueInfo | None, batch: int, seq: int | None) -> SymValue | None:
    """Single-point fallback: dims equal to the example's batch / sequence / their product."""
    if value is None:
        return None
    if not value.is_tensor:
        return SymValue((), value.dtype, False, tuple(_map_value(v, batch, seq) for v in value.items))
    dims = []
    for dim in value.shape:
        if seq is not None and dim == batch * seq and batch > 1:
            dims.append(Poly.atom("b") * Poly.atom("s"))
        elif dim == batch and batch > 1:
            dims.append(Poly.atom("b"))
        elif seq is not None and dim == seq and seq > 1:
            dims.append(Poly.atom("s"))
        else:
            dims.append(Poly.const(dim))
    return SymValue(tuple(dims), value.dtype)


def _concrete(values: Mapping[str, ValueInfo | None]) -> dict[str, SymValue | None]:
    def convert(v: ValueInfo | None) -> SymValue | None:
        if v is None:
            return None
        if not v.is_tensor:
            return SymValue((), v.dtype, False, tuple(convert(x) for x in v.items))
        return SymValue(tuple(Poly.const(d) for d in v.shape), v.dtype)

    return {name: convert(v) for name, v in values.items()}


# ---------------------------------------------------------------------------- per-op work


@dataclass
class OpWork:
    """One op's work: forward, input-gradient (B) and weight-gradient (W) FLOPs and bytes."""

    node: str
    forward_flops: Poly = field(default_factory=Poly)
    forward_bytes: Poly = field(default_factory=Poly)
    backward_input_flops: Poly = field(default_factory=Poly)
    backward_input_bytes: Poly = field(default_factory=Poly)
    backward_weight_flops: Poly = field(default_factory=Poly)
    backward_weight_bytes: Poly = field(default_factory=Poly)

    def scaled(self, factor: Fraction, fixed_bytes: Poly) -> OpWork:
        """Only `factor` of the work is done, but `fixed_bytes` (weights) are still all moved."""

        def part(name: str) -> Poly:
            value = getattr(self, name)
            if name.endswith("_bytes") and value != ZERO:
                return (value - fixed_bytes) * factor + fixed_bytes
            return value * factor

        return OpWork(self.node, *(part(name) for name in _WORK_FIELDS))


_WORK_FIELDS = (
    "forward_flops",
    "forward_bytes",
    "backward_input_flops",
    "backward_input_bytes",
    "backward_weight_flops",
    "backward_weight_bytes",
)


@dataclass
class LayerWork:
    ops: list[OpWork]
    saved: dict[str, Poly]
    output_bytes: Poly
    param_bytes: Poly
    edge_bytes: dict[str, Poly] = field(default_factory=dict)
    """Bytes of each tensor edge this layer produces (their sum is `output_bytes`)."""
    kept_bytes: Poly = field(default_factory=Poly)
    """Under selective recomputation: the outputs of the layer's heavy ops (`_SELECTIVE_KEPT`)
    that need grad, what PyTorch's selective checkpoint stores for them."""
    recomputed: frozenset[str] = frozenset()
    """Under selective recomputation: the ops B runs again (every op but the heavy ones)."""
    stash: dict[str, Poly] = field(default_factory=dict)
    """What a split backward's B leaves for W: the inputs (each tensor once) and output gradients
    of the linear ops `split_backward` splits."""
    unsaved_input: Poly = field(default_factory=Poly)
    """Its inputs from earlier layers that need grad and that none of its ops saves (a loss
    layer's logits): held from F to B anyway where the layer starts a stage."""

    def total(self, name: str) -> Poly:
        if name == "activation_bytes":
            return sum(self.saved.values(), Poly())
        if name == "weight_stash_bytes":
            return sum(self.stash.values(), Poly())
        if name == "output_bytes":
            return self.output_bytes
        if name == "param_bytes":
            return self.param_bytes
        return sum((getattr(op, name) for op in self.ops), Poly())


def _ops(names: str) -> frozenset[str]:
    return frozenset(names.split())


_VIEWS = _ops(
    "view reshape _unsafe_view unsqueeze squeeze transpose permute t flatten unflatten expand "
    "expand_as narrow slice select size dim getattr alias detach split split_with_sizes chunk unbind "
    "as_strided sym_size _assert_tensor_metadata _assert_scalar view_as movedim swapaxes getitem "
    "lift_fresh_copy _assert_async contiguous_view numel stride _check_is_size sym_numel type "
    "requires_grad_ dropout_eval"
)
_COPIES = _ops(
    "clone contiguous copy copy_ repeat repeat_interleave cat concat concatenate stack pad "
    "constant_pad_nd roll flip index index_select gather _to_copy to float half bfloat16 type_as tril "
    "triu"
)
_CREATION = _ops(
    "arange zeros ones full empty zeros_like ones_like full_like empty_like new_ones new_zeros "
    "new_full new_empty scalar_tensor tensor rand randn rand_like randn_like randint empty_strided "
    "linspace"
)
_TRANSCENDENTAL = _ops(
    "exp log tanh sigmoid silu gelu softplus erf rsqrt sqrt pow sin cos log1p expm1 exp2 mish elu "
    "selu logsigmoid hardswish reciprocal"
)
_SAVES_INPUT = _TRANSCENDENTAL | {"relu", "square", "leaky_relu", "hardtanh", "abs", "clamp", "clamp_min", "relu6"}
_NORMS = _ops(
    "layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm batch_norm "
    "_native_batch_norm_legit_no_training normalize instance_norm"
)
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_CROSS_ENTROPY = {"cross_entropy", "cross_entropy_loss"}
_NLL = {"nll_loss", "nll_loss_forward", "nll_loss_nd", "nll_loss2d_forward"}
_SDPA = _ops(
    "scaled_dot_product_attention _scaled_dot_product_flash_attention "
    "_scaled_dot_product_efficient_attention _scaled_dot_product_flash_attention_for_cpu "
    "_scaled_dot_product_cudnn_attention"
)
_MATMULS = _ops(
    "linear matmul mm bmm addmm baddbmm einsum mv dot addmv conv1d conv2d conv3d convolution "
    "_convolution conv_transpose1d conv_transpose2d _grouped_mm grouped_mm"
)
_EMBEDDING = {"embedding", "embedding_bag"}
_SELECTIVE_KEPT = _MATMULS | _SDPA | {"module"}
"""Ops whose outputs selective recomputation keeps (runtime/stage.py SELECTIVE_SAVED_OPS, at the
level of the traced graph's calls; an opaque module call is priced as a matmul and kept)."""
_DROPOUT = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout"}
_MULTIPLY = {"mul", "div", "truediv", "floordiv", "matmul_elementwise", "pow_tensor", "maximum", "minimum", "atan2"}
_MASKS = {"where", "masked_fill", "masked_fill_", "scatter", "scatter_add", "index_put", "masked_scatter"}
_NO_GRAD_OUT = _ops(
    "eq ne lt le gt ge and_ or_ __and__ __or__ logical_and logical_or logical_not argmax argmin isnan "
    "isinf bitwise_and bitwise_or not_"
)


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op == "call_module":
        return "module:" + type(gm.get_submodule(str(target))).__name__
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    name = getattr(target, "__name__", str(target))
    return name


_MODULE_OPS = {
    nn.Linear: "linear",
    nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm",
    nn.RMSNorm: "rms_norm",
    nn.GroupNorm: "group_norm",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.CrossEntropyLoss: "cross_entropy",
    nn.Dropout: "dropout",
    nn.Softmax: "softmax",
    nn.LogSoftmax: "log_softmax",
    nn.SiLU: "silu",
    nn.GELU: "gelu",
    nn.ReLU: "relu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Identity: "alias",
    nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm",
    nn.Mish: "mish",
    nn.SELU: "selu",
    nn.ELU: "elu",
}


@dataclass
class _Context:
    gm: fx.GraphModule
    shapes: Mapping[str, SymValue | None]
    dtype_bytes: int
    requires_grad: dict[str, bool]
    param_like: dict[str, bool]
    state_like: dict[str, bool]
    modules: Mapping[str, nn.Module]


def _elem_bytes(dtype: str, dtype_bytes: int) -> int:
    if dtype.startswith(("float", "bfloat", "half")):
        return dtype_bytes
    if dtype.startswith("complex"):
        return 2 * dtype_bytes
    if dtype in ("bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2"):
        return 1
    if dtype.startswith(("int", "uint")):
        try:
            return getattr(torch, dtype).itemsize
        except AttributeError:
            return 8
    return dtype_bytes


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued input nodes in argument order (flattening lists, e.g. einsum's operands)."""
    found: list[fx.Node] = []

    def visit(arg: Any) -> None:
        if isinstance(arg, fx.Node):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                visit(item)

    for arg in node.args:
        visit(arg)
    for arg in node.kwargs.values():
        visit(arg)
    return found


class _Pricer:
    """Prices one node at a time in a fixed set of shapes."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self._numel: dict[str, Poly] = {}
        self._bytes: dict[str, Poly] = {}

    # -- helpers ----------------------------------------------------------------------------
    def value(self, node: fx.Node) -> SymValue | None:
        v = self.ctx.shapes.get(node.name)
        return v if v is not None and v.is_tensor else None

    def nbytes(self, node: fx.Node) -> Poly:
        cached = self._bytes.get(node.name)
        if cached is None:
            v = self.value(node)
            cached = self.numel(node) * _elem_bytes(v.dtype, self.ctx.dtype_bytes) if v is not None else ZERO
            self._bytes[node.name] = cached
        return cached

    def numel(self, node: fx.Node) -> Poly:
        cached = self._numel.get(node.name)
        if cached is None:
            v = self.value(node)
            cached = self._numel[node.name] = v.numel if v is not None else ZERO
        return cached

    def grad(self, node: fx.Node) -> bool:
        return self.ctx.requires_grad.get(node.name, False)

    def is_param(self, node: fx.Node) -> bool:
        return self.ctx.param_like.get(node.name, False)

    # -- the rules --------------------------------------------------------------------------
    def price(self, node: fx.Node, name: str) -> tuple[OpWork, dict[str, Poly]]:
        """The op's work and the tensors autograd keeps for it; parameters, buffers and views of
        them are module memory, not activations, so they are left out of the kept tensors."""
        work, saved = self._price(node, name)
        return work, {key: value for key, value in saved.items() if not self.ctx.state_like.get(key, False)}

    def _price(self, node: fx.Node, name: str) -> tuple[OpWork, dict[str, Poly]]:
        work = OpWork(node.name)
        saved: dict[str, Poly] = {}
        if node.op == "call_module":
            module = self.ctx.gm.get_submodule(str(node.target))
            name = next((op for cls, op in _MODULE_OPS.items() if isinstance(module, cls)), "module")
        inputs = [n for n in _tensor_inputs(node) if self.value(n) is not None]
        out = self.nbytes(node)
        out_numel = self.numel(node)
        needs_grad = self.grad(node)
        activations = [n for n in inputs if not self.is_param(n)]
        act_grad = [n for n in activations if self.grad(n)]
        params = [n for n in inputs if self.is_param(n) and self.grad(n)]
        in_bytes = sum((self.nbytes(n) for n in inputs), Poly())

        if name in _VIEWS or name == "alias" or node.op in ("placeholder", "get_attr", "output"):
            return work, saved
        if name in _CREATION:
            work.forward_bytes = out
            return work, saved
        if name in _COPIES:
            if name in ("to", "_to_copy", "type_as", "float", "half", "bfloat16") and inputs:
                src = self.value(inputs[0])
                dst = self.value(node)
                if src is not None and dst is not None and src.dtype == dst.dtype:
                    return work, saved
            work.forward_bytes = in_bytes + out
            if act_grad:
                work.backward_input_bytes = in_bytes + out
            return work, saved
        if name in _MATMULS or name == "module":
            return self._matmul(node, name, inputs, activations, act_grad, params, out, out_numel)
        if name in _SDPA:
            return self._sdpa(node, inputs, out)
        if name in _EMBEDDING:
            indices = [n for n in inputs if not self.is_param(n)]
            weight: list[nn.Parameter] | list[fx.Node] = self._module_param(node) or [n for n in inputs if self.is_param(n)]
            work.forward_bytes = 2 * out + sum((self.nbytes(n) for n in indices), Poly())
            if weight:
                table = self._param_bytes(node, inputs)
                work.backward_weight_flops = out_numel
                work.backward_weight_bytes = 2 * out + table
                for n in indices:
                    saved[n.name] = self.nbytes(n)
            return work, saved
        if name in _CROSS_ENTROPY or name in _NLL:
            logits = inputs[0] if inputs else None
            if logits is None:
                return work, saved
            logit_numel = self.numel(logits)
            if name in _NLL:
                work.forward_flops = out_numel
                work.forward_bytes = in_bytes + out
                if act_grad:
                    work.backward_input_flops = logit_numel
                    work.backward_input_bytes = logit_numel * 4
                return work, saved
            fp32 = logit_numel * 4
            work.forward_flops = 5 * logit_numel
            work.forward_bytes = self.nbytes(logits) + 2 * fp32 + sum((self.nbytes(n) for n in inputs[1:]), Poly())
            if act_grad:
                work.backward_input_flops = 2 * logit_numel
                work.backward_input_bytes = 2 * fp32 + self.nbytes(logits)
                saved[node.name + ":log_softmax"] = fp32
            return work, saved
        # elementwise-like ops
        factor = 1
        if name in _TRANSCENDENTAL:
            factor = 4
        elif name in _NORMS or name in _SOFTMAX:
            factor = 5
        elif name in _DROPOUT:
            factor = 2
        reads = in_bytes
        if name in (
            "sum",
            "mean",
            "amax",
            "amin",
            "max",
            "min",
            "cumsum",
            "cumprod",
            "topk",
            "sort",
            "var",
            "std",
            "logsumexp",
            "norm",
            "all",
            "any",
            "argmax",
            "argmin",
            "prod",
        ):
            basis = sum((self.numel(n) for n in inputs[:1]), Poly())
        else:
            basis = out_numel
        module_param_bytes = self._param_bytes(node, []) if node.op == "call_module" else ZERO
        work.forward_flops = factor * basis
        work.forward_bytes = reads + out + module_param_bytes
        if not needs_grad or name in _NO_GRAD_OUT:
            return work, saved
        if act_grad:
            work.backward_input_flops = factor * basis
            work.backward_input_bytes = out + 2 * sum((self.nbytes(n) for n in act_grad), Poly())
        has_param = bool(params) or (node.op == "call_module" and bool(self._module_param(node)))
        if has_param:
            work.backward_weight_flops = 2 * basis
            work.backward_weight_bytes = 2 * out + module_param_bytes + sum((self.nbytes(n) for n in params), Poly())
        # what autograd keeps
        if name in _SAVES_INPUT or name in _NORMS:
            for n in activations[:1]:
                saved[n.name] = self.nbytes(n)
        elif name in _SOFTMAX:
            saved[node.name] = out
        elif name in _DROPOUT:
            saved[node.name + ":mask"] = out_numel
        elif name in _MULTIPLY and len(inputs) >= 2:
            for n in activations:  # d(x*y)/dx needs y: a factor is kept when the other one needs grad
                if any(self.grad(o) for o in inputs if o is not n):
                    saved[n.name] = self.nbytes(n)
        elif name in _MASKS or name in ("gather", "index", "topk", "sort"):
            for n in inputs:
                v = self.value(n)
                if v is not None and not v.dtype.startswith(("float", "bfloat", "half")):
                    saved[n.name] = self.nbytes(n)
        return work, saved

    def _module_param(self, node: fx.Node) -> list[nn.Parameter]:
        if node.op != "call_module":
            return []
        return [p for p in self.ctx.gm.get_submodule(str(node.target)).parameters() if p.requires_grad]

    def _param_bytes(self, node: fx.Node, inputs: list[fx.Node]) -> Poly:
        if node.op == "call_module":
            count = sum(p.numel() for p in self.ctx.gm.get_submodule(str(node.target)).parameters())
            return Poly.const(count * self.ctx.dtype_bytes)
        return sum((self.nbytes(n) for n in inputs if self.is_param(n)), Poly())

    def _matmul(
        self,
        node: fx.Node,
        name: str,
        inputs: list[fx.Node],
        activations: list[fx.Node],
        act_grad: list[fx.Node],
        params: list[fx.Node],
        out: Poly,
        out_numel: Poly,
    ) -> tuple[OpWork, dict[str, Poly]]:
        work = OpWork(node.name)
        saved: dict[str, Poly] = {}
        module = self.ctx.gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        first = self.value(inputs[0]) if inputs else None
        flops = ZERO
        bias = ZERO
        weight_grad = bool(params)
        if module is not None:
            weight_grad = any(p.requires_grad for p in module.parameters())
            if isinstance(module, nn.Linear):
                flops = 2 * out_numel * module.in_features
                bias = out_numel if module.bias is not None else ZERO
            elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                flops = 2 * out_numel * math.prod(module.weight.shape[1:])
                bias = out_numel if module.bias is not None else ZERO
            elif first is not None and first.shape:  # unknown leaf: 2 * params per token
                tokens = first.numel * Poly.const(Fraction(1)) if not first.shape else _prod(first.shape[:-1])
                flops = 2 * tokens * sum(p.numel() for p in module.parameters())
        elif name == "einsum":
            flops = self._einsum_flops(node)
        elif name in (
            "conv1d",
            "conv2d",
            "conv3d",
            "convolution",
            "_convolution",
            "conv_transpose1d",
            "conv_transpose2d",
        ):
            weight = self.value(inputs[1]) if len(inputs) > 1 else None
            if weight is not None:
                flops = 2 * out_numel * _prod(weight.shape[1:])
            bias = out_numel if len(inputs) > 2 else ZERO
        elif name in ("addmm", "baddbmm", "addmv"):
            a = self.value(inputs[1]) if len(inputs) > 1 else None
            if a is not None and a.shape:
                flops = 2 * out_numel * a.shape[-1]
            bias = out_numel
        elif first is not None and first.shape:
            flops = 2 * out_numel * first.shape[-1]
            if name == "linear" and len(inputs) > 2:
                bias = out_numel
        module_bytes = self._param_bytes(node, inputs) if module is not None else ZERO
        in_bytes = sum((self.nbytes(n) for n in inputs), Poly())
        work.forward_flops = flops + bias
        work.forward_bytes = in_bytes + out + module_bytes
        act_needing = act_grad if module is None else [n for n in activations[:1] if self.grad(n)]
        if act_needing:
            work.backward_input_flops = flops * len(act_needing)
            work.backward_input_bytes = (
                out
                + sum((self.nbytes(n) for n in act_needing), Poly())
                + module_bytes
                + sum((self.nbytes(n) for n in inputs if self.is_param(n)), Poly())
            )
        if weight_grad:
            operands = len(params) if module is None else 1
            work.backward_weight_flops = flops * operands + bias
            work.backward_weight_bytes = (
                out
                + sum((self.nbytes(n) for n in activations), Poly())
                + (module_bytes if module is not None else sum((self.nbytes(n) for n in params), Poly()))
            )
        # autograd keeps an activation operand when the other operand needs its gradient
        if self.grad(node):
            grads_other = weight_grad or len(act_grad) > 1
            for n in activations:
                if grads_other or (module is None and any(self.grad(o) for o in inputs if o is not n)):
                    saved[n.name] = self.nbytes(n)
        return work, saved

    def _einsum_flops(self, node: fx.Node) -> Poly:
        equation = node.args[0] if node.args else node.kwargs.get("equation")
        operands = _tensor_inputs(node)
        if not isinstance(equation, str):
            return ZERO
        lhs = equation.replace(" ", "").split("->")[0]
        sizes: dict[str, Poly] = {}
        for subscripts, operand in zip(lhs.split(","), operands):
            value = self.value(operand)
            if value is None:
                continue
            letters = list(subscripts.replace("...", "."))
            if "." in letters:
                at = letters.index(".")
                extra = len(value.shape) - (len(letters) - 1)
                letters = letters[:at] + [f".{k}" for k in range(extra)] + letters[at + 1 :]
                # ellipsis dims are aligned from the right across operands
                letters = [f".{extra - 1 - int(x[1:])}" if x.startswith(".") else x for x in letters]
            for letter, dim in zip(letters, value.shape):
                if letter not in sizes or sizes[letter] == ONE:
                    sizes[letter] = dim
        return 2 * _prod(sizes.values())

    def _sdpa(self, node: fx.Node, inputs: list[fx.Node], out: Poly) -> tuple[OpWork, dict[str, Poly]]:
        work = OpWork(node.name)
        saved: dict[str, Poly] = {}
        q, k, v = (self.value(n) for n in inputs[:3])
        if q is None or k is None or v is None or len(q.shape) < 2:
            return work, saved
        batch_heads = _prod(q.shape[:-2])
        sq, d = q.shape[-2], q.shape[-1]
        sk, dv = k.shape[-2], v.shape[-1]
        causal = bool(node.kwargs.get("is_causal", False)) or (len(node.args) > 5 and bool(node.args[5]))
        module = _owning_module(
            node, self.ctx.modules, lambda m: hasattr(m, "sliding_window") or hasattr(m, "is_causal")
        )
        window = getattr(module, "sliding_window", None) if module is not None else None
        has_mask = len(inputs) > 3
        if module is not None and getattr(module, "is_causal", False) is True and has_mask:
            causal = True
        pairs = sq * sk  # (query, key) pairs computed
        if isinstance(window, int) and window > 0 and sq == sk:
            band = _min_s(sk, window)
            pairs = sq * band - band * band * Fraction(1, 2) if band is not None else sq * sk * Fraction(1, 2)
        elif causal:
            pairs = sq * sk * Fraction(1, 2)
        flops = 2 * batch_heads * pairs * (d + dv)
        work.forward_flops = flops + 5 * batch_heads * pairs
        reads = sum((self.nbytes(n) for n in inputs), Poly())
        work.forward_bytes = reads + out
        if any(self.grad(n) for n in inputs[:3]):
            work.backward_input_flops = flops * Fraction(5, 2) + 5 * batch_heads * pairs
            work.backward_input_bytes = 2 * (reads + out)
            for n in inputs[:3]:
                saved[n.name] = self.nbytes(n)
            saved[node.name] = out
        return work, saved


def _owning_module(node: fx.Node, modules: Mapping[str, nn.Module], accept: Any) -> nn.Module | None:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [entry[0] if isinstance(entry, tuple) else str(entry) for entry in stack.values()]
    if node.op == "call_module":
        paths.append(str(node.target))
    for path in reversed(paths):
        module = modules.get(path)
        if module is not None and accept(module):
            return module
    return None


def _innermost_path(node: fx.Node, modules: Mapping[str, nn.Module]) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        if path in modules:
            return path
    return ""


def _moe_spec(module: nn.Module) -> tuple[int, int] | None:
    experts = getattr(module, "num_experts", None) or getattr(module, "num_local_experts", None)
    top_k = getattr(module, "top_k", None) or getattr(module, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k <= experts and experts > 1:
        return experts, top_k
    return None


def _ssd_spec(module: nn.Module) -> dict[str, int] | None:
    state = getattr(module, "d_state", None) or getattr(module, "ssm_state_size", None)
    heads = getattr(module, "num_heads", None)
    head_dim = getattr(module, "head_dim", None)
    if not (isinstance(state, int) and isinstance(heads, int) and isinstance(head_dim, int)):
        return None
    groups = getattr(module, "n_groups", None) or getattr(module, "ngroups", None) or 1
    chunk = getattr(module, "chunk_size", None) or SSD_CHUNK
    return {
        "state": int(state),
        "heads": int(heads),
        "head_dim": int(head_dim),
        "groups": int(groups),
        "chunk": int(chunk),
    }


def _flags(
    gm: fx.GraphModule, shapes: Mapping[str, SymValue | None]
) -> tuple[dict[str, bool], dict[str, bool], dict[str, bool]]:
    """requires_grad (depends on a trainable parameter), param_like (a parameter or a view of one)
    and state_like (a parameter, buffer or constant, or a view of one)."""
    requires: dict[str, bool] = {}
    param_like: dict[str, bool] = {}
    state_like: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            requires[node.name] = False
            continue
        if node.op == "get_attr":
            value = _get_attr(gm, str(node.target))
            is_param = isinstance(value, nn.Parameter)
            param_like[node.name] = is_param
            state_like[node.name] = True
            requires[node.name] = bool(is_param and value.requires_grad)
            continue
        inputs = node.all_input_nodes
        grad = any(requires.get(n.name, False) for n in inputs)
        if node.op == "call_module":
            grad = grad or any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())
        value = shapes.get(node.name)
        if value is not None and value.is_tensor and not value.dtype.startswith(("float", "bfloat", "half", "complex")):
            grad = False
        requires[node.name] = grad
        name = _op_name(node, gm)
        passthrough = name in _VIEWS or name in ("to", "_to_copy", "type_as", "float", "half", "bfloat16", "contiguous")
        tensors = [n for n in inputs if (v := shapes.get(n.name)) is not None and v.is_tensor]  # sizes do not count
        param_like[node.name] = passthrough and bool(tensors) and all(param_like.get(n.name, False) for n in tensors)
        state_like[node.name] = passthrough and bool(tensors) and all(state_like.get(n.name, False) for n in tensors)
    return requires, param_like, state_like


def _layer_works(
    graph: LayerGraph,
    shapes: Mapping[str, SymValue | None],
    dtype_bytes: int,
    structure: Mapping[str, SymValue | None] | None = None,
) -> list[LayerWork]:
    """Price every layer in `shapes`; decisions that need to know which dims are b and s (quadratic
    SSD ops, per-expert tensors) read `structure` (the symbolic shapes; default `shapes`)."""
    structure = shapes if structure is None else structure
    gm: fx.GraphModule = graph.module
    modules: Mapping[str, nn.Module] = gm.meta.get("octopipe.modules", {})
    requires, param_like, state_like = _flags(gm, shapes)
    ctx = _Context(gm, shapes, dtype_bytes, requires, param_like, state_like, modules)
    pricer = _Pricer(ctx)
    nodes = {node.name: node for node in gm.graph.nodes}
    path_of = {id(module): path for path, module in modules.items()}
    works: list[LayerWork] = []
    for layer in graph.layers:
        ops: list[OpWork] = []
        saved: dict[str, Poly] = {}
        ssd_calls: dict[str, tuple[nn.Module, list[fx.Node]]] = {}
        kept = Poly()
        recomputed: set[str] = set()
        stash: dict[str, Poly] = {}
        for name in layer.nodes:
            node = nodes[name]
            op_name = _op_name(node, gm)
            work, keep = pricer.price(node, op_name)
            heavy = _selective_kept(node, op_name, gm)
            path = _innermost_path(node, modules)
            module = modules.get(path)
            ssd_module = _owning_module(node, modules, lambda m: _ssd_spec(m) is not None)
            if ssd_module is not None:
                key = path_of.get(id(ssd_module), "")
                ssd_calls.setdefault(key, (ssd_module, []))[1].append(node)
                if path == key and _is_quadratic(node, structure):
                    continue  # replaced by the chunked SSD cost below
            moe = _moe_spec(module) if module is not None else None
            factor = Fraction(1)
            if moe is not None and _touches_experts(node, structure, moe[0]):
                factor = Fraction(moe[1], moe[0])
                weights = sum((pricer.nbytes(n) for n in node.all_input_nodes if pricer.is_param(n)), Poly())
                work = work.scaled(factor, weights)
                keep = {k: v * factor for k, v in keep.items()}
            if heavy and pricer.grad(node):
                kept = kept + pricer.nbytes(node) * factor
            operands = split_operands(gm, node)
            if operands is not None and pricer.grad(node) and any(_trains(gm, ref) for ref in operands[1:]):
                source = operands[0]  # W reads the linear's input and its output's gradient
                if isinstance(source, fx.Node) and not pricer.is_param(source):
                    stash[source.name] = pricer.nbytes(source) * factor
                stash[node.name + ":grad"] = pricer.nbytes(node) * factor
            if not heavy:
                recomputed.add(node.name)
            ops.append(work)
            saved.update(keep)
        for key, (module, members) in ssd_calls.items():
            work, keep = _ssd_work(key, module, members, shapes, dtype_bytes)
            ops.append(work)
            saved.update(keep)
            kept = sum(keep.values(), kept)  # the chunked scan: priced as kept whole, nothing run again
        output = Poly()
        edge_bytes = {}
        for edge in graph.edges:
            if edge.producer == layer.index:
                value = shapes.get(edge.name)
                if value is not None and value.is_tensor:
                    edge_bytes[edge.name] = value.numel * _elem_bytes(value.dtype, dtype_bytes)
                    output = output + edge_bytes[edge.name]
        unsaved = Poly()
        for edge in graph.edges:
            node = nodes.get(edge.name)
            if (edge.producer >= 0 and layer.index in edge.consumers and node is not None and edge.name not in saved
                    and pricer.grad(node)):
                unsaved = unsaved + pricer.nbytes(node)
        works.append(LayerWork(ops, saved, output, Poly.const(layer.num_params * dtype_bytes), edge_bytes,
                               kept, frozenset(recomputed), stash, unsaved))
    return works


def _trains(gm: fx.GraphModule, ref: fx.Node | str | None) -> bool:
    """Whether the parameter `ref` (a get_attr node or a qualified name) gets a gradient."""
    if ref is None:
        return False
    return bool(getattr(_get_attr(gm, ref if isinstance(ref, str) else str(ref.target)), "requires_grad", False))


def _selective_kept(node: fx.Node, op_name: str, gm: fx.GraphModule) -> bool:
    """Whether selective recomputation keeps the op's output (a leaf module call by the op it
    stands for, as the pricing reads it; an unknown module is priced as a matmul and kept)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        op_name = next((op for cls, op in _MODULE_OPS.items() if isinstance(module, cls)), "module")
    return op_name in _SELECTIVE_KEPT


def _is_quadratic(node: fx.Node, shapes: Mapping[str, SymValue | None]) -> bool:
    values = [shapes.get(node.name)] + [shapes.get(n.name) for n in node.all_input_nodes]
    return any(v is not None and v.is_tensor and v.numel.degree("s") >= 2 for v in values)


def _touches_experts(node: fx.Node, shapes: Mapping[str, SymValue | None], experts: int) -> bool:
    values = [shapes.get(node.name)] + [shapes.get(n.name) for n in node.all_input_nodes]
    for value in values:
        if value is None or not value.is_tensor or len(value.shape) < 2:
            continue
        if any(dim == Poly.const(experts) for dim in value.shape[:-1]):
            return True
    return False


def _ssd_work(
    key: str, module: nn.Module, members: list[fx.Node], shapes: Mapping[str, SymValue | None], dtype_bytes: int
) -> tuple[OpWork, dict[str, Poly]]:
    spec = _ssd_spec(module)
    assert spec is not None
    batch, seq = Poly.atom("b"), Poly.atom("s")
    for node in members:  # the mixer's input hidden state [b, T, d] gives b and T
        for arg in node.all_input_nodes:
            value = shapes.get(arg.name)
            if value is not None and value.is_tensor and len(value.shape) == 3:
                batch, seq = value.shape[0], value.shape[1]
                break
        else:
            continue
        break
    heads, head_dim, state, groups, chunk = (
        spec["heads"],
        spec["head_dim"],
        spec["state"],
        spec["groups"],
        spec["chunk"],
    )
    window = _min_s(seq, chunk) or seq
    tokens = batch * seq
    forward = tokens * window * (2 * state * groups + 2 * head_dim * heads + 3 * heads) + tokens * (
        4 * state * head_dim * heads
    )
    inputs = tokens * (heads * head_dim + 2 * groups * state + heads)
    states_bytes = batch * seq * Fraction(1, chunk) * heads * head_dim * state * 4  # fp32 chunk states
    io = (inputs + tokens * heads * head_dim) * dtype_bytes
    work = OpWork(
        key + ":ssd",
        forward_flops=forward,
        forward_bytes=io + 2 * states_bytes,
        backward_input_flops=2 * forward,
        backward_input_bytes=2 * io + 2 * states_bytes,
    )
    return work, {key + ":ssd_inputs": inputs * dtype_bytes}


# ---------------------------------------------------------------------------- public functions


def layer_formulas(
    graph: LayerGraph,
    *,
    dtype_bytes: int = 2,
    seq_dims: Mapping[str, int | None] | None = None,
    at: tuple[int, int] | None = None,
) -> list[dict[str, sympy.Expr]]:
    """Per layer, the formulas FORMULA_NAMES as sympy expressions in `b` and `s`.

    With `at=(batch, seq)`, shapes come from one fresh shape propagation at that size instead of
    the fit, and the values are numbers: the check that the fitted formulas are right.
    """
    if at is None:
        works = _symbolic_works(graph, dtype_bytes, seq_dims)
    else:
        axes = _input_axes(graph, seq_dims)
        shapes = _concrete(_propagate(graph, _resized_inputs(graph, axes, at[0], at[1])))
        works = _layer_works(graph, shapes, dtype_bytes, symbolic_shapes(graph, seq_dims=seq_dims))
    return [{name: work.total(name).to_sympy() for name in FORMULA_NAMES} for work in works]


def _symbolic_works(graph: LayerGraph, dtype_bytes: int, seq_dims: Mapping[str, int | None] | None) -> list[LayerWork]:
    """The symbolic per-op work of every layer, cached on the traced module (it depends only on
    the graph, the dtype and the sequence dims, not on the cluster or the sizes asked for)."""
    if graph.module is None:
        raise OctopipeError("costs: this LayerGraph has no traced module (it was parsed from text); trace the model")
    _check_seq_dims_type(seq_dims)  # before it is a cache key
    cache = graph.module.meta.setdefault("octopipe.works", {})
    key = (dtype_bytes, tuple(sorted((seq_dims or {}).items())))
    if key not in cache:
        cache[key] = _layer_works(graph, symbolic_shapes(graph, seq_dims=seq_dims), dtype_bytes)
    return cache[key]


def analytic_costs(
    graph: LayerGraph,
    cluster: ClusterSpec,
    *,
    batch_size: int,
    seq_len: int | None = None,
    dtype_bytes: int = 2,
    seq_dims: Mapping[str, int | None] | None = None,
    num_microbatches: int = 1,
) -> CostTable:
    """Analytic per-layer costs of one microbatch of `batch_size` sequences of `seq_len` tokens
    (default: the traced example's length) on one device of `cluster`, in a step of
    `num_microbatches` that accumulate gradients (see the module docstring)."""
    if batch_size < 1:
        raise OctopipeError(f"analytic_costs: batch_size must be >= 1, got {batch_size}")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise OctopipeError(f"analytic_costs: num_microbatches must be a positive integer, got {num_microbatches!r}")
    if graph.module is None:
        raise OctopipeError(
            "analytic_costs: this LayerGraph has no traced module (it was parsed from text); trace the model"
        )
    works = _symbolic_works(graph, dtype_bytes, seq_dims)
    if seq_len is None:
        _, seq_len = _example_sizes(graph, _input_axes(graph, seq_dims))
    seq = float(seq_len or 1)
    flops_rate = cluster.peak_flops * cluster.flops_efficiency
    bandwidth = cluster.memory_bandwidth

    def op_ms(flops: Poly, nbytes: Poly) -> float:
        return max(flops.evaluate(batch_size, seq) / flops_rate, nbytes.evaluate(batch_size, seq) / bandwidth) * 1e3

    accumulating = (num_microbatches - 1) / num_microbatches
    params = dict(graph.module.named_parameters(remove_duplicate=False))
    modules: Mapping[str, nn.Module] = graph.module.meta.get("octopipe.modules", {})
    layers = []
    for layer, work in zip(graph.layers, works):
        forwards = [op_ms(op.forward_flops, op.forward_bytes) for op in work.ops]
        forward = sum(forwards)
        backward_input = sum(op_ms(op.backward_input_flops, op.backward_input_bytes) for op in work.ops)
        backward_weight = sum(op_ms(op.backward_weight_flops, op.backward_weight_bytes) for op in work.ops)
        grad_bytes, linear_bytes = _gradient_bytes(layer, params, modules)
        accumulate_ms = 3 * grad_bytes / bandwidth * 1e3
        # (the share first: a share of 1 then gives accumulate_ms exactly, never a rounding above it)
        accumulate_weight_ms = accumulate_ms * (linear_bytes / grad_bytes) if grad_bytes else 0.0
        backward_input += accumulating * (accumulate_ms - accumulate_weight_ms)
        backward_weight += accumulating * accumulate_weight_ms
        formulas = tuple((name, _formula_text(work.total(name))) for name in FORMULA_NAMES)
        layers.append(
            LayerCost(
                name=layer.name,
                kind=layer.kind,
                forward_ms=forward,
                backward_ms=backward_input + backward_weight,
                backward_weight_ms=backward_weight,
                accumulate_ms=accumulate_ms,
                accumulate_weight_ms=accumulate_weight_ms,
                activation_bytes=_to_bytes(work.total("activation_bytes").evaluate(batch_size, seq)),
                selective_activation_bytes=_to_bytes(work.kept_bytes.evaluate(batch_size, seq)),
                weight_stash_bytes=_to_bytes(work.total("weight_stash_bytes").evaluate(batch_size, seq)),
                unsaved_input_bytes=_to_bytes(work.unsaved_input.evaluate(batch_size, seq)),
                selective_recompute_ms=sum(ms for op, ms in zip(work.ops, forwards) if op.node in work.recomputed),
                output_bytes=_to_bytes(work.output_bytes.evaluate(batch_size, seq)),
                param_bytes=layer.num_params * dtype_bytes,
                formulas=formulas,
            )
        )
    sizes = {name: _to_bytes(poly.evaluate(batch_size, seq)) for work in works for name, poly in work.edge_bytes.items()}
    table = CostTable(tuple(layers), model=graph.model, tied=graph.tied_parameters(dtype_bytes),
                      skips=graph.skip_tensors(sizes), num_microbatches=num_microbatches)
    return table.without_selective(selective_hazards(graph))  # layers selective recomputation cannot run


def _gradient_bytes(layer: Any, params: Mapping[str, nn.Parameter], modules: Mapping[str, nn.Module]
                    ) -> tuple[int, int]:
    """Bytes of the gradients of `layer`'s trainable parameters, and of those that belong to
    linear layers (the weights the split backward defers to W); `params` and `modules` by
    qualified name."""
    total = linear = 0
    for name in layer.parameters:
        param = params.get(name)
        if param is None or not param.requires_grad:
            continue
        size = param.numel() * param.element_size()
        total += size
        if isinstance(modules.get(name.rpartition(".")[0]), nn.Linear):
            linear += size
    return total, linear


_FORMULA_TEXT: dict[Poly, str] = {}


def _formula_text(poly: Poly) -> str:
    """sympy's text of a formula, memoized: the blocks of a model share their formulas."""
    text = _FORMULA_TEXT.get(poly)
    if text is None:
        if len(_FORMULA_TEXT) > 100_000:
            _FORMULA_TEXT.clear()
        text = _FORMULA_TEXT[poly] = str(poly.to_sympy())
    return text


def _to_bytes(value: float) -> int:
    return max(0, int(round(value)))


# ---------------------------------------------------------------------------- the must-show table


RATIO_FILE = Path(__file__).resolve().parents[2] / "data" / "profiles" / "layer-type-ratios.json"
"""The OctoPipe authors' profiled layer-type ratios (a copy of ../shared/data/profiles/ in the repo)."""
RATIO_COLUMNS = ("layer F", "layer B", "layer W", "moe F", "moe B", "moe W", "head F", "head B", "head W")


@dataclass(frozen=True)
class RatioRow:
    model: str
    entry: str
    ratio: str
    profiled: float
    analytic: float
    checked: bool
    """True for the head-vs-block rows the must-show test holds to 2x; the others are context."""

    @property
    def factor(self) -> float:
        """How far apart, as a factor >= 1."""
        if self.profiled <= 0 or self.analytic <= 0:
            return math.inf
        return max(self.profiled / self.analytic, self.analytic / self.profiled)


def _nearest(keys: Iterable[str], value: int) -> str:
    return min(keys, key=lambda k: (abs(math.log(int(k) / value)), int(k)))


_RATIO_MODELS = (("gemma", "GEMMA"), ("deepseek", "DEEPSEEK"), ("nemotron-h", "NEMOTRONH"))


def paper_graph(family: str) -> LayerGraph:
    """The paper config of a reference model, built on the meta device, traced with its loss."""
    from octopipe import models
    from octopipe.passes.trace import trace

    with torch.device("meta"):
        model = models.build(family, "paper")
        inputs = models.example_inputs(family, "paper", batch_size=2)
        target = models.example_target(family, "paper", batch_size=2)
    return trace(model, inputs, loss_fn=models.lm_loss, example_target=target)


def ratio_rows(
    path: str | Path | None = None,
    cluster: ClusterSpec | None = None,
    graphs: Mapping[str, LayerGraph] | None = None,
) -> list[RatioRow]:
    """Analytic time ratios of the paper configs next to the profiled ones (layer-type-ratios.json).

    Each of Gemma, DeepSeek and Nemotron-H is built at its paper config on the meta device,
    traced with its loss and priced for one sequence on `cluster` (default: an H100 node). The
    profiled entry is the one with the hidden size, sequence length and vocabulary nearest the
    paper config's (the file holds one hidden size per model). The head is everything after the
    last block: final norm, output projection, loss (the profiles' head includes the loss).
    Reading of the file's columns: `layer` is the model's first layer type (Gemma's block,
    DeepSeek's dense layer, Nemotron-H's Mamba-2 layer), `moe` DeepSeek's MoE layer or, for
    Nemotron-H, its MLP layer, which the file uses as unit (moe F = 1.0 there).

    Checked rows: head F / mean block F, the block mix weighted by the paper config's own counts
    (DeepSeek 1 dense + 27 MoE; Nemotron-H 27 Mamba + 25 MLP, its 4 attention layers left out on
    both sides as the file has no column for them). Other rows are context.
    """
    from octopipe import models

    data = json.loads(Path(path or RATIO_FILE).read_text())["data"]
    cluster = cluster or ClusterSpec.preset("h100x8")
    rows: list[RatioRow] = []
    for family, key in _RATIO_MODELS:
        cfg = models.config(family, "paper")
        hidden = _nearest(data[key], cfg.hidden_size)
        seq = _nearest(data[key][hidden], cfg.max_seq_len)
        vocab = _nearest(data[key][hidden][seq], cfg.vocab_size)
        profiled = dict(zip(RATIO_COLUMNS, data[key][hidden][seq][vocab]))
        entry = f"{key}[{hidden}][{seq}][{vocab}]"
        graph = graphs[family] if graphs and family in graphs else paper_graph(family)
        costs = analytic_costs(graph, cluster, batch_size=1, seq_len=cfg.max_seq_len)
        kinds = [_block_kind(graph, layer) for layer in graph.layers]
        last_block = max(i for i, layer in enumerate(graph.layers) if layer.kind == "block")
        head = sum(cost.forward_ms for cost in costs.layers[last_block + 1 :])  # final norm, head, loss
        forward = defaultdict(list)
        for cost, kind in zip(costs, kinds):
            forward[kind].append(cost.forward_ms)
        mean = {kind: sum(v) / len(v) for kind, v in forward.items()}
        count = {kind: len(v) for kind, v in forward.items()}

        def row(
            ratio: str,
            profiled_value: float,
            analytic_value: float,
            checked: bool = False,
            _family: str = family,
            _entry: str = entry,
        ) -> None:
            rows.append(RatioRow(_family, _entry, ratio, profiled_value, analytic_value, checked))

        def head_vs_mean_block(parts: list[tuple[str, int, float, float]], _head: float = head,
                               _profiled_head: float = profiled["head F"]) -> None:
            """The checked row: head F over the count-weighted mean of two block kinds;
            parts = (label, count, profiled F, analytic F)."""
            blocks = sum(n for _, n, _, _ in parts)
            profiled_block = sum(n * p for _, n, p, _ in parts) / blocks
            analytic_block = sum(n * a for _, n, _, a in parts) / blocks
            label = " + ".join(f"{n} {name}" for name, n, _, _ in parts)
            row(f"head F / mean block F ({label})", _profiled_head / profiled_block, _head / analytic_block,
                checked=True)

        if family == "gemma":
            row("head F / block F", profiled["head F"], head / mean["block"], checked=True)
        elif family == "deepseek":
            head_vs_mean_block([("dense", count["block"], profiled["layer F"], mean["block"]),
                                ("MoE", count["moe"], profiled["moe F"], mean["moe"])])
            row("head F / dense block F", profiled["head F"], head / mean["block"])
            row("MoE block F / dense block F", profiled["moe F"], mean["moe"] / mean["block"])
        else:
            head_vs_mean_block([("Mamba", count["mamba"], profiled["layer F"], mean["mamba"]),
                                ("MLP", count["mlp"], profiled["moe F"], mean["mlp"])])
            row("head F / Mamba block F", profiled["head F"] / profiled["layer F"], head / mean["mamba"])
            row("head F / MLP block F", profiled["head F"] / profiled["moe F"], head / mean["mlp"])
            row("Mamba block F / MLP block F", profiled["layer F"] / profiled["moe F"], mean["mamba"] / mean["mlp"])
    return rows


def _block_kind(graph: LayerGraph, layer: Any) -> str:
    """block | moe (a block holding an MoE) | mamba / mlp / attention (Nemotron-H's block kinds) | other."""
    if layer.kind != "block":
        return layer.kind
    block = graph.module.meta.get("octopipe.modules", {}).get(layer.modules[0])
    if block is None:
        return "block"
    if isinstance(getattr(block, "kind", None), str):
        return block.kind
    if any(_moe_spec(module) is not None for module in block.modules()):
        return "moe"
    return "block"


def ratio_table(
    path: str | Path | None = None,
    cluster: ClusterSpec | None = None,
    graphs: Mapping[str, LayerGraph] | None = None,
) -> str:
    """The comparison as a Markdown table (printed by the must-show test, pasted in the README)."""
    rows = ratio_rows(path, cluster, graphs)
    lines = [
        "| model | profiled entry [hidden][seq][vocab] | ratio | profiled | analytic | factor | checked |",
        "|---|---|---|---:|---:|---:|:---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.entry} | {r.ratio} | {r.profiled:.2f} | {r.analytic:.2f} | {r.factor:.2f}x | "
            f"{'<= 2x' if r.checked else ''} |"
        )
    return "\n".join(lines)
