"""A markdown table of finished runs: one row per run directory, with the FOO-VB settings its config gave (those not
given are FOOVB(model)'s defaults of the code that ran) and its posterior-mean results from summary.json.

    python scripts/run_table.py RUN_DIR[=SETTINGS] [...] > table.md

SETTINGS replaces the settings read from the config: for a run made with defaults that have changed since.

Used for docs/results.md's tables of candidate defaults (docs/results/default_implicit/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

SETTINGS = ("posterior", "implicit_mean", "cov_step", "mean_step", "output_anchor", "step_prior", "secant_check",
            "curvature_damping", "diagonal_output_factor")


def row(run: Path, settings: str | None) -> str:
    summary = json.loads((run / "summary.json").read_text())
    params = yaml.safe_load((run / "config.yaml").read_text())["learner"].get("params", {})
    settings = settings or ", ".join(f"{key} {params[key]}" for key in SETTINGS[1:] if key in params) or "defaults"
    mean = summary["modes"]["mean"]
    family = summary["learner"].removeprefix("foovb-")  # the posterior the run used, whatever the default was
    return (f"| {run.name} | {family} | {settings} | "
            f"{100 * mean['average_accuracy']:.2f} | {100 * mean['first_task_accuracy']:.2f} | "
            f"{summary['iterations']} | {summary['train_seconds'] / 60:.1f} | {summary['hardware']} |")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("| run | family | settings given | average (%) | first task (%) | steps | minutes | hardware |")
    print("|---|---|---|---|---|---|---|---|")
    for argument in sys.argv[1:]:
        path, _, settings = argument.partition("=")
        print(row(Path(path), settings or None))


if __name__ == "__main__":
    main()
