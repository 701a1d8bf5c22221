"""Regenerate the tables of the result pages (docs/results.md, docs/results/*.md) from the run outputs under
docs/results/FOLDER/: what `foovb compare` wrote (compare.csv, compare_seeds.csv), a kept run directory's
summary.json, or a table an output file holds.

    python scripts/results_tables.py            # rewrite the generated tables in place
    python scripts/results_tables.py --check    # exit 1 and show the rows where a page and its outputs disagree

A generated table sits between two comments of its page:

    <!-- table: folder=FOLDER columns=SPEC,SPEC,... rows=KEY KEY ... -->
    | the table, header and one row per KEY |

    <!-- /table -->

`columns` holds one spec per column: `-` keeps the typed cell (labels, commands, wall-clock), a field fills it.
`rows` holds one key per body row, in order (the comment may span lines): `-` keeps the typed row; otherwise RUN or
OTHER_FOLDER/RUN, with `@MODE` for a prediction mode other than `mean`; keys joined by `+` fill one cell "a / b".
The fields of a run (its row of compare.csv, or FOLDER/RUN/summary.json): avg, first, forgetting (percent, points)
and degradation (first minus avg). The fields of an experiment of compare_seeds.csv (the key is its name there):
runs, seeds, mean, mean_range ("mean (min-max)"), mean_seeds ("mean (each run)"), first_mean, last_mean (the last
task's final accuracy), forgetting_mean, s_per_iter_mean. `:N` after a field sets its decimals (rounded half up).
Emphasis (`**...**`) typed around the numbers of a cell stays on the same numbers.

`<!-- table: file=FOLDER/NAME.md index=N -->` copies the N-th (from 1; default 1) markdown table of an output file.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"<!-- table:(.*?)-->\n(.*?)<!-- /table -->\n", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FIELDS = {"avg": ("average_accuracy", 2), "first": ("first_task_accuracy", 2), "forgetting": ("forgetting", 2)}
SEED_FIELDS = ("runs", "seeds", "mean", "mean_range", "mean_seeds", "first_mean", "last_mean", "forgetting_mean",
               "s_per_iter_mean")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


class Outputs:
    """The outputs under docs/results/: compare.csv / compare_seeds.csv rows (each file read once), summaries."""

    def __init__(self, results: Path) -> None:
        self.results, self.cache = results, {}

    def rows(self, folder: str, stem: str) -> list[dict[str, str]]:
        path = self.results / folder / f"{stem}.csv"
        if path not in self.cache:
            if not path.is_file():
                raise ValueError(f"no {path.relative_to(self.results.parent.parent)}")
            self.cache[path] = read_csv(path)
        return self.cache[path]

    def run(self, folder: str, name: str, mode: str) -> dict:
        """A run's row of FOLDER/compare.csv, or its results from the run directory FOLDER/NAME/ if kept."""
        summary = self.results / folder / name / "summary.json"
        if summary.is_file():
            return json.loads(summary.read_text())["modes"][mode]
        return self.find(folder, "compare", name, mode)

    def find(self, folder: str, stem: str, name: str, mode: str) -> dict[str, str]:
        column = "run" if stem == "compare" else "experiment"
        for row in self.rows(folder, stem):
            if row[column] == name and row["mode"] == mode:
                return row
        raise ValueError(f"{folder}/{stem}.csv has no {column} {name!r} in mode {mode!r}")


def fmt(value: float | str, decimals: int, scale: int = 1) -> str:
    """`value` (a number or the text of one) times `scale`, rounded half up: the digits of the text, not of its
    nearest float, decide a tie."""
    number = Decimal(str(value)) * scale
    return f"{number.quantize(Decimal(1).scaleb(-decimals), ROUND_HALF_UP) + 0:f}"  # + 0: no "-0.00"


def cell(outputs: Outputs, folder: str, key: str, field: str) -> str:
    """One key's value of a field (KEY: [FOLDER/]NAME[@MODE])."""
    field, _, digits = field.partition(":")
    name, _, mode = key.partition("@")
    if "/" in name:
        folder, name = name.rsplit("/", 1)
    mode = mode or "mean"
    if field == "degradation":  # the paper's measure: the first task's final accuracy minus the average
        row = outputs.run(folder, name, mode)
        difference = Decimal(str(row["first_task_accuracy"])) - Decimal(str(row["average_accuracy"]))
        return fmt(difference, int(digits or 2), 100)
    if field in FIELDS:
        column, decimals = FIELDS[field]
        return fmt(outputs.run(folder, name, mode)[column], int(digits or decimals), 100)
    if field not in SEED_FIELDS:
        raise ValueError(f"unknown field {field!r} (fields: {', '.join([*FIELDS, 'degradation', *SEED_FIELDS])})")
    group = outputs.find(folder, "compare_seeds", name, mode)
    if field == "runs":
        return group["num_runs"]
    if field == "seeds":
        return ", ".join(group["seeds"].split())
    if field == "s_per_iter_mean":  # the one statistic compare_seeds.csv lacks: from its runs' rows
        runs = [outputs.find(folder, "compare", run, mode) for run in group["runs"].split()]
        return fmt(mean(Decimal(r["ms_per_iteration"]) for r in runs) / 1000, int(digits or 3))
    decimals = int(digits or 2)
    percent = {key: fmt(group[column], decimals, 100) for key, column in (
        ("mean", "average_accuracy_mean"), ("min", "average_accuracy_min"), ("max", "average_accuracy_max"),
        ("first_mean", "first_task_accuracy_mean"), ("forgetting_mean", "forgetting_mean"))}
    if field == "mean_range":
        return f"{percent['mean']} ({percent['min']}-{percent['max']})"
    if field == "mean_seeds":
        runs = [outputs.find(folder, "compare", run, mode) for run in group["runs"].split()]
        return f"{percent['mean']} ({', '.join(fmt(r['average_accuracy'], decimals, 100) for r in runs)})"
    if field == "last_mean":
        return fmt(group["final_accuracy_per_task_mean"].split(" / ")[-1], decimals, 100)
    return percent[field]


def emphasised(typed: str, value: str) -> str:
    """`value` with the emphasis that `typed` puts around its numbers, number by number (none if the numbers of
    the two do not pair up)."""
    spans, count, bold = [], 0, False
    for part in re.split(r"(\*\*)", typed):
        if part == "**":
            bold = not bold
            spans.append((count, bold))  # a marker before number `count` (opening) or after number count-1
        else:
            count += len(NUMBER.findall(part))
    numbers = list(NUMBER.finditer(value))
    if not spans or len(numbers) != count:
        return value
    out, last = [], 0
    for index, match in enumerate(numbers):  # a closing marker right after the number before, an opening one
        closing = sum(1 for s in spans if s == (index, False))  # right before this one
        opening = sum(1 for s in spans if s == (index, True))
        out.append("**" * closing + value[last:match.start()] + "**" * opening + match.group())
        last = match.end()
    return "".join(out) + "**" * sum(1 for s in spans if s == (count, False)) + value[last:]


def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def options(spec: str) -> tuple[dict[str, str], list[str]]:
    head, _, rows = spec.partition("rows=")
    pairs = dict(token.split("=", 1) for token in head.split())
    return pairs, rows.split()


def markdown_tables(text: str) -> list[str]:
    """The markdown tables of a text, each as its lines joined (with a final newline)."""
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current) + "\n")
            current = []
    return tables


def generate(outputs: Outputs, spec: str, table: str) -> str:
    """The table of one block, regenerated."""
    opts, keys = options(spec)
    if "file" in opts:
        tables = markdown_tables((outputs.results / opts["file"]).read_text())
        return tables[int(opts.get("index", 1)) - 1]
    columns = opts["columns"].split(",")
    lines = table.rstrip("\n").split("\n")
    header, rule, body = lines[0], lines[1], lines[2:]
    if len(split_row(header)) != len(columns):
        raise ValueError(f"{len(columns)} column specs for a table of {len(split_row(header))} columns")
    if len(keys) != len(body):
        raise ValueError(f"{len(keys)} row keys for a table of {len(body)} rows")
    new = [header, rule]
    for key, line in zip(keys, body, strict=True):
        if key == "-":  # a typed row, kept as it is
            new.append(line)
            continue
        cells = split_row(line)
        for index, field in enumerate(columns):
            if field != "-":
                value = " / ".join(cell(outputs, opts["folder"], part, field) for part in key.split("+"))
                cells[index] = emphasised(cells[index], value)
        new.append("| " + " | ".join(cells) + " |")
    return "\n".join(new) + "\n"


def process(page: Path, outputs: Outputs) -> tuple[str, list[str], list[str]]:
    """The page's text with its tables regenerated; the blocks that failed; the generated rows that differ."""
    text, errors, differences = page.read_text(), [], []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page

    def replace(match: re.Match) -> str:
        where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
        typed = match.group(2).strip("\n") + "\n"
        try:
            table = generate(outputs, match.group(1), typed)
        except (ValueError, KeyError, IndexError, OSError) as exc:
            errors.append(f"{where}: {type(exc).__name__}: {exc}")
            return match.group(0)
        old, new = typed.splitlines(), table.splitlines()
        differences.extend(f"{where}: the page has\n    {a}\n  its outputs give\n    {b}"
                           for a, b in zip(old, new, strict=False) if a != b)
        if len(old) != len(new):
            differences.append(f"{where}: the page's table has {len(old)} lines, its output's {len(new)}")
        return f"<!-- table:{match.group(1)}-->\n{table}\n<!-- /table -->\n"  # a blank line ends the table

    return BLOCK.sub(replace, text), errors, differences


def pages() -> list[Path]:
    return [ROOT / "docs" / "results.md", *sorted(RESULTS.glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table disagrees")
    parser.add_argument("pages", nargs="*", type=Path, help="the pages (default: docs/results.md, docs/results/*.md)")
    args = parser.parse_args(argv)
    outputs, failed = Outputs(RESULTS), False
    for page in [p.resolve() for p in args.pages] or pages():
        text, errors, differences = process(page, outputs)
        problems = errors + differences if args.check else errors
        if problems:
            print("\n".join(problems), file=sys.stderr)
            failed = True
        if not args.check and text != page.read_text():
            page.write_text(text)
            print(f"rewrote {page}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
