"""PNG plots of continual-learning results (the paper's figures, "Applications and Experiments").

Figures are drawn on ``matplotlib.figure.Figure`` objects rendered by the Agg canvas, so importing this
module never changes the global pyplot backend. Every function validates its input (``ValueError`` on
malformed data), writes a PNG to ``path`` (creating parent folders) and returns the path.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator
from numpy.typing import ArrayLike

from .rundir import make_directory, write_atomically

Curve = tuple[ArrayLike, ArrayLike]


def _save(figure: Figure, path: str | os.PathLike[str], tight_layout: bool = True) -> Path:
    """Render the PNG in memory, then write it whole (a killed run or a full disk never leaves half a file)."""
    output_path = Path(path)
    make_directory(output_path.parent)
    if tight_layout:
        figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120, bbox_inches="tight")
    write_atomically(png.getvalue(), output_path)
    return output_path


def _validated_curve(label: str, curve: Curve) -> tuple[np.ndarray, np.ndarray]:
    x, y = (np.asarray(values, dtype=float) for values in curve)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(
            f"curve {label!r}: x and y must be non-empty 1-D arrays of equal length, "
            f"got {x.shape} and {y.shape}"
        )
    return x, y


def curve_styles(count: int) -> list[dict[str, object]]:
    """``count`` distinguishable line styles: the ten tab10 colours, then the same colours dashed with square
    markers, then dotted with triangles, and so on (pale tab20 shades are hard to tell apart)."""
    colors = matplotlib.colormaps["tab10"].colors
    line_markers = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    styles = []
    for index in range(count):
        linestyle, marker = line_markers[index // len(colors) % len(line_markers)]
        styles.append({"color": colors[index % len(colors)], "linestyle": linestyle, "marker": marker})
    return styles


def _plot_curves(
    curves: Mapping[str, Curve], path: str | os.PathLike[str], title: str, xlabel: str, ylabel: str
) -> Path:
    if not curves:
        raise ValueError("curves must hold at least one labelled (x, y) curve")
    validated = {label: _validated_curve(label, curve) for label, curve in curves.items()}
    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.add_subplot()
    lines = [axes.plot(x, y, markersize=3, label=label, **style)[0]
             for (label, (x, y)), style in zip(validated.items(), curve_styles(len(validated)), strict=True)]
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # tasks: 1, 2, 3 (not 1.2, 1.4, ...)
    axes.grid(alpha=0.3)
    many = len(validated) > 4
    # handles and labels given: legend() alone leaves out labels starting with "_" (a run directory "_old")
    if many:  # the legend right of the axes, which keep their size (the saved image widens instead)
        axes.legend(lines, list(validated), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    else:
        axes.legend(lines, list(validated))
    return _save(figure, path, tight_layout=not many)


def plot_average_accuracy(
    curves: Mapping[str, Curve],
    path: str | os.PathLike[str],
    title: str = "Average test accuracy on all seen tasks",
    xlabel: str = "Number of tasks",
    ylabel: str = "Average accuracy",
) -> Path:
    """One line per learner: average accuracy over seen tasks vs. training progress (paper Fig. 1 and 5)."""
    return _plot_curves(curves, path, title, xlabel, ylabel)


def plot_first_task_accuracy(
    curves: Mapping[str, Curve],
    path: str | os.PathLike[str],
    title: str = "Test accuracy on the first task",
    xlabel: str = "Number of tasks",
    ylabel: str = "First-task accuracy",
) -> Path:
    """One line per learner: accuracy on task 1 vs. number of tasks seen (paper Fig. 2)."""
    return _plot_curves(curves, path, title, xlabel, ylabel)


def plot_std_histograms(
    stds_per_task: Sequence[ArrayLike],
    path: str | os.PathLike[str],
    initial_std: float | None = None,
    log_x: bool = True,
    num_bins: int = 60,
    title: str = "Posterior STD histogram at the end of each task",
    labels: Sequence[str] | None = None,
) -> Path:
    """Overlaid histograms of the posterior STD values at the end of each task (paper Fig. 3).

    Args:
        stds_per_task: one array of STD values (any shape, flattened) per task (or per evaluation).
        labels: one legend label per array; default "after task 1", "after task 2", ...
        initial_std: if given, drawn as a dashed vertical line (the prior STD, e.g. 0.047).
        log_x: logarithmic STD axis with log-spaced bins (all values must then be positive).
    """
    if len(stds_per_task) == 0:
        raise ValueError("stds_per_task must hold at least one array of STD values")
    stds = [np.asarray(values, dtype=float).ravel() for values in stds_per_task]
    for task_index, values in enumerate(stds):
        if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"task {task_index + 1}: STD values must be non-empty, finite and >= 0")
        if log_x and np.any(values == 0):
            raise ValueError(f"task {task_index + 1}: STD values must be > 0 for a logarithmic axis")
    if labels is None:
        labels = [f"after task {index + 1}" for index in range(len(stds))]
    if len(labels) != len(stds):
        raise ValueError(f"{len(labels)} labels for {len(stds)} STD arrays")
    if initial_std is not None and not (np.isfinite(initial_std) and initial_std > 0):
        raise ValueError(f"initial_std must be a positive finite number, got {initial_std}")
    lowest = min(values.min() for values in stds)
    highest = max(values.max() for values in stds)
    if highest == lowest:  # a single distinct value: widen the range so that the bins have a width
        lowest, highest = (lowest * 0.9, highest * 1.1) if highest > 0 else (0.0, 1.0)
    spacing = np.geomspace if log_x else np.linspace
    bins = spacing(lowest, highest, num_bins + 1)

    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.add_subplot()
    for label, values in zip(labels, stds, strict=True):
        axes.hist(values, bins=bins, histtype="stepfilled", alpha=0.35, label=label)
    if initial_std is not None:
        axes.axvline(initial_std, color="black", linestyle="--", label=f"initial STD {initial_std:g}")
    if log_x:
        axes.set_xscale("log")
        if highest / lowest >= 10:  # ticks at 1, 2 and 5 per decade, as plain numbers (the default overlaps)
            plain = FuncFormatter(lambda value, _: f"{value:g}")
            axes.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            axes.xaxis.set_major_formatter(plain)
            axes.xaxis.set_minor_formatter(plain)
    axes.set_title(title)
    axes.set_xlabel("STD value")
    axes.set_ylabel("Number of weights")
    axes.legend(fontsize="small")
    return _save(figure, path)


def plot_task_schedule(
    iterations: ArrayLike,
    probabilities: ArrayLike,
    path: str | os.PathLike[str],
    title: str = "Task distribution over iterations",
) -> Path:
    """Probability of drawing a sample from each task vs. iteration, continuous scenario (paper Fig. 4).

    Args:
        iterations: ``(N,)`` iteration numbers.
        probabilities: ``(N, T)`` probability of each of the ``T`` tasks at each iteration, in ``[0, 1]``.
    """
    steps = np.asarray(iterations, dtype=float)
    task_probabilities = np.asarray(probabilities, dtype=float)
    if steps.ndim != 1 or steps.size == 0:
        raise ValueError(f"iterations must be a non-empty 1-D array, got shape {steps.shape}")
    if task_probabilities.ndim != 2 or task_probabilities.shape[0] != steps.size:
        raise ValueError(f"probabilities must have shape ({steps.size}, T), got {task_probabilities.shape}")
    if not np.all((task_probabilities >= 0) & (task_probabilities <= 1)):
        raise ValueError("probabilities must lie in [0, 1]")

    figure = Figure(figsize=(7.2, 3.6))
    axes = figure.add_subplot()
    for task_index in range(task_probabilities.shape[1]):
        axes.plot(steps, task_probabilities[:, task_index], label=f"task {task_index + 1}")
    axes.set_title(title)
    axes.set_xlabel("Iteration")
    axes.set_ylabel("Probability of task")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(figure, path)


def plot_accuracy_matrix(
    accuracy_matrix: ArrayLike,
    path: str | os.PathLike[str],
    title: str = "Accuracy matrix",
    max_annotated_cells: int = 400,
) -> Path:
    """Heatmap of ``R[i, j]``: accuracy on task ``j`` at evaluation ``i``.

    ``R`` may be the square matrix of the metrics (rows = training stages) or have one row per evaluation
    point (``(E, T)``, e.g. every evaluation of a continuous run). NaN entries (task not evaluated / not yet
    seen) are left blank. Values are written in the cells when there are at most ``max_annotated_cells``.
    """
    matrix = np.asarray(accuracy_matrix, dtype=float)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(f"accuracy matrix must be a non-empty 2-D array, got shape {matrix.shape}")
    if np.any(np.isinf(matrix)) or np.all(np.isnan(matrix)):
        raise ValueError("accuracy matrix must hold finite values (NaN only where a task was not evaluated)")
    num_rows, num_tasks = matrix.shape
    figure = Figure(figsize=(2.5 + 0.6 * min(num_tasks, 15), 1.0 + 0.6 * min(num_rows, 12)))
    axes = figure.add_subplot()
    image = axes.imshow(np.ma.masked_invalid(matrix), cmap="viridis", aspect="auto", interpolation="nearest")
    figure.colorbar(image, ax=axes, label="Accuracy")
    if matrix.size <= max_annotated_cells:
        for row, task in zip(*np.nonzero(np.isfinite(matrix)), strict=True):
            value = matrix[row, task]
            text_color = "black" if image.norm(value) > 0.6 else "white"  # readable on the viridis colours
            axes.text(task, row, f"{value:.2f}", ha="center", va="center", color=text_color, fontsize=7)
    for axis, count in ((axes.yaxis, num_rows), (axes.xaxis, num_tasks)):  # 1-based labels, every tick or some
        if count <= 30:
            axis.set_ticks(range(count), [str(index + 1) for index in range(count)])
        else:
            axis.set_major_locator(MaxNLocator(integer=True))
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value + 1:g}"))
    axes.set_title(title)
    axes.set_xlabel("Evaluated task j")
    axes.set_ylabel("Training stage / evaluation i")
    return _save(figure, path)
