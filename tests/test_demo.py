"""`octopipe demo` end to end on the quick config: plan, train every compared plan, pictures."""

import re

import pytest

from octopipe.api import load_saved_plan
from octopipe.demo import run_demo
from octopipe.simulator import simulate


@pytest.mark.timeout(280)
def test_quick_demo_trains_every_plan_to_the_same_losses_and_writes_pictures(tmp_path):
    lines: list[str] = []
    result = run_demo(tmp_path / "demo", steps=1, time_limit_s=3.0, quick=True, say=lines.append)
    text = "\n".join(lines)
    rows = [line for line in lines if re.match(r"^(octopipe|\S+/\S+).*\d+\.\d+\s+\d+\.\d+\s+[+-]\d", line)]
    names = [row.split()[0] for row in rows]
    assert names[0] == "octopipe" and "1f1b/uniform" in names, text
    losses = {tuple(row.split()[-1:]) for row in rows}
    assert len(losses) == 1, f"plans trained to different losses:\n{text}"  # pipelining changes no arithmetic
    assert result["ours_ms"] > 0 and result["baseline_ms"] > 0
    assert "speedup over" in text and "per-step pairs" in text and "balance bound" in text
    assert re.search(r"^verdict: (faster than|slower than|no difference from|our plan is) ", text, re.M), text
    assert result["paired_speedup"].low <= result["paired_speedup"].median <= result["paired_speedup"].high
    assert (tmp_path / "demo" / "timelines.png").stat().st_size > 0
    assert (tmp_path / "demo" / "report.txt").read_text().startswith("OctoPipe plan")
    saved = load_saved_plan(tmp_path / "demo" / "octopipe-plan.json")  # `octopipe simulate` needs nothing else
    assert saved.costs is not None and saved.cluster is not None
    assert simulate(saved.plan, saved.costs, saved.cluster).iteration_ms == pytest.approx(saved.iteration_ms)
    assert saved.iteration_ms == pytest.approx(result["ours_planned_ms"])


@pytest.mark.parametrize("low, high, starts", [
    (1.02, 1.10, "verdict: faster than zb-h1/uniform"),
    (0.90, 0.98, "verdict: slower than zb-h1/uniform"),
    (0.97, 1.05, "verdict: no difference from zb-h1/uniform"),
])
def test_the_verdict_reads_the_middle_half_of_the_paired_steps(low, high, starts):
    from octopipe.bench import PairedSpeedup
    from octopipe.demo import verdict

    line = verdict(PairedSpeedup((low + high) / 2, low, high), "zb-h1/uniform")
    assert line.startswith(starts) and f"{low:.3f}x-{high:.3f}x" in line
    assert verdict(PairedSpeedup(1.0, 0.99, 1.01), "1f1b/uniform", same_plan=True).startswith("verdict: our plan is")
