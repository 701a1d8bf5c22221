"""The plots draw what they say: axes, curves at their points with their labels, histogram bins, matrix cells
(read back from the matplotlib figures, not only checked for a written PNG)."""

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.lines import Line2D

import foovb_suite.plots as plots_module
from foovb_suite.plots import (
    plot_accuracy_matrix,
    plot_average_accuracy,
    plot_first_task_accuracy,
    plot_std_histograms,
    plot_task_schedule,
)


@pytest.fixture
def drawn_figures(monkeypatch):
    """The figures the plot functions save (nothing written)."""
    figures = []
    monkeypatch.setattr(plots_module, "_save", lambda figure, path, tight_layout=True: figures.append(figure))
    return figures


def _curves(count):
    return {f"learner {i}": (np.arange(1, 6) + 0.5 * i, np.linspace(0.9, 0.5 + 0.05 * i, 5)) for i in range(count)}


@pytest.mark.parametrize(("plot", "xlabel", "ylabel", "title"), [
    (plot_average_accuracy, "Number of tasks", "Average accuracy", "Average test accuracy on all seen tasks"),
    (plot_first_task_accuracy, "Number of tasks", "First-task accuracy", "Test accuracy on the first task"),
])
def test_curve_plot_axis_labels_and_title(drawn_figures, plot, xlabel, ylabel, title):
    plot(_curves(2), "unused.png")
    axes = drawn_figures[0].axes[0]
    assert (axes.get_xlabel(), axes.get_ylabel(), axes.get_title()) == (xlabel, ylabel, title)
    plot(_curves(2), "unused.png", title="T", xlabel="X", ylabel="Y")
    axes = drawn_figures[1].axes[0]
    assert (axes.get_xlabel(), axes.get_ylabel(), axes.get_title()) == ("X", "Y", "T")


@pytest.mark.parametrize("count", [1, 3, 6])  # 6: the legend outside the axes
def test_curve_plot_draws_every_curve_at_its_points_with_its_label(drawn_figures, count):
    curves = _curves(count)
    plot_average_accuracy(curves, "unused.png")
    axes = drawn_figures[0].axes[0]
    lines = axes.get_lines()
    assert [line.get_label() for line in lines] == list(curves)
    for line, (x, y) in zip(lines, curves.values(), strict=True):
        np.testing.assert_array_equal(line.get_xdata(), x)
        np.testing.assert_array_equal(line.get_ydata(), y)
    assert [t.get_text() for t in axes.get_legend().get_texts()] == list(curves)


@pytest.fixture
def hist_bins(monkeypatch):
    """The `bins` argument of every Axes.hist call."""
    recorded = []
    original = Axes.hist

    def recording(self, values, *args, **kwargs):
        recorded.append(np.asarray(kwargs["bins"]))
        return original(self, values, *args, **kwargs)

    monkeypatch.setattr(Axes, "hist", recording)
    return recorded


def test_std_histograms_log_axis_has_num_bins_log_spaced_bins(drawn_figures, hist_bins):
    stds = [np.geomspace(1e-4, 1e-1, 50), np.geomspace(1e-3, 5e-2, 20)]
    plot_std_histograms(stds, "unused.png", num_bins=25)
    axes = drawn_figures[0].axes[0]
    assert axes.get_xscale() == "log"
    assert len(hist_bins) == 2
    for bins in hist_bins:
        assert len(bins) == 26
        assert bins[0] == pytest.approx(1e-4) and bins[-1] == pytest.approx(1e-1)
        np.testing.assert_allclose(np.diff(np.log(bins)), np.log(1e3) / 25)  # equal widths on the log axis
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("STD value", "Number of weights")


def test_std_histograms_linear_axis_has_linear_bins(drawn_figures, hist_bins):
    plot_std_histograms([np.linspace(0.0, 0.1, 30)], "unused.png", log_x=False, num_bins=10)
    assert drawn_figures[0].axes[0].get_xscale() == "linear"
    np.testing.assert_allclose(hist_bins[0], np.linspace(0.0, 0.1, 11))


def test_std_histograms_draw_the_initial_std(drawn_figures):
    plot_std_histograms([np.full(10, 0.03), np.full(10, 0.02)], "unused.png", initial_std=0.047)
    axes = drawn_figures[0].axes[0]
    vertical = [line for line in axes.get_lines() if isinstance(line, Line2D)
                and np.all(np.asarray(line.get_xdata(), dtype=float) == 0.047)]
    assert len(vertical) == 1 and vertical[0].get_linestyle() == "--"
    assert [t.get_text() for t in axes.get_legend().get_texts()][-1] == "initial STD 0.047"


def test_task_schedule_draws_each_task_probability_with_its_label(drawn_figures):
    iterations = np.arange(0, 50, 10)
    probabilities = np.array([[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.2, 0.7, 0.1], [0.0, 0.5, 0.5], [0.0, 0.1, 0.9]])
    plot_task_schedule(iterations, probabilities, "unused.png")
    axes = drawn_figures[0].axes[0]
    lines = axes.get_lines()
    assert [line.get_label() for line in lines] == ["task 1", "task 2", "task 3"]
    for task, line in enumerate(lines):
        np.testing.assert_array_equal(line.get_xdata(), iterations)
        np.testing.assert_array_equal(line.get_ydata(), probabilities[:, task])
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("Iteration", "Probability of task")


def test_accuracy_matrix_cells_are_where_their_entries_are(drawn_figures):
    nan = float("nan")
    matrix = np.array([[0.91, nan, nan, nan], [0.82, 0.93, nan, nan], [0.71, 0.84, 0.95, 0.12]])  # 3 x 4
    plot_accuracy_matrix(matrix, "unused.png")
    axes = drawn_figures[0].axes[0]
    image = axes.get_images()[0].get_array()
    assert image.shape == matrix.shape
    np.testing.assert_array_equal(np.ma.getmaskarray(image), np.isnan(matrix))
    np.testing.assert_array_equal(image.filled(-1), np.where(np.isnan(matrix), -1, matrix))
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in axes.texts}
    rows, tasks = np.nonzero(~np.isnan(matrix))
    assert cells == {(row, task): f"{matrix[row, task]:.2f}" for row, task in zip(rows, tasks, strict=True)}
    assert (axes.get_xlabel(), axes.get_ylabel()) == ("Evaluated task j", "Training stage / evaluation i")
