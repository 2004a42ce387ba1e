"""Timeline figures of simulated plans, drawn like the figures of pipeline papers.

Consumes SimResults (`octopipe.simulator.simulate`); writes PNG or SVG (by the path's suffix) and
returns the matplotlib Figure so callers and tests can inspect what was drawn. One row per device
(device 0 on top), time in ms to the right, one box per op coloured by kind: F (forward), B
(input gradient), W (weight gradient) and a full backward (a B whose pair has no W) each have
their own colour; when a device runs several stages, its later stages are lighter shades of the
same colours. Boxes carry their microbatch number (and stage, where a device has several and
the box is wide enough); labels that would not fit are dropped, so 16 devices x 128 microbatches
stay legible. Idle time is the white between boxes.

Uses matplotlib's object API with the Agg canvas (no pyplot state, safe in any process).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from octopipe.errors import OctopipeError
from octopipe.ir.plan import OpKind
from octopipe.simulator import SimResult

__all__ = ["KIND_COLORS", "draw_timeline", "draw_comparison"]

KIND_COLORS: dict[str, str] = {
    "F": "#4e79a7",  # forward: blue
    "B": "#59a14f",  # input gradient: green
    "W": "#b07aa1",  # weight gradient: purple
    "BW": "#f28e2b",  # full backward (input + weight gradient): orange
}
_KIND_NAMES = {"F": "F forward", "B": "B input grad", "W": "W weight grad", "BW": "B full backward"}

_DPI = 150
_WIDTH_IN = 13.0
_LEFT_IN, _RIGHT_IN = 0.95, 0.2
_ROW_IN = 0.26  # height of one device row
_PLAN_HEAD_IN = 0.42  # space above each plan's rows (its title)
_FOOT_IN = 0.8  # x axis label and legend
_HEAD_IN = 0.3  # figure title
_BOX = 0.8  # box height, in rows
_FONT_PT = 6.5


def draw_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Figure:
    """Draw one simulated plan (one row per device) to `path` (.png or .svg)."""
    return draw_comparison({_summary(result): result}, path, title=title, _single=True)


def draw_comparison(
    results: Mapping[str, SimResult], path: str | Path, title: str | None = None, *, _single: bool = False
) -> Figure:
    """Draw several simulated plans stacked on one shared time axis, each labelled with its name,
    iteration time and bubble ratio, to `path` (.png or .svg)."""
    if not results:
        raise OctopipeError("draw_comparison: no results to draw")
    suffix = _suffix(path)
    rows = [result.plan.num_devices for result in results.values()]
    height = _HEAD_IN * bool(title) + sum(_PLAN_HEAD_IN + _ROW_IN * n for n in rows) + _FOOT_IN
    figure = Figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    FigureCanvasAgg(figure)
    span_ms = max(result.iteration_ms for result in results.values()) or 1.0
    top = height - _HEAD_IN * bool(title)
    axes_list = []
    for (name, result), num_rows in zip(results.items(), rows):
        top -= _PLAN_HEAD_IN
        box = (_LEFT_IN / _WIDTH_IN, (top - _ROW_IN * num_rows) / height,
               1 - (_LEFT_IN + _RIGHT_IN) / _WIDTH_IN, _ROW_IN * num_rows / height)
        axes = figure.add_axes(box, sharex=axes_list[0] if axes_list else None)
        label = name if _single else f"{name}: {result.iteration_ms:.1f} ms, bubble {result.bubble_ratio:.1%}"
        _draw_plan(axes, result, span_ms, label)
        axes_list.append(axes)
        top -= _ROW_IN * num_rows
    for axes in axes_list[:-1]:
        axes.tick_params(labelbottom=False)
    axes_list[-1].set_xlabel("time (ms)")
    axes_list[0].set_xlim(0, span_ms)
    if title:
        figure.suptitle(title, y=1 - 0.1 / height, fontsize=11, va="top")
    handles = _legend(results.values())
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False,
                  bbox_to_anchor=(0.5, 0.0))
    figure.savefig(path, format=suffix, facecolor="white")
    return figure


def _suffix(path: str | Path) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in ("png", "svg"):
        raise OctopipeError(f"cannot draw to {str(path)!r}: use a .png or .svg path")
    return suffix


def _summary(result: SimResult) -> str:
    plan = result.plan
    return (f"{plan.num_stages} stages on {plan.num_devices} devices, {plan.num_microbatches} microbatches: "
            f"{result.iteration_ms:.1f} ms, bubble {result.bubble_ratio:.1%}")


def _kind_key(result: SimResult, stage: int, microbatch: int, kind: OpKind) -> str:
    if kind is OpKind.B and (stage, microbatch) not in result.plan.split_backward():
        return "BW"
    return kind.value


def _shade(color: str, chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """Chunk 0 in the base colour, later chunks mixed towards white (up to 55%)."""
    mix = 0.55 * chunk / (num_chunks - 1) if num_chunks > 1 else 0.0
    r, g, b = to_rgb(color)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def _text_color(rgb: tuple[float, float, float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def _draw_plan(axes, result: SimResult, span_ms: float, label: str) -> None:
    plan = result.plan
    chunk_of = {}
    for device in range(plan.num_devices):
        stages = plan.stages_of(device)
        for chunk, stage in enumerate(stages):
            chunk_of[stage] = (chunk, len(stages))
    # pixel geometry, to decide which labels fit
    width_px = axes.get_position().width * axes.figure.get_figwidth() * _DPI
    row_px = _ROW_IN * _DPI * _BOX
    px_per_ms = width_px / span_ms
    char_px = _FONT_PT * 0.62 * _DPI / 72
    font_fits = row_px >= _FONT_PT * 1.1 * _DPI / 72
    verts, faces, texts = [], [], []
    for device, ops in enumerate(plan.device_ops):
        y0, y1 = device - _BOX / 2, device + _BOX / 2
        for op in ops:
            start, end = result.op_start[op], result.op_end[op]
            chunk, num_chunks = chunk_of[op.stage]
            face = _shade(KIND_COLORS[_kind_key(result, op.stage, op.microbatch, op.kind)], chunk, num_chunks)
            verts.append(((start, y0), (start, y1), (end, y1), (end, y0)))
            faces.append(face)
            if not font_fits:
                continue
            box_px = (end - start) * px_per_ms
            text = str(op.microbatch)
            if num_chunks > 1 and box_px >= (len(f"{op.stage}:{text}") + 1) * char_px:
                text = f"{op.stage}:{text}"
            if box_px >= (len(text) + 0.6) * char_px:
                texts.append(((start + end) / 2, device, text, _text_color(face)))
    ops_per_row = len(verts) / max(plan.num_devices, 1)
    dense = ops_per_row > 0 and width_px * result.iteration_ms / span_ms / ops_per_row < 4  # boxes under 4 px
    # dense rows: no outlines and no antialiasing, else seams between touching boxes look idle
    boxes = PolyCollection(verts, facecolors=faces, edgecolors="none" if dense else "white",
                           linewidths=0 if dense else 0.4, antialiaseds=not dense)
    boxes.set_gid("ops")
    axes.add_collection(boxes)
    for x, y, text, color in texts:
        axes.text(x, y, text, ha="center", va="center", fontsize=_FONT_PT, color=color, clip_on=True)
    axes.set_ylim(plan.num_devices - 0.5, -0.5)
    axes.set_yticks(range(plan.num_devices), [f"device {d}" for d in range(plan.num_devices)],
                    fontsize=7 if plan.num_devices <= 16 else 5)
    axes.set_facecolor("white")
    axes.set_title(label, loc="left", fontsize=9, pad=3)
    axes.tick_params(axis="x", labelsize=7)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)


def _legend(results) -> list[Patch]:
    present: set[str] = set()
    multi_stage = False
    for result in results:
        plan = result.plan
        split = plan.split_backward()
        multi_stage |= plan.num_stages > plan.num_devices
        for ops in plan.device_ops:
            for op in ops:
                present.add("BW" if op.kind is OpKind.B and (op.stage, op.microbatch) not in split else op.kind.value)
    handles = [Patch(facecolor=KIND_COLORS[key], label=_KIND_NAMES[key]) for key in ("F", "B", "W", "BW") if key in present]
    if multi_stage:
        handles += [Patch(facecolor=_shade("#555555", 0, 2), label="a device's first stage"),
                    Patch(facecolor=_shade("#555555", 1, 2), label="its later stages (lighter)")]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="idle"))
    return handles
