"""The report's axes tell noise from drama: a minimum y span, no scatter over a constant sequence length,
no CUDA version for a CPU run, tokens/s not drawn over samples/s, a colour scale for every attention map."""

from __future__ import annotations

import numpy as np
from rankscope.report import plots, sections
from rankscope.report.analysis import straggler
from rankscope.report.attention import AttentionSnapshot
from rankscope.report.collect import RunData
from rankscope.report.incidents import Incidents
from rankscope.report.run import RunWindow
from rankscope.report.series import Series

T0 = 1_800_000_000.0
TIMES = T0 + np.arange(0.0, 300.0, 5.0)
AXIS = plots.TimeAxis(T0, float(TIMES[-1]))
GIB = 1024.0**3


def _rank(rank: int, values: np.ndarray, **labels: str) -> Series:
    return Series({"rank": str(rank), "node": "n0", **labels}, TIMES, values)


def test_resident_memory_wobbling_by_half_a_percent_is_drawn_on_a_range_that_shows_it_flat() -> None:
    rng = np.random.default_rng(0)
    rss = [_rank(r, GIB * (1.021 + 0.006 * rng.random(len(TIMES)))) for r in range(2)]  # 1.021-1.027 GiB
    figure = plots.resources_figure(plots.ResourceInputs(process_memory=rss), AXIS)
    process = figure.axes[1]
    low, high = process.get_ylim()
    assert high - low >= 0.19 * 1.027 * GIB, (low / GIB, high / GIB)


def test_memory_against_a_nearly_constant_sequence_length_says_so_instead_of_a_cloud() -> None:
    rng = np.random.default_rng(1)
    pairs = {0: (9.33 + 0.19 * rng.random(60), GIB * (1.0 + 0.01 * rng.random(60)))}
    figure = plots.memory_vs_length_figure(pairs, "mean caption length per step (tokens)", "process RSS")
    (axis,) = figure.axes
    assert not axis.collections, "a scatter over a constant length"
    words = " ".join(t.get_text() for t in axis.texts)
    assert "hardly varied" in words and "9.3" in words


def test_tokens_per_second_proportional_to_samples_per_second_is_one_line_and_a_note() -> None:
    samples = Series({}, TIMES, 100.0 + np.sin(TIMES / 30))
    tokens = Series({}, TIMES, samples.v * 12.0)
    figure = plots.resources_figure(plots.ResourceInputs(samples_rate=samples, tokens_rate=tokens), AXIS)
    speed = figure.axes[3]
    assert not [a for a in figure.axes if a.get_ylabel() == "tokens per second"], "tokens/s drawn over samples/s"
    assert any("tokens/s = 12 x samples/s" in t.get_text() for t in speed.get_legend().get_texts())


def test_every_attention_map_has_a_colour_scale() -> None:
    rng = np.random.default_rng(2)
    n, tokens = 2, 5
    snapshot = AttentionSnapshot(
        step=20, time=T0, images=rng.random((n, 16, 16, 3)), captions=["a red square", "a blue circle"],
        tokens=np.array([["a", "red", "square", "", ""], ["a", "blue", "circle", "", ""]]),
        text_attention=rng.random((n, tokens, tokens)).astype(np.float32),
        image_attention=rng.random((n, 3, 3)).astype(np.float32),
    )  # fmt: skip
    figure = plots.attention_figure(snapshot)
    bars = [a for a in figure.axes if a.get_label() == "<colorbar>"]
    assert len(bars) == 2, "one colour bar for the image attention row and one for the text attention row"
    images = [im for a in figure.axes for im in a.get_images() if im.get_cmap().name == "inferno"]
    assert len({im.get_clim() for im in images}) == 1, "one scale for every sample, as the one bar says"


def _run_data(**series: list[Series]) -> RunData:
    run = RunWindow("r", T0, float(TIMES[-1]), 5.0, 1, 100, False)
    info = {"world_size": "1", "backend": "gloo", "torch_version": "2.14.1", "cuda_version": "13.0"}
    return RunData(run, T0, float(TIMES[-1]), float(TIMES[-1]), dict(series), {}, info, 1)


def test_a_cpu_run_has_no_cuda_version_row_and_a_gpu_run_has() -> None:
    quiet = Incidents([], [], [], [])
    cpu = dict(sections.facts(_run_data(), None, quiet, straggler([])))
    assert "cuda_version" not in cpu and cpu["torch_version"] == "2.14.1"
    device = [_rank(0, np.full(len(TIMES), GIB), kind="allocated")]
    gpu = dict(sections.facts(_run_data(device_memory=device), None, quiet, straggler([])))
    assert gpu["cuda_version"] == "13.0"


def test_the_hosts_cpu_load_is_drawn_beside_the_step_time_and_its_absence_is_explained() -> None:
    load = [Series({"node": "n0"}, TIMES, np.where(TIMES > T0 + 150, 2.5, 0.4))]  # another job starts at 2:30
    steps = [_rank(r, np.where(TIMES > T0 + 150, 0.3, 0.1)) for r in range(2)]
    figure = plots.resources_figure(plots.ResourceInputs(host_load=load, step_time=steps), AXIS)
    panel = next(a for a in figure.axes if a.get_title(loc="left").startswith("Host CPU load"))
    drawn = [line for line in panel.get_lines() if len(line.get_xdata()) == len(TIMES)]
    assert len(drawn) == 1 and float(np.max(drawn[0].get_ydata())) == 2.5
    assert any(a.get_ylabel() == "step time (dashed)" for a in figure.axes)
    legend = [t.get_text() for t in panel.get_legend().get_texts()]
    assert "load, node n0" in legend and "step time (median over ranks)" in legend

    without = plots.resources_figure(plots.ResourceInputs(), AXIS)
    words = " ".join(t.get_text() for a in without.axes for t in a.texts)
    assert "no rankscope_host_cpu_load_ratio series" in words


def test_no_section_is_empty_without_saying_why() -> None:
    from rankscope.report.html import Figure, Note, Paragraph, Section

    ctx = sections.Context(_run_data(), None, Incidents([], [], [], []), straggler([]))
    page = [sections.overview(ctx, b"png"), sections.training(ctx), sections.ranks(ctx), sections.resources(ctx),
            sections.incidents_section(ctx), sections.analyses(ctx), sections.attention([], [], None),
            sections.explain_empty(Section("goodput", "Goodput", []), "r")]  # fmt: skip
    for section in page:
        words = [b.text for b in section.blocks if isinstance(b, Note | Paragraph)]
        assert words or any(isinstance(b, Figure) for b in section.blocks), f"{section.id} is empty"
    incidents = page[4]
    notes = " ".join(b.text for b in incidents.blocks if isinstance(b, Note))
    assert "No alert was pending or firing" in notes and "No control action was settled" in notes
    assert "Nothing to show for run r" in page[-1].blocks[0].text  # type: ignore[union-attr]
