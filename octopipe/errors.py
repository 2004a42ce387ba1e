"""The one error hierarchy of OctoPipe.

Every user-facing failure is an `OctopipeError` subclass whose message says where (file, layer,
stage, rank, step), which rule broke, expected vs actual, and the fix when there is one.
"""

from __future__ import annotations


class OctopipeError(Exception):
    """Base class of every error OctoPipe raises on purpose."""


class ArgumentError(OctopipeError, ValueError):
    """A function or command argument is of the wrong type or out of range (a count, a limit, a
    seed, a schedule name): the call is wrong, not the model or the plan."""


class ParseError(OctopipeError):
    """A text or file form of an IR value (plan, cost table, program, graph) is malformed."""


class ClusterSpecError(OctopipeError):
    """A cluster description is invalid (non-positive sizes, unknown preset, bad file)."""


class CostTableError(OctopipeError):
    """A cost table is malformed: names the file, the layer and the field."""


class TraceError(OctopipeError):
    """A model could not be traced into a LayerGraph."""

    causes: tuple[BaseException, ...]
    """Where `trace` set it: the tracers' own exceptions, kept for debugging."""


class PlanError(OctopipeError):
    """A pipeline plan cannot run (missing op, op on the wrong device, dependency cycle)."""


class InfeasibleError(OctopipeError):
    """No plan meets the constraints (for example the memory limit)."""


class VerificationError(OctopipeError):
    """Rank programs failed a static check (unmatched comms, missing inputs, deadlock)."""


class ExecutionError(OctopipeError):
    """A pipeline step failed at run time (a peer died or stalled, a worker raised)."""


class DataError(OctopipeError):
    """A training data file is unreadable or does not fit the model (its size, dtype or token ids)."""


class OctopipeWarning(UserWarning):
    """Something runs, but not as a user of plain PyTorch might expect (for example a buffer
    updated once per microbatch instead of once per batch)."""
