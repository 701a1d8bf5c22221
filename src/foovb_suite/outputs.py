"""A run's plain-file outputs (the layout: `foovb_suite.runner`), each file written whole (`rundir.write_atomically`):
the evaluations so far during a run (`write_metrics`), all outputs and plots of a finished one (`write_outputs`)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

import numpy as np

from foovb.priors import XAVIER

from . import plots
from .config import Config
from .evaluation import tasks_seen
from .learners import learner_hyperparameters
from .rundir import write_atomically

__all__ = ["file_digest", "write_metrics", "write_outputs", "write_text"]


def write_text(path: Path, text: str) -> None:
    write_atomically(text.encode(), path)


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    """metrics.jsonl and metrics.csv of the evaluations so far (after each one during a run, each file replaced
    whole: a reader never sees half of one)."""
    write_text(run_dir / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in records))
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["iteration", "stage", "task", "mode", "accuracy", "nll", "ece"])
    for r in records:
        for mode, values in r["accuracy"].items():
            for task, value in enumerate(values):
                writer.writerow([r["iteration"], r["stage"], task, mode, value,
                                 r["nll"].get(mode, [None] * len(values))[task],
                                 r["ece"].get(mode, [None] * len(values))[task]])
    write_text(run_dir / "metrics.csv", table.getvalue())


def write_outputs(run_dir: Path, records: list[dict], summary: dict, stds: dict[str, np.ndarray], scenario,
                  config: Config) -> None:
    """All plain-file outputs and plots of a finished run, each written whole; summary.json, which marks the run
    finished, last (a run killed before it is resumed with --resume, which writes them again), with the SHA-256 of
    every file written, by which --resume tells outputs deleted or changed since."""
    written = ["metrics.jsonl", "metrics.csv"]

    def output(name: str) -> Path:  # the path of an output, recorded for summary.json's digests
        written.append(name)
        return run_dir / name

    write_metrics(run_dir, records)
    for mode in records[-1]["accuracy"]:
        matrix, table = np.array([r["accuracy"][mode] for r in records]), io.StringIO()
        np.savetxt(table, matrix, delimiter=",", fmt="%.6f",
                   header=",".join(f"task_{t}" for t in range(matrix.shape[1])))
        write_text(output(f"accuracy_matrix_{mode}.csv"), table.getvalue())
    if stds:
        archive = io.BytesIO()
        np.savez_compressed(archive, **stds)
        write_atomically(archive.getvalue(), output("stds.npz"))
    stages = tasks_seen(records, config)
    for mode, entry in summary["modes"].items():
        label = f"{summary['learner']} ({mode})"
        plots.plot_average_accuracy({label: (stages, entry["average_accuracy_curve"])},
                                    output(f"plots/average_accuracy_{mode}.png"))
        first = [r["accuracy"][mode][0] for r in records]
        plots.plot_first_task_accuracy({label: (stages, first)}, output(f"plots/first_task_accuracy_{mode}.png"))
        plots.plot_accuracy_matrix(np.array([r["accuracy"][mode] for r in records]),
                                   output(f"plots/accuracy_matrix_{mode}.png"))
    if stds:
        params = learner_hyperparameters(config.learner.kind, config.learner.params)  # the preset's values filled in
        one_initial_std = (config.learner.kind == "foovb" and params["posterior"] == "diagonal"
                           and params["init"] != "alpha" and params["std_init"] != XAVIER)  # else one per layer
        position = dict(zip((r["iteration"] for r in records), stages, strict=True))
        at = [position[int(key.removeprefix("iteration_"))] for key in stds]  # evaluations, in tasks seen
        if all(float(x).is_integer() for x in at):
            labels, title = [f"after task {x:g}" for x in at], "Posterior STD histogram at the end of each task"
        else:  # the continuous scenario with eval_every also evaluates inside task periods
            labels = [f"{key.removeprefix('iteration_')} iterations ({x:.2f} tasks)"
                      for key, x in zip(stds, at, strict=True)]
            title = "Posterior STD histogram at each evaluation"
        plots.plot_std_histograms(list(stds.values()), output("plots/std_histograms.png"),
                                  initial_std=params["std_init"] if one_initial_std else None,
                                  labels=labels, title=title)
    if hasattr(scenario, "task_probabilities"):
        iterations = np.linspace(0, scenario.num_iterations - 1, 1000).astype(int)
        plots.plot_task_schedule(iterations, scenario.task_probabilities(iterations).numpy(),
                                 output("plots/task_schedule.png"))
    summary["outputs"] = {name: file_digest(run_dir / name) for name in written}  # --resume rebuilds what changed
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2))


def file_digest(path: Path) -> str | None:
    """SHA-256 of a file's bytes, None where it cannot be read (missing, a directory)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
