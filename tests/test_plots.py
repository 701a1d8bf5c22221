import numpy as np
import pytest

import foovb_suite.plots as plots_module
from foovb_suite.plots import (
    curve_styles,
    plot_accuracy_matrix,
    plot_average_accuracy,
    plot_first_task_accuracy,
    plot_std_histograms,
    plot_task_schedule,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CURVES = {
    "FOO-VB": (np.arange(1, 11), np.linspace(0.98, 0.95, 10)),
    "SGD": (np.arange(1, 11), np.linspace(0.98, 0.70, 10)),
}


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1024


def test_curve_plots_write_png(tmp_path):
    assert_png(plot_average_accuracy(CURVES, tmp_path / "average.png"))
    assert_png(plot_first_task_accuracy(CURVES, tmp_path / "nested" / "first.png"))


def test_a_plot_that_cannot_be_written_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """savefig wrote straight into the file: a full disk or a kill left half a PNG."""
    path = tmp_path / "average.png"
    plot_average_accuracy(CURVES, path)
    before = path.read_bytes()

    def full_disk(data, target):
        raise OSError(28, f"no space left to write {target}")

    monkeypatch.setattr(plots_module, "write_atomically", full_disk)
    with pytest.raises(OSError, match="no space left"):
        plot_average_accuracy({"other": CURVES["SGD"]}, path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("count", [1, 10, 11, 40])
def test_curve_styles_are_distinct(count):
    styles = curve_styles(count)
    assert len(styles) == count
    # no two curves share a colour and a dash pattern (tab10 colours, then the next dash pattern)
    assert len({(style["color"], style["linestyle"]) for style in styles}) == count


@pytest.mark.parametrize(
    "bad_curves",
    [
        {},
        {"SGD": (np.arange(3), np.arange(4))},
        {"SGD": ([], [])},
        {"SGD": (np.ones((2, 2)), np.ones((2, 2)))},
    ],
)
def test_curve_plots_reject_bad_curves(tmp_path, bad_curves):
    for plot in (plot_average_accuracy, plot_first_task_accuracy):
        with pytest.raises(ValueError):
            plot(bad_curves, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_std_histograms_write_png(tmp_path):
    rng = np.random.default_rng(0)
    stds = [0.047 * np.exp(-rng.exponential(task + 1, size=500)) for task in range(3)]
    assert_png(plot_std_histograms(stds, tmp_path / "std_log.png", initial_std=0.047))
    assert_png(plot_std_histograms([np.full(10, 0.047)], tmp_path / "std_linear.png", log_x=False))


@pytest.mark.parametrize(
    ("stds", "options"),
    [
        ([], {}),
        ([np.array([])], {}),
        ([np.array([0.01, 0.0])], {}),  # zero on a log axis
        ([np.array([0.01, np.nan])], {"log_x": False}),
        ([np.array([0.01, -0.1])], {"log_x": False}),
        ([np.array([0.01])], {"initial_std": -1.0}),
    ],
)
def test_std_histograms_reject_bad_input(tmp_path, stds, options):
    with pytest.raises(ValueError):
        plot_std_histograms(stds, tmp_path / "bad.png", **options)


def test_task_schedule_writes_png(tmp_path):
    iterations = np.arange(0, 1000, 10)
    centers = np.array([250, 750])
    weights = np.exp(-(((iterations[:, None] - centers) / 150.0) ** 2))
    probabilities = weights / weights.sum(axis=1, keepdims=True)
    assert_png(plot_task_schedule(iterations, probabilities, tmp_path / "schedule.png"))


def test_task_schedule_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        plot_task_schedule(np.arange(5), np.full((4, 2), 0.5), tmp_path / "bad.png")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plot_task_schedule(np.arange(2), np.array([[1.5, -0.5], [0.5, 0.5]]), tmp_path / "bad.png")
    with pytest.raises(ValueError, match="iterations"):
        plot_task_schedule(np.array([]), np.zeros((0, 2)), tmp_path / "bad.png")


def test_accuracy_matrix_writes_png(tmp_path):
    nan = float("nan")
    square = np.array([[0.9, nan, nan], [0.8, 0.95, nan], [0.7, 0.85, 0.97]])
    assert_png(plot_accuracy_matrix(square, tmp_path / "square.png"))
    per_evaluation = np.random.default_rng(0).uniform(0.1, 1.0, size=(200, 10))  # too many cells to annotate
    assert_png(plot_accuracy_matrix(per_evaluation, tmp_path / "per_evaluation.png"))


@pytest.mark.parametrize(
    "bad_matrix",
    [np.zeros(3), np.zeros((0, 2)), np.array([[0.5, np.inf]]), np.full((2, 2), np.nan)],
)
def test_accuracy_matrix_rejects_bad_input(tmp_path, bad_matrix):
    with pytest.raises(ValueError, match="accuracy matrix"):
        plot_accuracy_matrix(bad_matrix, tmp_path / "bad.png")


@pytest.fixture
def drawn_figures(monkeypatch):
    """The figures the plot functions save (nothing written)."""
    figures = []
    monkeypatch.setattr(plots_module, "_save", lambda figure, path, tight_layout=True: figures.append(figure))
    return figures


@pytest.mark.parametrize("shape", [(5, 5), (50, 10), (5, 40)])
def test_accuracy_matrix_ticks_are_one_based_at_any_size(drawn_figures, shape):
    plot_accuracy_matrix(np.full(shape, 0.9), "unused.png")
    axes = drawn_figures[0].axes[0]
    for axis in (axes.yaxis, axes.xaxis):
        formatter = axis.get_major_formatter()
        labels = [formatter(tick, index) for index, tick in enumerate(axis.get_ticklocs()) if tick >= 0]
        assert labels[0] == "1", labels  # cell 0 is task / evaluation 1


def test_std_histograms_use_the_given_labels(drawn_figures, tmp_path):
    stds = [np.full(10, 0.04), np.full(10, 0.03)]
    plot_std_histograms(stds, "unused.png", labels=["100 iterations (0.50 tasks)", "200 iterations (1.00 tasks)"])
    legend = [text.get_text() for text in drawn_figures[0].axes[0].get_legend().get_texts()]
    assert legend == ["100 iterations (0.50 tasks)", "200 iterations (1.00 tasks)"]
    plot_std_histograms(stds, "unused.png")
    assert [t.get_text() for t in drawn_figures[1].axes[0].get_legend().get_texts()] == ["after task 1", "after task 2"]
    with pytest.raises(ValueError, match="1 labels for 2"):
        plot_std_histograms(stds, tmp_path / "bad.png", labels=["one"])



@pytest.mark.parametrize("count", [2, 6])  # the legend inside the axes, and right of them
def test_every_curve_is_in_the_legend_whatever_its_label(drawn_figures, count):
    """matplotlib's legend() leaves out labels starting with "_": a run directory "_old" lost its entry."""
    labels = ["_old (mean)"] + [f"run{i} (mean)" for i in range(1, count)]
    plot_average_accuracy({label: CURVES["SGD"] for label in labels}, "unused.png")
    legend = [text.get_text() for text in drawn_figures[0].axes[0].get_legend().get_texts()]
    assert legend == labels
