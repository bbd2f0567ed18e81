"""A rank that stopped stepping stands out in the report's rank panels (issue 34 item 2).

Two ranks step every 0.5 s on a 2 s grid; rank 1 hangs in its data loader at 100 s (rank 0 waits in the
all-reduce), the group is restarted: no sample from 130 s, the new incarnation is scraped from 140 s and
steps again from 145 s. The timing series (rate-window means) go on reading a normal step for a while
after the hang began, as Prometheus's do.
"""

from __future__ import annotations

import numpy as np
from rankscope.contract import PHASES
from rankscope.report import plots
from rankscope.report.analysis import straggler
from rankscope.report.series import Series
from rankscope.report.stops import find_stops

from tests.report_series import compute_per_rank

T0 = 1_800_000_000.0
GRID = T0 + np.arange(0.0, 240.0, 2.0)
AXIS = plots.TimeAxis(T0, float(GRID[-1]))
ABSENT = (GRID >= T0 + 130) & (GRID < T0 + 140)


def _last_step(rank: int) -> Series:
    seen = GRID - 0.1  # a step ended just before each scrape
    seen = np.where((GRID >= T0 + 100) & (GRID < T0 + 130), T0 + 99.9, seen)  # the hang
    seen = np.where((GRID >= T0 + 140) & (GRID < T0 + 146), 0.0, seen)  # restarted, no step yet
    return Series({"rank": str(rank), "node": "n0"}, GRID[~ABSENT], seen[~ABSENT])


def _phase(rank: int) -> Series:
    doing = np.full(len(GRID), float(PHASES.index("compute")))
    hung = PHASES.index("data_wait") if rank == 1 else PHASES.index("collective")
    doing[(GRID >= T0 + 100) & (GRID < T0 + 130)] = hung
    return Series({"rank": str(rank), "node": "n0"}, GRID[~ABSENT], doing[~ABSENT])


def _timings() -> list[Series]:
    # Rate-window means: still 0.1 s for 20 s into the hang, then absent until the new steps' window fills.
    out = []
    for s in compute_per_rank(GRID, 2):
        keep = ~((GRID >= T0 + 120) & (GRID < T0 + 150))
        out.append(Series(s.labels, s.t[keep], s.v[keep]))
    return out


def test_a_hang_and_its_restart_are_one_stop_per_rank_with_what_each_rank_was_doing() -> None:
    stops = find_stops([_last_step(0), _last_step(1)], interval=2.0, phases=[_phase(0), _phase(1)])
    assert [(s.rank, round(s.start - T0, 1), s.phase) for s in stops] == [
        (0, 99.9, "collective"),
        (1, 99.9, "data_wait"),
    ]
    assert all(T0 + 144 <= s.end < T0 + 146 for s in stops)  # until the new incarnation steps
    assert find_stops([_last_step(0)], interval=2.0, to_the_end=True)[-1].end < T0 + 146  # no stop at the end


def test_the_rank_panels_draw_no_line_across_a_stop_and_mark_it_in_every_panel() -> None:
    timings = {key: _timings() for key in ("step", "compute", "comm", "data wait")}
    stops = find_stops([_last_step(0), _last_step(1)], interval=2.0, phases=[_phase(0), _phase(1)])
    since = [_last_step(0), _last_step(1)]
    figure = plots.rank_timings_figure(timings, AXIS, straggler(timings["compute"]), (), stops, since)
    panels = {axis.get_title(loc="left"): axis for axis in figure.axes}
    for title, axis in panels.items():
        for line in axis.get_lines():
            if str(line.get_label()).startswith("rank ") and not title.startswith("Time since"):
                x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
                inside = (x > 100.0) & (x < 144.0)
                assert not np.isfinite(y[inside]).any(), f"{title!r}: {line.get_label()} is drawn across the stop"
        shaded = [p for p in axis.patches if p.get_gid() == "stop"]
        assert shaded, f"{title!r} does not mark the stretch without steps"
    stopped = next(axis for title, axis in panels.items() if title.startswith("Time since"))
    title = stopped.get_title(loc="left")
    assert "rank 1" in title and "data wait" in title and "rank 0" in title and "collective" in title
    ages = [line for line in stopped.get_lines() if str(line.get_label()) == "rank 1"][0]
    assert np.nanmax(ages.get_ydata()) > 25.0  # it climbs through the hang


def test_the_small_multiples_and_the_heat_map_draw_no_compute_time_across_the_stop() -> None:
    stops = find_stops([_last_step(0), _last_step(1)], interval=2.0)
    figure = plots.rank_small_multiples_figure(_timings(), AXIS, None, stops)
    for axis in figure.axes[:2]:
        for line in axis.get_lines():
            x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
            assert not np.isfinite(y[(x > 100.0) & (x < 144.0)]).any(), f"{axis.get_title(loc='left')} runs across"
            assert not (np.diff(x[np.isfinite(y)]) > 10).any() or np.isnan(y).any()
        assert [p for p in axis.patches if p.get_gid() == "stop"]
    heat = plots.rank_heatmap_figure(_timings(), AXIS).axes[0].images[0]
    left, right = heat.get_extent()[:2]
    columns = heat.get_array().shape[1]
    assert abs((right - left) / columns - 2.0) < 1e-6, "a column is not one 2 s sample: the gap shifts the time"
    assert heat.get_array().mask[:, (120 - 0) // 2 + 5].all()  # 130 s: no sample, no colour


def test_the_validation_line_does_not_run_across_a_stop() -> None:
    from rankscope.report.stops import mask_stops

    stops = find_stops([_last_step(0), _last_step(1)], interval=2.0)
    val = Series({}, T0 + np.array([60.0, 90.0, 180.0, 210.0]), np.array([1.5, 1.3, 1.1, 1.0]))
    broken = mask_stops(val, stops, gaps=False)
    assert np.isnan(broken.v).sum() == 1 and T0 + 90 < broken.t[np.isnan(broken.v)][0] < T0 + 180
