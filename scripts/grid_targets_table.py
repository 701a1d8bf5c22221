"""The robustness grid's targets (issue 54) side by side for several summary CSVs (`benchmarks/robustness_grid.py`'s
summary_TAG.csv, one per candidate and seeds), as a markdown table: one column per CSV, one row per target, counted
as the grid's own targets (`robustness_grid.target_counts`). `--cells`: one row per named cell instead, with the best
baseline's average (first task) and each CSV's, minus the best baseline's.

    python scripts/grid_targets_table.py [--family kronecker] LABEL=SUMMARY.csv ... [--cells A,B] [--out TABLE.md]
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import robustness_grid as grid  # noqa: E402


def read_summary(path: Path) -> list[dict]:
    """A summary CSV's rows with its numbers, booleans and blanks as `cell_summary` made them."""

    def value(text: str) -> object:
        if text in ("True", "False"):
            return text == "True"
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return math.nan if text == "" else text

    with path.open() as file:
        return [{key: value(text) for key, text in row.items() if text != "" or key == "best_first_learned"}
                for row in csv.DictReader(file)]


def table(columns: list[tuple[str, list[dict]]], family: str) -> list[str]:
    counts = [(label, grid.target_counts(rows, family)) for label, rows in columns]
    missing = [label for label, count in counts if count is None]
    if missing:
        raise SystemExit(f"grid_targets_table: no {family} rows in {missing}")

    def row(name: str, cell) -> str:
        return f"| {name} | " + " | ".join(cell(count) for _, count in counts) + " |"

    return [
        "| target | " + " | ".join(label for label, _ in counts) + " |",
        "|---|" + "---|" * len(counts),
        row("cells (diverged)", lambda c: f"{len(c['rows'])} ({len(c['diverged'])})"),
        row("drift cells: first task >= 10 points above the best baseline",
            lambda c: f"{len(c['kept'])} of {len(c['drift'])}"),
        row("... of those a learner can reach", lambda c: f"{len([r for r in c['reachable'] if r in c['kept']])} of "
            f"{len(c['reachable'])}" if c["measured"] else "not measured"),
        row("accuracy cells more than 2 points below the best baseline",
            lambda c: f"{len(c['low'])} of {len(c['accuracy'])}" + (f" ({', '.join(c['low'])})" if c['low'] else "")),
        row("errors above 1.5x the best baseline's",
            lambda c: f"{len(c['high'])} of {len(c['errors'])}" + (f" ({', '.join(c['high'])})" if c['high'] else "")),
        row("median accuracy cell vs the best baseline (points)", lambda c: f"{c['median']:+.2f}"),
    ]


def cells_table(columns: list[tuple[str, list[dict]]], family: str, cells: list[str]) -> list[str]:
    """One row per cell: the best baseline's average (first task), each column's, and each minus the best baseline's
    (accuracy: points; error: the ratio)."""
    lines = ["| cell | best baseline: average (first task) | " + " | ".join(label for label, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for cell in cells:
        rows = [next((r for r in rows if r["cell"] == cell), None) for _, rows in columns]
        if any(r is None for r in rows):
            raise SystemExit(f"grid_targets_table: {cell} is not in every summary")
        first = rows[0]
        line = f"| {cell} | {first['best_baseline_average']:.4g} ({first['best_baseline_first']:.4g}) |"
        for r in rows:
            if r.get(f"{family}_diverged") is True:
                line += " diverged |"
                continue
            vs = r[f"{family}_average_vs_best"]
            versus = f"{vs:.2f}x" if r["metric"] != "accuracy" else f"{vs:+.1f} ({r[f'{family}_first_vs_best']:+.1f})"
            line += f" {r[f'{family}_average']:.4g} ({r[f'{family}_first']:.4g}), {versus} |"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", help="LABEL=path/to/summary_TAG.csv")
    parser.add_argument("--family", choices=("kronecker", "diagonal"), default="kronecker")
    parser.add_argument("--cells", help="comma-separated cells: a table of those cells instead of the targets")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    columns = []
    for spec in args.summaries:
        label, _, path = spec.rpartition("=")
        if not label or not Path(path).is_file():
            parser.error(f"{spec!r}: expected LABEL=an existing summary CSV")
        rows = read_summary(Path(path))
        halves = sorted({str(r.get("half")) for r in rows})
        if len(halves) > 1:  # the grid counts its targets per half
            parser.error(f"{path} holds both halves of the grid ({', '.join(halves)}): one column per half, from a "
                         "summary of one --half")
        columns.append((label, rows))
    lines = (cells_table(columns, args.family, args.cells.split(",")) if args.cells else table(columns, args.family))
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
