"""Timeline figures: files are valid PNG/SVG, one rectangle per op at its simulated time, kinds and
stages distinguishable, plans stacked on one time axis, large plans drawn without clutter.
Checks inspect the returned Figure (and the SVG tree), not pixels."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.collections import PolyCollection

from octopipe.cluster import ClusterSpec
from octopipe.errors import OctopipeError
from octopipe.ir.costs import CostTable, LayerCost
from octopipe.ir.plan import OpKind
from octopipe.schedules import build
from octopipe.simulator import simulate
from octopipe.viz import KIND_COLORS, draw_comparison, draw_timeline


def simulated(name: str, p: int = 4, m: int = 8, layers: int = 8):
    costs = CostTable([LayerCost(name=f"l{i}", forward_ms=1.0, backward_ms=2.0, backward_weight_ms=1.0) for i in range(layers)])
    cluster = ClusterSpec(num_devices=p, latency_s=0.0, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30)
    return simulate(build(name, costs, cluster, m), costs, cluster)


def op_boxes(axes) -> PolyCollection:
    (boxes,) = [c for c in axes.collections if c.get_gid() == "ops"]
    return boxes


def rectangles(boxes: PolyCollection) -> list[tuple[float, float, float]]:
    """(x start, x end, row centre) of every drawn box, checking each is an axis-aligned rectangle."""
    result = []
    for path in boxes.get_paths():
        xs, ys = path.vertices[:4, 0], path.vertices[:4, 1]
        assert len(set(xs.round(9))) == 2 and len(set(ys.round(9))) == 2
        result.append((float(xs.min()), float(xs.max()), float(ys.mean())))
    return result


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "dualpipe-v", "interleaved-1f1b"])
def test_png_has_one_rectangle_per_op_at_its_simulated_time(tmp_path: Path, name):
    result = simulated(name)
    path = tmp_path / "timeline.png"
    figure = draw_timeline(result, path, title=name)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(path).ndim == 3
    (axes,) = figure.axes
    drawn = sorted(tuple(round(x, 9) for x in box) for box in rectangles(op_boxes(axes)))
    expected = sorted(
        (round(result.op_start[op], 9), round(result.op_end[op], 9), float(device))
        for device, ops in enumerate(result.plan.device_ops) for op in ops
    )
    assert len(drawn) == result.plan.num_ops()
    assert drawn == expected
    assert axes.get_xlim() == pytest.approx((0, result.iteration_ms))
    assert axes.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in axes.get_yticklabels()] == [f"device {d}" for d in range(4)]


def test_svg_is_valid_and_holds_one_path_per_op(tmp_path: Path):
    result = simulated("zb-v")
    path = tmp_path / "timeline.svg"
    draw_timeline(result, path)
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    (group,) = [element for element in root.iter() if element.get("id") == "ops"]
    assert len([child for child in group if child.tag.endswith("path")]) == result.plan.num_ops()


def test_kinds_and_stages_get_distinct_colours(tmp_path: Path):
    # zb-h1 splits every backward (F, B, W); 1f1b runs full backwards; dualpipe-v mixes both.
    for name, kinds in (("zb-h1", {"F", "B", "W"}), ("1f1b", {"F", "BW"}), ("dualpipe-v", {"F", "B", "W", "BW"})):
        result = simulated(name)
        figure = draw_timeline(result, tmp_path / f"{name}.png")
        boxes = op_boxes(figure.axes[0])
        split = result.plan.split_backward()
        colour_by_key: dict[tuple[str, int], set] = {}
        for op, face in zip((op for ops in result.plan.device_ops for op in ops), boxes.get_facecolors()):
            key = "BW" if op.kind is OpKind.B and (op.stage, op.microbatch) not in split else op.kind.value
            chunk = result.plan.stages_of(result.plan.stages[op.stage].device).index(op.stage)
            colour_by_key.setdefault((key, chunk), set()).add(tuple(face.round(6)))
        assert {key for key, _ in colour_by_key} == kinds
        assert all(len(colours) == 1 for colours in colour_by_key.values())  # one colour per (kind, chunk)
        distinct = {next(iter(colours)) for colours in colour_by_key.values()}
        assert len(distinct) == len(colour_by_key)  # kinds differ, and so do a device's stages
    assert len(set(KIND_COLORS.values())) == 4


def test_labels_name_the_microbatch_and_the_stage_on_multi_stage_devices(tmp_path: Path):
    single = draw_timeline(simulated("1f1b"), tmp_path / "a.png").axes[0]
    assert sorted(t.get_text() for t in single.texts) == sorted(str(k) for k in range(8) for _ in range(2 * 4))
    multi = draw_timeline(simulated("zb-v"), tmp_path / "b.png").axes[0]
    texts = {t.get_text() for t in multi.texts}
    assert "0:0" in texts and "7:0" in texts  # stage:microbatch where the box is wide enough


def test_comparison_stacks_plans_on_one_time_axis(tmp_path: Path):
    results = {name: simulated(name) for name in ("1f1b", "zb-h1", "zb-v")}
    path = tmp_path / "comparison.svg"
    figure = draw_comparison(results, path, title="4 devices, 8 microbatches")
    ElementTree.parse(path)
    assert len(figure.axes) == 3
    longest = max(r.iteration_ms for r in results.values())
    for axes, (name, result) in zip(figure.axes, results.items()):
        assert axes.get_xlim() == pytest.approx((0, longest))
        assert axes.get_title(loc="left").startswith(f"{name}: {result.iteration_ms:.1f} ms")
        assert len(op_boxes(axes).get_paths()) == result.plan.num_ops()
    # shared axis: only the bottom plan shows tick labels
    assert [a.xaxis.get_tick_params()["labelbottom"] for a in figure.axes] == [False, False, True]


def test_large_plans_drop_labels_that_do_not_fit(tmp_path: Path):
    costs = CostTable([LayerCost(name=f"l{i}", forward_ms=6.0 + (i in (0, 39)) * 7, backward_ms=11.0) for i in range(40)])
    cluster = ClusterSpec.preset("h100x16")
    result = simulate(build("zb-v", costs, cluster, 128, partition="balanced"), costs, cluster)
    start = time.perf_counter()
    figure = draw_timeline(result, tmp_path / "big.png")
    assert time.perf_counter() - start < 20
    (axes,) = figure.axes
    assert len(op_boxes(axes).get_paths()) == result.plan.num_ops() == 16 * 2 * 128 * 3
    assert len(axes.texts) < result.plan.num_ops() // 20  # almost every box is too narrow to label
    assert len(axes.get_yticklabels()) == 16


def test_unknown_suffix_is_refused(tmp_path: Path):
    with pytest.raises(OctopipeError, match=r"\.png or \.svg"):
        draw_timeline(simulated("1f1b"), tmp_path / "timeline.pdf")
