"""rankscope.report.plots: every figure of the run report, drawn from synthetic series.

Each test builds a figure the way the report does, checks what it shows (lines per rank in
their colour, units on the axes, the straggler named, actions marked) and that its PNG is a
picture, not a blank canvas, 1240 px wide.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib import colors as mcolors
from PIL import Image, ImageStat
from rankscope.control.catalog import CATALOG
from rankscope.report import plots
from rankscope.report.analysis import straggler
from rankscope.report.attention import AttentionSnapshot
from rankscope.report.incidents import ActionEvent, AlertEpisode, Incidents
from rankscope.report.series import Series

from tests.report_series import compute_per_rank

T0 = 1_800_000_000.0
STEP = 5.0
TIMES = T0 + STEP * np.arange(120)  # ten minutes at a 5 s resolution
AXIS = plots.TimeAxis(T0, float(TIMES[-1]))


def _rank(rank: int, values: np.ndarray, **labels: str) -> Series:
    return Series({"rank": str(rank), "node": "n0", **labels}, TIMES, values)


def _png(figure) -> Image.Image:
    image = Image.open(io.BytesIO(plots.png_bytes(figure))).convert("L")
    assert image.width == plots.WIDTH * plots.DPI
    return image


def _not_blank(figure) -> None:
    """A drawn figure has many grey levels and real contrast; a blank one is a single colour."""
    image = _png(figure)
    assert ImageStat.Stat(image).stddev[0] > 10, "the figure is (nearly) blank"
    assert len(image.getcolors(maxcolors=1 << 16) or []) > 20


def _texts(figure) -> str:
    return " ".join(t.get_text() for t in figure.findobj(lambda a: hasattr(a, "get_text") and a.get_text()))


def _compute(ranks: int, slow: int | None = None, factor: float = 2.0) -> list[Series]:
    return compute_per_rank(TIMES, ranks, slow, factor, from_index=40, noise=0.05)


def _incidents() -> Incidents:
    episode = AlertEpisode(
        "RankscopeLossDiverging",
        {"alertname": "RankscopeLossDiverging", "severity": "ticket", "action": "reduce_lr"},
        pending_at=T0 + 200,
        firing_at=T0 + 210,
        ended_at=T0 + 260,
        active=False,
    )
    straggling = AlertEpisode(
        "RankscopeRankImbalance",
        {"alertname": "RankscopeRankImbalance", "rank": "3", "node": "n0", "severity": "page"},
        pending_at=T0 + 300,
        firing_at=T0 + 305,
        ended_at=T0 + 590,
        active=True,
    )
    action = ActionEvent("reduce_lr", "alert", "applied", T0 + 214.0, step=140, cause=episode)
    refused = ActionEvent("reduce_lr", "alert", "refused_cooldown", T0 + 250.0)
    return Incidents([episode, straggling], [action, refused], [(T0 + 100, "interval"), (T0 + 400, "alert:X")], [])


# --- colours and axes ---------------------------------------------------------------------------------


def test_each_rank_keeps_one_colour_and_64_ranks_get_64_distinct_colours() -> None:
    small = plots.rank_colors([0, 1, 2])
    assert small == plots.rank_colors([2, 1, 0]) and len(set(small.values())) == 3
    many = plots.rank_colors(range(64))
    assert len({mcolors.to_hex(c) for c in many.values()}) == 64
    assert plots.rank_colors(range(64))[17] == many[17]


@pytest.mark.parametrize(
    ("span", "tick", "label"),
    [(60.0, 10, "0:10"), (600.0, 120, "2:00"), (3 * 3600.0, 1800, "0:30:00"), (2 * 86400.0, 43200, "12:00:00")],
)
def test_the_time_axis_has_a_handful_of_clock_ticks_at_round_intervals(span: float, tick: int, label: str) -> None:
    figure = plots._figure(2.0)
    axis = figure.subplots()
    axis.plot([0, span], [0, 1])
    plots.TimeAxis(T0, T0 + span).apply(axis)
    ticks = [t for t in axis.get_xticks() if 0 <= t <= span]
    assert np.allclose(np.diff(ticks), tick) and 3 <= len(ticks) <= 9
    assert axis.xaxis.get_major_formatter()(tick, 1) == label


def test_bytes_are_labelled_in_binary_units_at_round_values() -> None:
    figure = plots._figure(2.0)
    axis = figure.subplots()
    values = [1.1 * 1024**3, 1.9 * 1024**3]
    axis.plot([0, 1], values)
    assert plots.bytes_axis(axis, values) == "GiB"
    ticks = axis.yaxis.get_major_locator().tick_values(*values)
    assert np.allclose((ticks / 1024**3 * 10) % 1, 0) or np.allclose((ticks / 1024**3 * 4) % 1, 0)
    assert axis.yaxis.get_major_formatter()(1.5 * 1024**3, 0) == "1.5 GiB"


def test_durations_are_labelled_in_milliseconds_below_a_second() -> None:
    figure = plots._figure(2.0)
    axis = figure.subplots()
    assert plots.seconds_axis(axis, [0.012, 0.250]) == "ms"
    assert axis.yaxis.get_major_formatter()(0.05, 0) == "50 ms"
    assert plots.seconds_axis(axis, [2.0, 30.0]) == "s"


# --- training -----------------------------------------------------------------------------------------


def _training(lr_drop: float = 0.3) -> plots.TrainingInputs:
    decay = np.exp(-np.arange(len(TIMES)) / 30)
    lr = np.where(np.arange(len(TIMES)) < 43, 1e-3, 1e-3 * lr_drop)
    return plots.TrainingInputs(
        train_loss=Series({"split": "train"}, TIMES, 2.5 * decay + 0.3),
        val_loss=Series({"split": "val"}, TIMES[::20], (2.5 * decay + 0.4)[::20]),
        per_step_loss=Series({}, T0 + np.linspace(0, TIMES[-1] - T0, 600), np.linspace(2.8, 0.3, 600)),
        accuracy=[
            Series({"split": s, "direction": d}, TIMES, 1 - decay)
            for s in ("train", "val")
            for d in ("image_to_text", "text_to_image")
        ],  # fmt: skip
        learning_rate=[Series({"param_group": g}, TIMES, lr) for g in ("0", "1")],
        grad_norm=Series({}, TIMES, 5 + decay),
    )


def test_the_training_figure_shows_losses_accuracy_learning_rates_and_the_action_that_cut_the_rate() -> None:
    marks = plots.marks_from(_incidents(), STEP)
    figure = plots.training_figure(_training(), AXIS, marks)
    loss, accuracy, lr, norm = figure.axes
    assert [line.get_label() for line in loss.get_lines() if not line.get_label().startswith("_")] == [
        "train, every step (run log, rank 0)", "train (mean over ranks)", "validation",
    ]  # fmt: skip
    assert len([line for line in accuracy.get_lines() if not line.get_label().startswith("_")]) == 4
    assert accuracy.yaxis.get_major_formatter()(0.5, 0) == "50%"
    # The reduction is a dashed line at its time, labelled, on the learning-rate panel.
    dashed = [line for line in lr.get_lines() if line.get_linestyle() == "--"]
    assert [float(line.get_xdata()[0]) for line in dashed] == [214.0]
    assert "reduce_lr" in _texts(figure)
    assert lr.get_xlim() == (0.0, AXIS.span)
    _not_blank(figure)


def test_every_catalog_action_has_a_colour_of_its_own() -> None:
    actions = [spec.name for spec in CATALOG]
    assert set(plots.ACTION_COLORS) >= set(actions), set(actions) - set(plots.ACTION_COLORS)
    # pause and resume bracket one span and may share one; every other action is told apart by its colour
    distinct = {plots.ACTION_COLORS[a] for a in actions if a != "resume"}
    assert len(distinct) == len(actions) - 1


def test_a_rollback_is_a_labelled_line_on_the_loss_panel_where_the_curve_jumps_back() -> None:
    rollback = ActionEvent("rollback", "alert", "applied", T0 + 300.0, step=180, reason="back to step 150")
    incidents = Incidents([], [rollback], [], [])
    figure = plots.training_figure(_training(), AXIS, plots.marks_from(incidents, STEP))
    loss = figure.axes[0]
    dashed = [line for line in loss.get_lines() if line.get_linestyle() == "--"]
    assert [float(line.get_xdata()[0]) for line in dashed] == [300.0]
    assert mcolors.to_hex(dashed[0].get_color()) == plots.ACTION_COLORS["rollback"]
    assert "rollback" in [t.get_text() for t in loss.texts]


def test_a_learning_rate_cut_by_100x_is_drawn_on_a_log_scale() -> None:
    figure = plots.training_figure(_training(lr_drop=0.01), AXIS)
    assert figure.axes[2].get_yscale() == "log"
    assert plots.training_figure(_training(lr_drop=0.5), AXIS).axes[2].get_yscale() == "linear"


def test_missing_training_series_are_said_so_in_the_panel() -> None:
    figure = plots.training_figure(plots.TrainingInputs(), AXIS)
    text = _texts(figure)
    assert "no loss series in this run" in text and "no rankscope_learning_rate series" in text
    _not_blank(figure)


# --- ranks ----------------------------------------------------------------------------------------------


def test_rank_timings_draw_one_line_per_rank_in_its_colour_and_name_the_straggler() -> None:
    compute = _compute(4, slow=3)
    timings = {"step": _compute(4), "compute": compute, "comm": _compute(4), "data wait": _compute(4)}
    found = straggler(compute)
    figure = plots.rank_timings_figure(timings, AXIS, found)
    colors = plots.rank_colors(range(4))
    for axis in figure.axes[:4]:
        labelled = {
            line.get_label(): line.get_color() for line in axis.get_lines() if line.get_label().startswith("rank")
        }
        assert {k: mcolors.to_rgba(v) for k, v in labelled.items()} == {f"rank {r}": colors[r] for r in range(4)}
        assert axis.yaxis.get_major_formatter()(0.1, 0) == "100 ms"
    assert "rank 3 is the straggler" in figure.axes[1].get_title(loc="left")
    _not_blank(figure)


def test_with_64_ranks_the_lines_lose_their_legend_and_gain_a_rank_colour_bar() -> None:
    compute = _compute(64, slow=41)
    figure = plots.rank_timings_figure({"compute": compute}, AXIS, straggler(compute))
    assert all(axis.get_legend() is None for axis in figure.axes[:4])
    assert any("rank (colour)" in axis.get_ylabel() for axis in figure.axes[4:])


def test_small_multiples_give_every_one_of_64_ranks_a_panel_and_frame_the_straggler_in_red() -> None:
    compute = _compute(64, slow=41)
    figure = plots.rank_small_multiples_figure(compute, AXIS, straggler(compute))
    visible = [axis for axis in figure.axes if axis.get_visible()]
    assert [axis.get_title(loc="left") for axis in visible] == [f"rank {r}" for r in range(64)]
    assert mcolors.to_hex(visible[41].spines["left"].get_edgecolor()) == plots.FIRING
    assert all(mcolors.to_hex(axis.spines["left"].get_edgecolor()) != plots.FIRING for axis in visible[:41])
    assert len({axis.get_ylim() for axis in visible}) == 1  # shared y: panels compare at a glance
    assert "straggler rank 41" in _texts(figure)
    image = _png(figure)
    assert image.height <= 1000  # 8 rows of panels: still one screen
    _not_blank(figure)


def test_with_two_ranks_each_panels_grey_reference_is_the_other_rank_drawn_over_its_own_line() -> None:
    compute = _compute(2, slow=1)
    figure = plots.rank_small_multiples_figure(compute, AXIS, straggler(compute))
    for axis, other in zip(figure.axes[:2], reversed(compute), strict=True):
        grey = [line for line in axis.get_lines() if mcolors.to_hex(line.get_color()) == "#777777"]
        own = [line for line in axis.get_lines() if line not in grey]
        assert len(grey) == 1, "one grey reference line per panel"
        # The median of two ranks is their mean: a line hidden between the two. The other ranks' median is not.
        assert np.allclose(grey[0].get_ydata(), other.v)
        assert grey[0].get_zorder() > max(line.get_zorder() for line in own), "the reference is drawn under"
    assert "grey: the median of the other ranks" in _texts(figure)


def test_the_heat_map_holds_every_rank_and_shows_the_straggler_above_one() -> None:
    compute = _compute(16, slow=5, factor=3.0)
    figure = plots.rank_heatmap_figure(compute, AXIS)
    (image,) = figure.axes[0].get_images()
    ratios = image.get_array()
    assert ratios.shape == (16, len(TIMES))
    assert np.ma.median(ratios[5, 50:]) == pytest.approx(3.0, rel=0.1)
    assert np.ma.median(ratios[4, 50:]) == pytest.approx(1.0, rel=0.1)
    _not_blank(figure)


# --- resources --------------------------------------------------------------------------------------------


def test_resources_show_memory_in_binary_units_and_say_when_there_is_no_device() -> None:
    inputs = plots.ResourceInputs(
        host_memory=[Series({"node": "n0"}, TIMES, np.full(len(TIMES), 0.4))],
        process_memory=[_rank(r, np.full(len(TIMES), (1.2 + r) * 1024**3)) for r in range(2)],
        samples_rate=Series({}, TIMES, np.full(len(TIMES), 250.0)),
        tokens_rate=Series({}, TIMES, np.full(len(TIMES), 2500.0)),
    )
    figure = plots.resources_figure(inputs, AXIS)
    host, process, device, speed = figure.axes[:4]
    assert host.yaxis.get_major_formatter()(0.4, 0) == "40%"
    assert process.yaxis.get_major_formatter()(2 * 1024**3, 0) == "2 GiB"
    assert "this run trained on CPU" in _texts(figure)
    assert speed.yaxis.get_major_formatter()(1500, 0) == "1.5 k/s"
    _not_blank(figure)


def test_device_memory_and_gpu_utilisation_share_a_panel_when_present() -> None:
    inputs = plots.ResourceInputs(
        device_memory=[
            _rank(r, np.full(len(TIMES), 8 * 1024**3), kind=k)
            for r in range(2)
            for k in ("allocated", "reserved", "total")
        ],  # fmt: skip
        gpu_utilization=[_rank(r, np.full(len(TIMES), 0.9)) for r in range(2)],
    )
    figure = plots.resources_figure(inputs, AXIS)
    device = figure.axes[2]
    assert len(device.get_lines()) == 4  # allocated and reserved per rank; "total" is not a usage line
    assert any("GPU utilisation" in axis.get_ylabel() for axis in figure.axes)


# --- incidents -------------------------------------------------------------------------------------------


def test_the_incident_timeline_has_a_row_per_alert_and_joins_the_fault_to_its_action() -> None:
    figure = plots.incidents_figure(_incidents(), AXIS, STEP)
    axis = figure.axes[0]
    rows = [label.get_text() for label in axis.get_yticklabels()]
    assert rows == ["RankscopeLossDiverging", "RankscopeRankImbalance (rank=3, node=n0)", "checkpoints",
                    "control actions"]  # fmt: skip
    bars = [(round(p.get_x()), round(p.get_width())) for p in axis.patches]
    assert (200, 10) in bars and (210, 55) in bars  # pending from the onset, firing to the last sample
    assert "14.0 s" in _texts(figure)  # onset at 200 s, applied at 214 s
    assert "reduce_lr (refused_cooldown)" in _texts(figure)
    _not_blank(figure)


def test_a_quiet_run_says_that_nothing_fired() -> None:
    figure = plots.incidents_figure(Incidents([], [], [], []), AXIS)
    assert "No alert fired and no control action was taken" in figure.axes[0].get_title(loc="left")


# --- analyses --------------------------------------------------------------------------------------------


def test_the_loss_rate_figure_shades_where_the_loss_climbs() -> None:
    slope = np.sin(np.linspace(0, 6, len(TIMES))) * 0.01
    figure = plots.loss_rate_figure(TIMES, slope, AXIS, "step", "50 steps")
    axis = figure.axes[0]
    assert axis.get_ylabel() == "d loss / d step" and "50 steps" in axis.get_title(loc="left")
    assert {c.get_label() for c in axis.collections} >= {"rising", "falling"}
    low, high = axis.get_ylim()
    assert low < -0.009 and high > 0.009
    _not_blank(figure)


def test_the_correlation_figure_is_bounded_by_plus_and_minus_one() -> None:
    correlation = np.clip(np.linspace(-1.2, 1.2, len(TIMES)), -1, 1)
    figure = plots.correlation_figure(TIMES, correlation, AXIS, "50 steps")
    assert figure.axes[0].get_ylim() == (-1.05, 1.05)
    _not_blank(figure)
    empty = plots.correlation_figure(TIMES, np.full(len(TIMES), np.nan), AXIS, "50 steps")
    assert "not enough points" in _texts(empty)


def test_memory_against_sequence_length_is_one_colour_per_rank() -> None:
    pairs = {r: (np.arange(10.0) + 8, (1 + 0.1 * np.arange(10.0) + r) * 1024**3) for r in range(3)}
    figure = plots.memory_vs_length_figure(pairs, "tokens", "process RSS")
    axis = figure.axes[0]
    assert len(axis.collections) == 3
    assert [mcolors.to_rgba(c.get_facecolor()[0], 1) for c in axis.collections] == [
        mcolors.to_rgba(plots.rank_colors(range(3))[r], 1) for r in range(3)
    ]
    assert axis.yaxis.get_major_formatter()(2 * 1024**3, 0) == "2 GiB"
    image = Image.open(io.BytesIO(plots.png_bytes(figure)))
    assert image.width < plots.WIDTH * plots.DPI
    assert ImageStat.Stat(image.convert("L")).stddev[0] > 10


# --- attention and summary -------------------------------------------------------------------------------


def _snapshot(image_maps: bool = True) -> AttentionSnapshot:
    rng = np.random.default_rng(1)
    tokens = np.array([["[CLS]", "a", "red", "circle", "[SEP]", ""]] * 5)
    text = rng.dirichlet(np.ones(6), size=(5, 6)).astype(np.float32)
    return AttentionSnapshot(
        step=40,
        time=T0,
        images=rng.integers(0, 255, (5, 48, 48, 3), dtype=np.uint8),
        captions=["a red circle"] * 5,
        tokens=tokens,
        text_attention=text,
        image_attention=rng.dirichlet(np.ones(9), size=5).reshape(5, 3, 3).astype(np.float32) if image_maps else None,
    )


def test_attention_maps_show_each_image_beside_its_patch_attention_and_the_caption_matrix() -> None:
    figure = plots.attention_figure(_snapshot())
    heat = [axis for axis in figure.axes if axis.get_title() == "class token's attention"]
    assert len(heat) == plots.SHOWN_SAMPLES  # at most four of the five samples
    text = [axis for axis in figure.axes if axis.get_title() == "a red circle"]
    assert [t.get_text() for t in text[0].get_xticklabels()] == ["[CLS]", "a", "red", "circle", "[SEP]"]
    assert "Validation at step 40" in _texts(figure)
    _not_blank(figure)


def test_a_model_without_image_attention_gets_the_caption_matrices_only() -> None:
    figure = plots.attention_figure(_snapshot(image_maps=False), samples=2)
    assert not [axis for axis in figure.axes if axis.get_title() == "class token's attention"]
    assert len([axis for axis in figure.axes if axis.get_title() == "a red circle"]) == 2


def test_the_summary_has_loss_learning_rate_ranks_and_incidents_in_one_picture() -> None:
    compute = _compute(4, slow=3)
    figure = plots.summary_figure("run x", _training(), compute, _incidents(), AXIS, straggler(compute), STEP)
    titles = [axis.get_title(loc="left") for axis in figure.axes]
    assert titles[0] == "Loss" and "actions marked" in titles[1]
    assert "rank 3 is the straggler" in titles[2] and "control actions" in titles[3]
    assert "reduce_lr: 14.0 s after RankscopeLossDiverging" in _texts(figure)
    _not_blank(figure)
