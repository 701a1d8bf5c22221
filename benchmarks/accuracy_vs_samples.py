"""Final average accuracy vs Monte Carlo samples and vs training wall-clock, from finished runs.

    python benchmarks/accuracy_vs_samples.py RUN_DIR... --out docs/results/mc_samples.png

Reads each run's config.yaml (learner.params.mc_samples, .antithetic) and summary.json, prints a table (one row
per run and prediction mode) and writes a two-panel PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from foovb_suite.loading import load_run


def _label(run: dict) -> str:
    antithetic = run["config"]["learner"]["params"].get("antithetic", False)
    return run["summary"]["learner"] + (" antithetic" if antithetic else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default="accuracy_vs_samples.png")
    args = parser.parse_args()
    runs = []
    for run_dir in args.run_dirs:
        run = load_run(run_dir)
        if run["config"]["learner"]["kind"] != "foovb":
            print(f"skipping {run_dir}: not a FOO-VB run (no Monte Carlo samples)")
            continue
        runs.append(run)
    runs.sort(key=lambda r: (_label(r), r["config"]["learner"]["params"].get("mc_samples", 10)))
    figure = Figure(figsize=(10, 4))
    by_samples, by_time = figure.subplots(1, 2)
    print("| learner | MC samples | mode | average accuracy | first-task accuracy | train minutes |")
    print("|---|---|---|---|---|---|")
    series: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for r in runs:
        s = r["summary"]
        k = r["config"]["learner"]["params"].get("mc_samples", 10)
        for mode, entry in s["modes"].items():
            minutes = s["train_seconds"] / 60
            print(f"| {_label(r)} | {k} | {mode} | {entry['average_accuracy']:.4f} | "
                  f"{entry['first_task_accuracy']:.4f} | {minutes:.1f} |")
            series.setdefault((_label(r), mode), []).append((k, entry["average_accuracy"], minutes))
    for (learner, mode), points in series.items():
        ks, accs, minutes = zip(*points, strict=True)
        by_samples.plot(ks, accs, marker="o", label=f"{learner} ({mode})")
        by_time.plot(minutes, accs, marker="o", label=f"{learner} ({mode})")
    by_samples.set_xscale("log")
    all_k = sorted({k for points in series.values() for k, _, _ in points})
    by_samples.set_xticks(all_k, [str(k) for k in all_k])
    by_samples.minorticks_off()
    by_samples.set(xlabel="MC samples per step (K)", ylabel="final average accuracy", title="Accuracy vs K")
    by_time.set(xlabel="training wall-clock (minutes)", ylabel="final average accuracy",
                title="Accuracy vs wall-clock")
    by_samples.legend(fontsize="small")
    figure.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
