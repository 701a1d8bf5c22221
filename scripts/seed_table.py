"""A markdown table of finished runs grouped over seeds, with each task's final accuracy (issue 39's tables).

    python scripts/seed_table.py runs/mix/aware_*_s? [--mode mean] [--tasks MNIST Fashion-MNIST]

Runs are grouped by directory name without its ``_s<seed>`` suffix, in the order first given. For each group: the
mean average accuracy over seeds and its range, then the mean final accuracy of every task (the last row of
``accuracy_matrix_<mode>.csv``), the forgetting (mean over all but the last task of best-before-the-end minus
final, as ``summary.json``) and the seconds per iteration.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--mode", default="mean", help="prediction mode (mean, bma, single)")
    parser.add_argument("--tasks", nargs="*", help="task names for the column headers")
    args = parser.parse_args()
    groups: dict[str, list[Path]] = {}
    for run_dir in args.run_dirs:
        if not (run_dir / "summary.json").is_file():
            raise SystemExit(f"seed_table: {run_dir} has no summary.json (not a finished run)")
        groups.setdefault(re.sub(r"_s\d+$", "", run_dir.name), []).append(run_dir)
    rows = []
    for name, run_dirs in groups.items():
        summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
        if any(args.mode not in s["modes"] for s in summaries):
            raise SystemExit(f"seed_table: a run of {name} has no {args.mode!r} mode")
        averages = np.array([s["modes"][args.mode]["average_accuracy"] for s in summaries]) * 100
        finals = np.array([np.loadtxt(d / f"accuracy_matrix_{args.mode}.csv", delimiter=",", ndmin=2)[-1]
                           for d in run_dirs]) * 100
        forgetting = np.mean([s["modes"][args.mode]["forgetting"] for s in summaries]) * 100
        seconds = np.mean([s["seconds_per_iteration"] for s in summaries])
        rows.append((name, len(run_dirs), averages, finals.mean(axis=0), forgetting, seconds))
    num_tasks = max(len(row[3]) for row in rows)
    tasks = args.tasks or [f"task {t + 1}" for t in range(num_tasks)]
    print(f"| run | seeds | average accuracy (%) | {' | '.join(f'{t} final (%)' for t in tasks)} | forgetting "
          "(points) | s per iteration |")
    print("|---|---|---|" + "---|" * len(tasks) + "---|---|")
    for name, seeds, averages, finals, forgetting, seconds in rows:
        spread = f" ({averages.min():.2f}-{averages.max():.2f})" if seeds > 1 else ""
        print(f"| {name} | {seeds} | {averages.mean():.2f}{spread} | "
              f"{' | '.join(f'{value:.2f}' for value in finals)} | {forgetting:.2f} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
