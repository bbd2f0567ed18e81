"""The report's figures are readable: no text runs over another (labels, titles, ticks, legends), no
title is cut off at the figure's edge, and the summary's loss and learning-rate panels carry their times.

Each figure is drawn as the report draws it, from an incident like `make demo`'s (five NaN steps, the
alert's reduce_lr, an operator's refused reduce_lr, a pause and a resume 6 s apart, checkpoints), and
every visible text's bounding box is taken from the rendered canvas.
"""

from __future__ import annotations

import itertools

import numpy as np
from matplotlib.figure import Figure
from matplotlib.text import Text
from rankscope.report import plots
from rankscope.report.analysis import straggler
from rankscope.report.incidents import ActionEvent, AlertEpisode, Incidents
from rankscope.report.series import Series

from tests.report_series import compute_per_rank

T0 = 1_800_000_000.0
TIMES = T0 + np.arange(0.0, 480.0, 2.0)
AXIS = plots.TimeAxis(T0, float(TIMES[-1]))


def demo_incidents() -> Incidents:
    nonfinite = AlertEpisode("RankscopeNonFiniteSteps", {"alertname": "RankscopeNonFiniteSteps", "severity": "page",
                             "action": "reduce_lr"}, pending_at=None, firing_at=T0 + 303, ended_at=T0 + 330,
                             active=False)  # fmt: skip
    applied = ActionEvent("reduce_lr", "alert", "applied", T0 + 305.2, step=310, cause=nonfinite,
                          first_sign=T0 + 300.0, first_sign_step=300)  # fmt: skip
    refused = ActionEvent("reduce_lr", "operator", "refused_cooldown", T0 + 352.0, step=369, reason="operator:x")
    pause = ActionEvent("pause", "operator", "applied", T0 + 366.0, step=382)
    resume = ActionEvent("resume", "operator", "applied", T0 + 372.0, step=382)
    checkpoint = ActionEvent("checkpoint", "operator", "applied", T0 + 374.0, step=383)
    nan_steps = [(T0 + 300.0 + 0.2 * i, 300 + i) for i in range(5)]
    checkpoints = [(T0 + 100, "interval"), (T0 + 374, "operator:x")]
    actions = [applied, refused, pause, resume, checkpoint]
    return Incidents([nonfinite], actions, checkpoints, [(T0 + 366.0, T0 + 372.0)], nan_steps)


def training_inputs() -> plots.TrainingInputs:
    step_times = T0 + np.arange(0.0, 480.0, 0.5)
    loss = 2.0 * np.exp(-(step_times - T0) / 200) + 0.3
    lr = np.where(step_times < T0 + 305.2, 1e-3, 5e-4)
    return plots.TrainingInputs(
        train_loss=Series({"split": "train"}, TIMES, 2.0 * np.exp(-(TIMES - T0) / 200) + 0.3),
        per_step_loss=Series({}, step_times, loss),
        learning_rate=[Series({"param_group": "0"}, TIMES, np.where(TIMES < T0 + 305.2, 1e-3, 5e-4))],
        per_step_lr=Series({}, step_times, lr),
    )


def texts(figure: Figure) -> list[Text]:
    """Every text drawn: tick labels only of the ticks inside the view (matplotlib keeps the others, undrawn)."""
    figure.canvas.draw()
    ticks, drawn = set(), []
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update({id(tick.label1), id(tick.label2)})
            if not (axes.get_visible() and axis.get_visible()):  # a twin's shared x axis is not drawn
                continue
            for tick in axis._update_ticks():  # type: ignore[attr-defined]  # the ticks it draws
                drawn += [label for label in (tick.label1, tick.label2) if label.get_visible()]
    found = figure.findobj(lambda a: isinstance(a, Text) and a.get_visible() and id(a) not in ticks)
    return [t for t in [*found, *drawn] if t.get_text().strip() and t.get_window_extent().width > 0]  # type: ignore[union-attr]


def assert_no_overlaps(figure: Figure) -> None:
    drawn = texts(figure)
    page = figure.bbox
    for text in drawn:
        box = text.get_window_extent()
        assert box.x0 >= page.x0 - 1 and box.x1 <= page.x1 + 1, f"{text.get_text()!r} is cut off at the edge"
    clashes = []
    for a, b in itertools.combinations(drawn, 2):
        box_a, box_b = a.get_window_extent(), b.get_window_extent()
        if box_a.overlaps(box_b) and box_a.intersection(box_a, box_b) is not None:
            inter = box_a.intersection(box_a, box_b)
            if inter.width > 1 and inter.height > 1:  # touching by a pixel is not running over
                clashes.append(f"{a.get_text()!r} / {b.get_text()!r}")
    assert not clashes, "texts run over each other: " + "; ".join(clashes)


def test_the_summary_has_no_overlapping_labels_and_times_on_its_loss_and_lr_panels() -> None:
    compute = compute_per_rank(TIMES, 4, slow=3, from_index=100)
    figure = plots.summary_figure("rankscope run demo: 2026-12-03 03:00:00 UTC, 8 min 00 s", training_inputs(),
                                  compute, demo_incidents(), AXIS, straggler(compute), 1.0)  # fmt: skip
    assert_no_overlaps(figure)
    loss, lr = figure.axes[0], figure.axes[1]
    for axis in (loss, lr):
        shown = [t.get_text() for t in axis.get_xticklabels() if t.get_visible() and t.get_text()]
        assert len(shown) >= 3, f"{axis.get_title(loc='left')!r} has no time labels"
    every = " ".join(t.get_text() for t in texts(figure))
    assert "after the first non-finite step" in every and "reduce_lr (refused_cooldown)" in every


def test_the_training_figures_pause_and_resume_marks_do_not_run_over_each_other() -> None:
    incidents = demo_incidents()
    figure = plots.training_figure(training_inputs(), AXIS, plots.marks_from(incidents, 1.0))
    assert_no_overlaps(figure)


def test_the_non_finite_steps_are_marked_on_the_loss_plot() -> None:
    figure = plots.training_figure(training_inputs(), AXIS, plots.marks_from(demo_incidents(), 1.0))
    loss = figure.axes[0]
    crosses = [line for line in loss.get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and len(crosses[0].get_xdata()) == 5
    assert "non-finite loss (5 steps)" in [t.get_text() for t in loss.get_legend().get_texts()]


def test_the_ranks_titles_fit_their_panels() -> None:
    compute = compute_per_rank(TIMES, 4, slow=3, from_index=100)
    timings = {"step": compute, "compute": compute, "comm": compute, "data wait": compute}
    for found in (straggler(compute), straggler(compute_per_rank(TIMES, 4))):
        figure = plots.rank_timings_figure(timings, AXIS, found, plots.marks_from(demo_incidents(), 1.0))
        assert_no_overlaps(figure)
        for axis in figure.axes:
            title = axis.title if axis.title.get_text() else axis._left_title  # type: ignore[attr-defined]
            assert title.get_window_extent().x1 <= axis.get_position().x1 * figure.bbox.width + 30, title.get_text()


def test_the_resources_figure_with_the_hosts_load_has_no_overlapping_labels() -> None:
    load = [Series({"node": "n0"}, TIMES, np.where(TIMES > T0 + 150, 2.5, 0.4))]
    steps = compute_per_rank(TIMES, 2)
    memory = [Series({"rank": str(r), "node": "n0"}, TIMES, np.full(len(TIMES), 1.1e9)) for r in range(2)]
    inputs = plots.ResourceInputs(host_memory=[Series({"node": "n0"}, TIMES, np.full(len(TIMES), 0.4))],
                                  process_memory=memory, host_load=load, step_time=steps,
                                  samples_rate=Series({}, TIMES, np.full(len(TIMES), 90.0)))  # fmt: skip
    assert_no_overlaps(plots.resources_figure(inputs, AXIS, plots.marks_from(demo_incidents(), 1.0)))


def close_actions() -> Incidents:
    """What a user trying rankscope-ctl does: six actions within 10 s, a refused restart among them."""
    demo = demo_incidents()
    tried = [
        ("checkpoint", "applied", 400.0),
        ("restart", "refused_unavailable", 401.5),
        ("reduce_lr", "applied", 403.0),
        ("rollback", "applied", 405.0),
        ("reduce_lr", "refused_cooldown", 407.0),
        ("rollback", "applied", 409.5),
    ]
    actions = [ActionEvent(name, "operator", result, T0 + at, step=int(at)) for name, result, at in tried]
    return Incidents(demo.episodes, demo.actions + actions, demo.checkpoints, demo.paused, demo.nonfinite)


def test_the_incident_timeline_keeps_the_labels_of_several_close_actions_apart() -> None:
    figure = plots.incidents_figure(close_actions(), AXIS, 1.0)
    assert_no_overlaps(figure)
    shown = [t.get_text() for t in texts(figure)]
    for label in ("restart (refused_unavailable)", "checkpoint", "rollback", "reduce_lr (refused_cooldown)"):
        assert label in shown, f"{label!r} is not on the timeline"


def test_the_summary_and_training_figures_keep_several_close_actions_apart() -> None:
    incidents = close_actions()
    compute = compute_per_rank(TIMES, 2)
    assert_no_overlaps(
        plots.summary_figure("run", training_inputs(), compute, incidents, AXIS, straggler(compute), 1.0)
    )
    assert_no_overlaps(plots.training_figure(training_inputs(), AXIS, plots.marks_from(incidents, 1.0)))


def _lines_under(axis, box) -> list[str]:
    """Labels of the lines with a drawn point inside `box` (display coordinates)."""
    hit = []
    for line in axis.get_lines():
        if line.get_linestyle() in ("--", "None", " ", "") or not line.get_visible():
            continue  # the action lines themselves, and marker-only series
        points = axis.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
        points = points[np.isfinite(points).all(axis=1)]
        inside = (points[:, 0] > box.x0) & (points[:, 0] < box.x1) & (points[:, 1] > box.y0) & (points[:, 1] < box.y1)
        if inside.any():
            hit.append(str(line.get_label()))
    return hit


def test_action_labels_do_not_sit_on_the_loss_or_learning_rate_curves() -> None:
    incidents = close_actions()
    compute = compute_per_rank(TIMES, 2)
    summary = plots.summary_figure("run", training_inputs(), compute, incidents, AXIS, straggler(compute), 1.0)
    training = plots.training_figure(training_inputs(), AXIS, plots.marks_from(incidents, 1.0))
    for figure in (summary, training):
        figure.canvas.draw()
        # The summary's learning-rate panel names its lines in the legend; the timeline under it names them too.
        for axis in figure.axes[:1] if figure is summary else (figure.axes[0], figure.axes[2]):
            labels = [t for t in axis.texts if t.get_rotation() == 90 and t.get_text()]
            assert labels, f"{axis.get_title(loc='left')!r} names no action"
            for label in labels:
                under = _lines_under(axis, label.get_window_extent())
                assert not under, f"{label.get_text()!r} sits on {under} in {axis.get_title(loc='left')!r}"
