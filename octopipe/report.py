"""PlanReport: what `octopipe.plan` found, beside every baseline, with the bounds.

Rows are plans (every baseline, the tuner's best, the CP-SAT solver's result); columns are the
simulated iteration time, bubble ratio, the busiest device's peak activation and total memory,
whether the plan fits the limits, and OctoPipe's speedup over it. The footer gives the balance
bound (microbatches x the smallest possible busiest-device load with whole layers per device),
the proven lower bound on iteration time and the gap of the returned plan to it, and the order
bound of the returned plan's own structure (how much of the gap a better op order could close).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class PlanRow:
    name: str
    kind: str  # "baseline" | "tuner" | "solver"
    iteration_ms: float
    bubble_ratio: float
    peak_activation_bytes: float
    peak_memory_bytes: float
    fits: bool
    num_stages: int


@dataclass
class PlanReport:
    rows: list[PlanRow]
    chosen: str
    num_devices: int
    num_microbatches: int
    num_layers: int
    balance_bound_ms: float
    balance_bound_optimal: bool
    lower_bound_ms: float
    activation_limit_bytes: float | None
    memory_limit_bytes: float | None
    planning_seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    cut_short: bool = False
    notes: list[str] = field(default_factory=list)
    order_bound_ms: float | None = None
    """No op order of the returned plan's structure (partition, placement, recomputation) within
    the limits runs faster: `solver.order_bound`, or the CP-SAT whole-order model's bound where
    that ran on it. Between it and the plan lies what a better order could gain at most; between
    it and `lower_bound_ms`, the structure's share of the gap (or the lower bound's slack)."""

    # -- derived ----------------------------------------------------------------------------
    def row(self, name: str) -> PlanRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    @property
    def chosen_row(self) -> PlanRow:
        return self.row(self.chosen)

    @property
    def iteration_ms(self) -> float:
        return self.chosen_row.iteration_ms

    @property
    def baselines(self) -> list[PlanRow]:
        return [row for row in self.rows if row.kind == "baseline"]

    @property
    def best_baseline(self) -> PlanRow:
        return min(self.baselines, key=lambda row: row.iteration_ms)

    @property
    def best_fitting_baseline(self) -> PlanRow | None:
        fitting = [row for row in self.baselines if row.fits]
        return min(fitting, key=lambda row: row.iteration_ms) if fitting else None

    @property
    def speedup(self) -> float:
        """Over the fastest baseline, whatever memory it needs."""
        return self.best_baseline.iteration_ms / self.iteration_ms

    @property
    def gap(self) -> float:
        """How far the returned plan can be from optimal: iteration / lower bound - 1."""
        return self.iteration_ms / self.lower_bound_ms - 1 if self.lower_bound_ms > 0 else 0.0

    @property
    def balance_ratio(self) -> float:
        return self.iteration_ms / self.balance_bound_ms if self.balance_bound_ms > 0 else 1.0

    # -- output -----------------------------------------------------------------------------
    def __str__(self) -> str:
        limit = ""
        if self.activation_limit_bytes is not None:
            limit += f", activation limit {self.activation_limit_bytes / GiB:.2f} GiB/device"
        if self.memory_limit_bytes is not None:
            limit += f", memory limit {self.memory_limit_bytes / GiB:.1f} GiB/device"
        lines = [
            f"OctoPipe plan: {self.num_layers} layers on {self.num_devices} devices, "
            f"{self.num_microbatches} microbatches{limit}",
            f"{'plan':<34} {'stages':>6} {'iter ms':>11} {'bubble':>7} {'act GiB':>8} {'mem GiB':>8} {'fits':>5} {'ours vs':>8}",
        ]
        for row in sorted(self.rows, key=lambda r: (r.kind != "baseline", r.iteration_ms)):
            marker = "*" if row.name == self.chosen else " "
            lines.append(
                f"{marker}{row.name:<33} {row.num_stages:>6} {_ms(row.iteration_ms):>11} {row.bubble_ratio:>6.1%} "
                f"{row.peak_activation_bytes / GiB:>8.2f} {row.peak_memory_bytes / GiB:>8.2f} {'yes' if row.fits else 'no':>5} "
                f"{row.iteration_ms / self.iteration_ms:>7.3f}x"
            )
        best = self.best_baseline
        fitting = self.best_fitting_baseline
        lines.append(
            f"speedup {self.speedup:.3f}x over the best baseline ({best.name}, {_ms(best.iteration_ms)} ms"
            + ("" if best.fits else ", over the memory limit") + ")"
            + (f"; {fitting.iteration_ms / self.iteration_ms:.3f}x over the best that fits ({fitting.name})"
               if fitting is not None and fitting is not best else "")
        )
        lines.append(
            f"balance bound {_ms(self.balance_bound_ms)} ms ({'exact' if self.balance_bound_optimal else 'best found'}; "
            f"plan at {self.balance_ratio:.3f}x), lower bound {_ms(self.lower_bound_ms)} ms, gap {self.gap:.1%}"
        )
        if self.order_bound_ms is not None:
            lines.append(f"order bound {_ms(self.order_bound_ms)} ms for this plan's partition and placement (plan at "
                         f"{self.iteration_ms / self.order_bound_ms:.3f}x: the most a better op order could gain)")
        timing = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.stage_seconds.items())
        lines.append(f"planned in {self.planning_seconds:.1f}s ({timing})" + (" - cut short by the time limit" if self.cut_short else ""))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "iteration_ms": self.iteration_ms,
            "speedup": self.speedup,
            "balance_bound_ms": self.balance_bound_ms,
            "lower_bound_ms": self.lower_bound_ms,
            "gap": self.gap,
            "order_bound_ms": self.order_bound_ms,
            "planning_seconds": self.planning_seconds,
            "cut_short": self.cut_short,
            "rows": [row.__dict__ for row in self.rows],
            "notes": self.notes,
        }


def _ms(value: float) -> str:
    """Milliseconds to two decimals, or to three significant digits below 1 ms (a tiny model's
    plan on a GPU preset runs in microseconds: 0.00 ms would say nothing)."""
    return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
