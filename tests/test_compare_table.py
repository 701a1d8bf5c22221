"""`foovb compare`: the table's columns and the plotted curves hold each run's own values,
checked on hand-made finished runs whose every number is known."""

import csv
import json

import numpy as np
import pytest
import yaml

import foovb_suite.plots as plots
from foovb_suite.cli import main


def fake_run(path, learner, params, modes, first_task_per_stage, train_seconds=90.0, seconds_per_iteration=0.0125):
    """A finished discrete run of 3 tasks: config.yaml, summary.json, metrics.jsonl (one record per task end)."""
    path.mkdir(parents=True)
    config = {"name": path.name, "learner": {"kind": learner, "params": params},
              "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 3}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    summary = {"learner": learner, "scenario": "discrete_permuted_mnist", "num_tasks": 3, "iterations": 30,
               "train_seconds": train_seconds, "seconds_per_iteration": seconds_per_iteration, "modes": modes}
    (path / "summary.json").write_text(json.dumps(summary))
    records = [{"stage": stage, "iteration": 10 * (stage + 1),
                "accuracy": {mode: [first_task_per_stage[mode][stage], 0.5, 0.5][: stage + 1] for mode in modes}}
               for stage in range(3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def two_runs(tmp_path):
    foovb = fake_run(tmp_path / "foo", "foovb", {"posterior": "diagonal"},  # mc_samples at its default (10)
                     {"mean": {"average_accuracy": 0.81, "first_task_accuracy": 0.72, "forgetting": 0.05,
                               "average_accuracy_curve": [0.95, 0.88, 0.81]}},
                     {"mean": [0.95, 0.85, 0.72]})
    sgd = fake_run(tmp_path / "sgd", "sgd", {"lr": 0.1},
                   {"mean": {"average_accuracy": 0.61, "first_task_accuracy": 0.33, "forgetting": 0.4,
                             "average_accuracy_curve": [0.94, 0.75, 0.61]}},
                   {"mean": [0.94, 0.6, 0.33]}, train_seconds=30.0, seconds_per_iteration=0.002)
    return foovb, sgd


def test_compare_table_columns_hold_each_runs_values(two_runs, tmp_path):
    foovb, sgd = two_runs
    assert main(["compare", str(foovb), str(sgd), "--out", str(tmp_path / "cmp")]) == 0
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare.csv").read_text().splitlines()))
    assert [(r["run"], r["learner"], r["mode"]) for r in rows] == [("foo", "foovb", "mean"), ("sgd", "sgd", "mean")]
    foo_row, sgd_row = rows
    assert foo_row["mc_samples"] == "10" and sgd_row["mc_samples"] == "-"  # FOOVB's default K
    assert (foo_row["average_accuracy"], foo_row["first_task_accuracy"], foo_row["forgetting"]) == (
        "0.8100", "0.7200", "0.0500")
    assert (sgd_row["average_accuracy"], sgd_row["first_task_accuracy"], sgd_row["forgetting"]) == (
        "0.6100", "0.3300", "0.4000")
    assert (foo_row["train_minutes"], foo_row["ms_per_iteration"]) == ("1.5", "12.50")
    assert (sgd_row["train_minutes"], sgd_row["ms_per_iteration"]) == ("0.5", "2.00")
    assert (foo_row["tasks"], foo_row["iterations"], foo_row["scenario"]) == ("3", "30", "discrete_permuted_mnist")


def test_compare_plots_each_curve_against_the_tasks_seen(two_runs, tmp_path, monkeypatch):
    foovb, sgd = two_runs
    drawn = {}
    monkeypatch.setattr(plots, "plot_average_accuracy", lambda curves, path: drawn.update(average=curves))
    monkeypatch.setattr(plots, "plot_first_task_accuracy", lambda curves, path: drawn.update(first=curves))
    assert main(["compare", str(foovb), str(sgd), "--out", str(tmp_path / "cmp")]) == 0
    assert list(drawn["average"]) == list(drawn["first"]) == ["foo (mean)", "sgd (mean)"]
    for label, average, first in (("foo (mean)", [0.95, 0.88, 0.81], [0.95, 0.85, 0.72]),
                                  ("sgd (mean)", [0.94, 0.75, 0.61], [0.94, 0.6, 0.33])):
        for curves, want in ((drawn["average"], average), (drawn["first"], first)):
            x, y = curves[label]
            np.testing.assert_array_equal(x, [1, 2, 3])  # tasks seen at each task end
            np.testing.assert_allclose(y, want)


@pytest.mark.parametrize("damaged", ["summary.json", "metrics.jsonl"])
def test_a_run_with_a_file_cut_short_is_one_error_line_naming_the_resume(two_runs, tmp_path, capsys, damaged):
    foovb, sgd = two_runs
    text = (foovb / damaged).read_text()
    (foovb / damaged).write_text(text[: len(text) - 7])  # cut in the middle of a JSON value
    assert main(["compare", str(foovb), str(sgd), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"foovb: error: {foovb}: a damaged output file")
    assert err[0].endswith("--resume` rebuilds the outputs from its checkpoint")


@pytest.mark.parametrize("damage", ["metrics cut at a line", "metrics empty", "metrics of another run",
                                    "summary not a dict"])
def test_a_summary_and_metrics_that_are_not_one_runs_are_one_error_line(two_runs, tmp_path, capsys, damage):
    """metrics.jsonl cut at a line boundary was taken whole: the seeds' mean of the final accuracies mixed a stale
    record with the final ones; an empty one or a summary.json holding [] was a traceback."""
    foovb, sgd = two_runs
    lines = (foovb / "metrics.jsonl").read_text().splitlines(keepends=True)
    if damage == "metrics cut at a line":
        (foovb / "metrics.jsonl").write_text("".join(lines[:2]))
    elif damage == "metrics empty":
        (foovb / "metrics.jsonl").write_text("")
    elif damage == "metrics of another run":
        (foovb / "metrics.jsonl").write_text((sgd / "metrics.jsonl").read_text())
    else:
        (foovb / "summary.json").write_text("[]")
    assert main(["compare", str(foovb), str(sgd), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"foovb: error: {foovb}: a damaged output file"), err
    assert not (tmp_path / "cmp").exists()


def test_a_config_copied_from_another_run_is_one_error_line(two_runs, tmp_path, capsys):
    """config.yaml copied from another run into a run directory: compare grouped the run by the other's settings
    (a helper's trial, session 50)."""
    foovb, sgd = two_runs
    (foovb / "config.yaml").write_text((sgd / "config.yaml").read_text())
    assert main(["compare", str(foovb), str(sgd), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"foovb: error: {foovb}: config.yaml is not the config of the run whose results are there "
                   "(summary.json's learner is 'foovb', config.yaml's 'sgd'); restore the run's own config.yaml"]
    assert not (tmp_path / "cmp").exists()


def test_a_table_that_cannot_be_written_leaves_the_old_one_whole(two_runs, tmp_path, monkeypatch):
    """compare wrote its tables straight into the files: a full disk or a kill left half a table."""
    import builtins

    foovb, sgd = two_runs
    out = tmp_path / "cmp"
    assert main(["compare", str(foovb), str(sgd), "--out", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in ("compare.csv", "compare.md")}
    real_open = builtins.open

    class FullDisk:  # writes the first 10 bytes, then the disk is full
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[:10])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def opening(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if "w" in mode and str(path).startswith(str(out)) else handle

    monkeypatch.setattr(builtins, "open", opening)
    assert main(["compare", str(sgd), "--out", str(out)]) != 0
    monkeypatch.undo()
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not list(out.glob("*.tmp"))
