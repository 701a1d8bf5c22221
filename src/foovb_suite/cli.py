"""Command line: `foovb run CONFIG [--set key=value ...] [--out DIR] [--resume] [--tensorboard]`, `foovb configs`,
`foovb compare RUN_DIR...` and `foovb plot MATRIX_CSV...`."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import re
import shlex
import signal
import sys
import traceback
import warnings
from importlib import resources
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from foovb import __version__

from .config import ConfigError, config_from_dict, default_run_dir, load_config, protocol_of
from .metrics import ACCURACY_MODES, average_accuracy, first_task_accuracy, validate_accuracy_matrix
from .rundir import CheckpointError, make_directory, send_to_devnull, write_atomically

__all__ = ["build_parser", "bundled_configs", "config_path", "main"]


def bundled_configs() -> dict[str, Path]:
    """The experiment configs shipped in the package (``foovb/configs/*.yaml``), by name without ``.yaml``."""
    folder = Path(str(resources.files("foovb_suite") / "configs"))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def config_path(config: str) -> Path:
    """``config`` as given when it is an existing file or looks like a path (a directory part or a suffix),
    else the bundled config of that name: ``foovb run demo`` works from any directory after ``pip install``."""
    if not config.strip():
        raise ConfigError("the config is an empty name: give a YAML file or a bundled config's name (foovb configs)")
    path = Path(config)
    bundled = bundled_configs()
    if not path.exists() and path.suffix == ".yaml" and path.stem in bundled:  # `configs/demo.yaml` outside a checkout
        raise ConfigError(f"config file {path} does not exist; the bundled config of that name runs with "
                          f"`foovb run {path.stem}` from any directory")
    if path.is_file() or path.suffix or len(path.parts) > 1 or config.startswith("."):
        return path
    if config not in bundled:
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory, not a YAML file")
        raise ConfigError(f"{config!r} is neither a file nor a bundled config; the bundled ones "
                          f"(foovb configs): {', '.join(bundled)}")
    return bundled[config]


def _configs(args: argparse.Namespace) -> int:
    """List the bundled configs, each with the first sentence of its header comment, and their folder."""
    paths = bundled_configs()
    width = max(map(len, paths))
    for name, path in paths.items():
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line.removeprefix("#").strip())
        first_sentence = re.split(r"\.\s+(?=[A-Z])", " ".join(header))[0].removesuffix(".")
        print(f"{name:<{width}}  {first_sentence}")
    folder = next(iter(paths.values())).parent
    print(f"\nfolder: {folder} (run one by name, e.g. `foovb run demo`, or copy it and edit the copy)")
    return 0


def _run(args: argparse.Namespace) -> int:
    """Train one config; a diverging run exits with 1, Ctrl-C with 130, SIGTERM with 143 (each with one message,
    no traceback). The custom scenario's and model's factories are imported from the working directory, then the
    config file's directory (`foovb_suite.custom`)."""
    from .custom import config_directory
    from .loop import TrainingDiverged
    from .runner import run

    path = config_path(args.config)
    config = load_config(path, [*args.set, *(["tensorboard=true"] if args.tensorboard else [])])
    run_dir = Path(args.out) if args.out else default_run_dir(config)
    try:
        with config_directory(path):
            summary = run(config, run_dir, resume=args.resume, progress=not args.no_progress)
    except TrainingDiverged as error:
        print(f"foovb: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        signum = getattr(error, "signal_number", signal.SIGINT)
        with contextlib.suppress(OSError):  # stderr's reader may be gone (`| tee`, stopped by the same Ctrl-C)
            print(_interrupted_message(str(error), args, run_dir, signum), file=sys.stderr)
        return 128 + signum
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return 0
    for mode, entry in summary["modes"].items():
        print(f"{summary['learner']} [{mode}]: average accuracy {entry['average_accuracy']:.4f}, "
              f"first task {entry['first_task_accuracy']:.4f}")
    print(f"outputs in {run_dir}")
    where = Path(path).resolve().parent  # as config_directory finds the factories
    if (config.model.kind == "custom" or config.scenario.kind == "custom") and where != Path.cwd().resolve():
        print(f"model: foovb_suite.load_model({str(run_dir.resolve())!r}) (learner: load_learner), run in {where} or "
              "with it on sys.path: the factories' modules are there")
    else:
        print(f"model: foovb_suite.load_model({str(run_dir)!r}) (learner: load_learner)")
    return 0


def _interrupted_message(saved: str, args: argparse.Namespace, run_dir: Path, signum: int = signal.SIGINT) -> str:
    """The line printed on Ctrl-C or SIGTERM: what was saved, and the command that resumes from the checkpoint."""
    stopped = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    message = f"foovb: {stopped}" + (f": {saved}" if saved else "")
    if not (run_dir / "checkpoint.pt").is_file():
        return message
    command = ["foovb", "run", args.config, *(part for value in args.set for part in ("--set", value)),
               "--out", str(run_dir), "--resume", *(["--no-progress"] if args.no_progress else []),
               *(["--tensorboard"] if args.tensorboard else [])]
    return f"{message}; resume with: {shlex.join(command)}"


def _write_table(out: Path, stem: str, header: list[str], rows: list[list]) -> None:
    """`stem`.csv and `stem`.md in `out`, each written atomically (a kill leaves the old file or the new one,
    never half a table), and the table printed with aligned columns."""
    table = io.StringIO(newline="")
    csv.writer(table).writerows([header, *rows])
    write_atomically(table.getvalue().encode(), out / f"{stem}.csv")
    markdown = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    write_atomically(("\n".join(markdown) + "\n").encode(), out / f"{stem}.md")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def _seed_rows(runs: list[dict]) -> list[list]:
    """One row per (experiment, mode): mean, sample std (blank for one run), min and max over the runs that differ only
    in their seeds (`loading.experiment_key`) and trained on the same data and model (a custom one's), and each task's
    final accuracy averaged over them (" / " between tasks); runs are named by their "name" entry."""
    from .loading import experiment_key

    by_config: dict[str, list[dict]] = {}
    for r in runs:
        by_config.setdefault(experiment_key(r["config"]), []).append(r)
    groups: list[list[dict]] = []
    for same_config in by_config.values():  # on other data or another model (a factory edited between runs): apart
        recorded = [r["summary"].get("run", {}) for r in same_config]
        # summaries before session 53 record neither, before session 54 no model: what every run records is compared
        keys = [key for key in ("data", "model") if all(key in record for record in recorded)]
        classes = all(isinstance(record.get("model"), dict) and "classes" in record["model"] for record in recorded)
        by_data: dict[str, list[dict]] = {}
        for r, record in zip(same_config, recorded, strict=True):
            what = [record[key] if key == "data" or record[key] is None else  # the model's hashes, not its file's path
                    [record[key]["modules"], record[key]["source"], record[key]["classes"] if classes else None]
                    for key in keys]
            by_data.setdefault(json.dumps(what), []).append(r)
        if len(by_data) > 1:
            split = " and ".join(f"[{', '.join(r['name'] for r in group)}]" for group in by_data.values())
            print(f"foovb: warning: {split} have one config but were trained on different data or models (the "
                  "custom factories' SHA-256 in summary.json): not averaged as seeds of one experiment",
                  file=sys.stderr)
        groups.extend(by_data.values())
    rows = []
    for group in groups:
        configs = [config_from_dict(r["config"]) for r in group]
        seeds = [(c.seed, c.scenario.seed) for c in configs]
        if len(set(seeds)) < len(seeds):
            print(f"foovb: warning: {[r['name'] for r in group]} repeat a seed of one experiment; "
                  "the mean over seeds counts each run", file=sys.stderr)
        seed_text = " ".join(str(s) if s == t else f"{s}/{t}" for s, t in seeds)
        for mode in group[0]["summary"]["modes"]:
            entries = [r["summary"]["modes"][mode] for r in group]
            average = np.array([e["average_accuracy"] for e in entries])
            std = f"{average.std(ddof=1):.4f}" if len(average) > 1 else ""
            forgetting = np.mean([e.get("forgetting", np.nan) for e in entries])
            finals = np.mean([r["records"][-1]["accuracy"][mode] for r in group], axis=0)
            rows.append([group[0]["name"], " ".join(r["name"] for r in group), seed_text, len(group),
                         group[0]["summary"]["learner"], mode, f"{average.mean():.4f}", std,
                         f"{average.min():.4f}", f"{average.max():.4f}",
                         f"{np.mean([e['first_task_accuracy'] for e in entries]):.4f}", f"{forgetting:.4f}",
                         " / ".join(f"{value:.4f}" for value in finals)])
    return rows


def _protocol_differences(runs: list[dict]) -> list[str]:
    """One line per protocol key (`config.protocol_of`) on which the runs differ: the key, then each value with
    the runs that have it."""
    protocols = [protocol_of(config_from_dict(r["config"])) for r in runs]
    lines = []
    for key in protocols[0]:
        holders: dict[str, list[str]] = {}
        for r, protocol in zip(runs, protocols, strict=True):
            holders.setdefault(json.dumps(protocol[key]), []).append(r["name"])
        if len(holders) > 1:
            lines.append(f"{key}: " + "; ".join(f"{value} ({', '.join(names)})" for value, names in holders.items()))
    return lines


def _compare(args: argparse.Namespace) -> int:
    from . import plots
    from .evaluation import tasks_seen
    from .learners import learner_hyperparameters
    from .loading import load_run

    runs = [load_run(d) for d in args.run_dirs]
    seen: dict[object, str] = {}
    for r in runs:  # one run given twice: by a symlink, or as a copy (its run identity, recorded since session 51)
        for key in (("path", r["dir"].resolve()), ("run", r["summary"].get("run", {}).get("id"))):
            if key[1] is not None and key in seen:
                how = "the same directory" if key[0] == "path" else "the same run identity: a copy"
                print(f"foovb: error: a run directory is given twice: {seen[key]} and {r['dir']} are one run ({how}); "
                      "give it once", file=sys.stderr)
                return 2
            seen.setdefault(key, str(r["dir"]))
    names = [r["dir"].name for r in runs]
    if len(set(names)) < len(names):  # e.g. x/run and y/run: name them by their paths
        names = [str(r["dir"]) for r in runs]
    for name, r in zip(names, runs, strict=True):
        r["name"] = name
    unknown = sorted(set(args.plot_runs or []) - set(names))
    if unknown:
        print(f"foovb: error: --plot-runs: {unknown} not among the compared runs {names}",
              file=sys.stderr)
        return 2
    drawn = set(names) if args.plot_runs is None else set(args.plot_runs)  # the runs in the plots
    drawn_modes = {mode for r in runs if r["name"] in drawn for mode in r["summary"]["modes"]}
    if args.plot_modes is not None and not drawn_modes & set(args.plot_modes):
        have = sorted(drawn_modes)
        print(f"foovb: error: --plot-modes: none of the plotted runs has {', '.join(args.plot_modes)} (they have "
              f"{', '.join(have)})", file=sys.stderr)
        return 2
    differences = _protocol_differences(runs)
    if differences:
        print("foovb: warning: the runs differ in their protocol, so their accuracies do not compare:\n  "
              + "\n  ".join(differences), file=sys.stderr)
    out = Path(args.out)
    if (refusal := _not_an_output_directory(out, "compare")) is not None:
        print(refusal, file=sys.stderr)
        return 2
    make_directory(out)  # a file in the way, or a full disk: one line naming it
    header = ["run", "learner", "scenario", "tasks", "iterations", "mc_samples", "mode", "average_accuracy",
              "first_task_accuracy", "forgetting", "train_minutes", "ms_per_iteration"]
    rows = []
    average_curves, first_curves = {}, {}
    for name, r in zip(names, runs, strict=True):
        s, config = r["summary"], r["config"]
        kind = config["learner"]["kind"]
        mc = learner_hyperparameters(kind, config["learner"]["params"]).get("mc_samples", "-")
        stages = tasks_seen(r["records"], config_from_dict(config))
        for mode, entry in s["modes"].items():
            label = f"{name} ({mode})"
            rows.append([name, s["learner"], s["scenario"], s["num_tasks"], s["iterations"], mc, mode,
                         f"{entry['average_accuracy']:.4f}", f"{entry['first_task_accuracy']:.4f}",
                         f"{entry.get('forgetting', float('nan')):.4f}", f"{s['train_seconds'] / 60:.1f}",
                         f"{s['seconds_per_iteration'] * 1e3:.2f}"])
            if name in drawn and (args.plot_modes is None or mode in args.plot_modes):
                average_curves[label] = (stages, entry["average_accuracy_curve"])
                first_curves[label] = (stages, [rec["accuracy"][mode][0] for rec in r["records"]])
    _write_table(out, "compare", header, rows)
    if differences:
        with open(out / "compare.md", "a") as f:
            f.write("\nThe runs differ in their protocol, so their accuracies do not compare:\n\n"
                    + "".join(f"- {line}\n" for line in differences))
    print()
    seed_header = ["experiment", "runs", "seeds", "num_runs", "learner", "mode", "average_accuracy_mean",
                   "average_accuracy_std", "average_accuracy_min", "average_accuracy_max",
                   "first_task_accuracy_mean", "forgetting_mean", "final_accuracy_per_task_mean"]
    _write_table(out, "compare_seeds", seed_header, _seed_rows(runs))
    plots.plot_average_accuracy(average_curves, out / "average_accuracy.png")
    plots.plot_first_task_accuracy(first_curves, out / "first_task_accuracy.png")
    print(f"tables (compare.csv/.md, per run; compare_seeds.csv/.md, mean over seeds) and plots in {out}")
    return 0


def _matrix_label(path: Path) -> str:
    """A run directory's `accuracy_matrix_<mode>.csv` is named "<directory> (<mode>)"; a saved copy
    `<name>_accuracy_matrix_mean.csv` is named "<name>"."""
    if path.stem.startswith("accuracy_matrix_"):
        return f"{path.parent.name} ({path.stem.removeprefix('accuracy_matrix_')})"
    return path.stem.removesuffix("_accuracy_matrix_mean")


def _matrix_disagrees(path: Path, average: float, first: float) -> str | None:
    """Why a run directory's `accuracy_matrix_<mode>.csv` is not that run's (copied from another run: its final
    average or first task differs from the directory's summary.json for that mode), or None; a matrix outside a
    finished run's directory is not checked."""
    if not path.stem.startswith("accuracy_matrix_"):
        return None
    mode = path.stem.removeprefix("accuracy_matrix_")
    try:
        entry = json.loads((path.parent / "summary.json").read_text())["modes"][mode]
        written = float(entry["average_accuracy"]), float(entry["first_task_accuracy"])
    except (OSError, ValueError, KeyError, TypeError):  # no summary.json beside it, or not this mode's
        return None
    if not np.allclose([average, first], written, rtol=0, atol=1e-5, equal_nan=True):
        return (f"its final average and first task ({average:.4f}, {first:.4f}) are not those of the run in "
                f"{path.parent} ({written[0]:.4f}, {written[1]:.4f} in summary.json, mode {mode}): copied from "
                "another run? Plot the run's own matrix, or a copy outside the run directory")
    return None


_TABLES = {"compare": "compare.csv", "plot": "plotted.csv"}
"""The table each command writes into its --out (both write average_accuracy.png and first_task_accuracy.png)."""


def _not_an_output_directory(out: Path, command: str) -> str | None:
    """The one-line error for an --out that would mix outputs: a run directory (its plots are the run's), or the
    directory of the other command's outputs alone (a directory that holds both commands' tables already is taken as
    meant to); None if --out is fine."""
    from .resume import RUN_FILE

    run_files = [name for name in (RUN_FILE, "checkpoint.pt", "summary.json") if (out / name).exists()]
    if run_files:
        return (f"foovb: error: --out {out} is a run directory ({run_files[0]}): foovb {command} would write its "
                "tables and plots among the run's; choose another directory")
    other = next(table for name, table in _TABLES.items() if name != command)
    if (out / other).exists() and not (out / _TABLES[command]).exists():  # both there: a directory meant to hold both
        return (f"foovb: error: --out {out} holds the outputs of another command ({other}): foovb {command} would "
                "overwrite its plots; choose another directory")
    return None


def _plot(args: argparse.Namespace) -> int:
    """Average-accuracy and first-task plots, and a table of their final values, from saved accuracy matrices
    (`accuracy_matrix_<mode>.csv` of a run: one row per task end, one column per task)."""
    from . import plots

    paths = [Path(m) for m in args.matrices]
    labels = args.labels or [_matrix_label(p) for p in paths]
    if len(labels) != len(paths):
        print(f"foovb: error: --labels: {len(labels)} labels for {len(paths)} matrices", file=sys.stderr)
        return 2
    if len(set(labels)) < len(labels):
        fix = "" if args.labels else " (read from the runs' names): name each matrix with --labels A B ..."
        print(f"foovb: error: labels must differ, got {labels}{fix}", file=sys.stderr)
        return 2
    average_curves, first_curves, rows = {}, {}, []
    for label, path in zip(labels, paths, strict=True):
        try:
            with warnings.catch_warnings():  # an empty file: said below, once
                warnings.simplefilter("ignore", UserWarning)
                values = np.loadtxt(path, delimiter=",", ndmin=2)
        except ValueError as error:  # text: a header row or column, another kind of CSV (metrics.csv)
            print(f"foovb: error: {path}: not an accuracy matrix, which holds numbers only (a run's "
                  f"accuracy_matrix_<mode>.csv: one row per task end, one column per task): {error}", file=sys.stderr)
            return 2
        if values.size == 0:
            print(f"foovb: error: {path}: empty (no accuracies)", file=sys.stderr)
            return 2
        try:
            matrix = validate_accuracy_matrix(values)
        except ValueError as error:
            hint = ("; a run evaluated more often than once per task (the continuous scenario with eval_every) "
                    "is plotted by foovb compare") if values.shape[0] > values.shape[1] > 0 else ""
            print(f"foovb: error: {path}: {error}{hint}", file=sys.stderr)
            return 2
        outside = matrix[np.isfinite(matrix) & ((matrix < 0) | (matrix > 1))]
        if outside.size:
            print(f"foovb: error: {path}: accuracies are fractions in [0, 1], found {outside[0]:g} (percentages? "
                  "divide them by 100)", file=sys.stderr)
            return 2
        tasks = np.arange(1, matrix.shape[0] + 1)
        average, first = average_accuracy(matrix), first_task_accuracy(matrix)
        problem = _matrix_disagrees(path, average[-1], first[-1])
        if problem is not None:
            print(f"foovb: error: {path}: {problem}", file=sys.stderr)
            return 2
        average_curves[label], first_curves[label] = (tasks, average), (tasks, first)
        rows.append([label, str(path), matrix.shape[0], f"{average[-1]:.4f}", f"{first[-1]:.4f}"])
    out = Path(args.out)
    if (refusal := _not_an_output_directory(out, "plot")) is not None:
        print(refusal, file=sys.stderr)
        return 2
    make_directory(out)  # a file in the way, or a full disk: one line naming it
    _write_table(out, "plotted", ["label", "matrix", "tasks", "average_accuracy", "first_task_accuracy"], rows)
    plots.plot_average_accuracy(average_curves, out / "average_accuracy.png")
    plots.plot_first_task_accuracy(first_curves, out / "first_task_accuracy.png")
    print(f"table (plotted.csv/.md) and plots in {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors end, as every other user error of the CLI, with one `foovb: error: ...` line
    (argparse's own reads `foovb run: error: ...`), after the usage."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"foovb: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `foovb` argument parser (its subcommands carry their function in `func`)."""
    parser = _Parser(prog="foovb", description=__doc__)
    parser.add_argument("--version", action="version", version=f"foovb {__version__}")
    debug_help = "show the Python traceback of an error (by default one 'foovb: error:' line)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # --debug after the subcommand too (foovb run demo --debug); SUPPRESS: absent there, the top level's value stays
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p_run = sub.add_parser("run", parents=[debug], help="train and evaluate one experiment config")
    p_run.add_argument("config", help="a YAML config file, or the name of a bundled one (foovb configs)")
    p_run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set learner.params.mc_samples=2")
    p_run.add_argument("--out", help="run directory (default runs/<name>)")
    p_run.add_argument("--resume", action="store_true", help="continue from the run directory's checkpoint")
    p_run.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_run.add_argument("--tensorboard", action="store_true",
                       help="write TensorBoard event files under RUN/tensorboard/ during the run (config key "
                            "tensorboard: true; needs the tensorboard package)")
    p_run.set_defaults(func=_run)
    p_cfg = sub.add_parser("configs", parents=[debug],
                           help="list the bundled experiment configs (one per paper experiment)")
    p_cfg.set_defaults(func=_configs)
    p_cmp = sub.add_parser("compare", parents=[debug], help="side-by-side table and overlaid plots of finished runs")
    p_cmp.add_argument("run_dirs", nargs="+")
    p_cmp.add_argument("--out", default="compare", help="where to write compare.csv and plots")
    p_cmp.add_argument("--plot-modes", nargs="+", choices=ACCURACY_MODES, metavar="MODE",
                       help=f"prediction modes drawn in the plots (of {', '.join(ACCURACY_MODES)}; default all); "
                            "the table always has every mode")
    p_cmp.add_argument("--plot-runs", nargs="+", metavar="NAME",
                       help="runs drawn in the plots, by name: the directory name, or the path as given when two "
                            "directories share a name (default all); the table always has every run")
    p_cmp.set_defaults(func=_compare)
    p_plot = sub.add_parser("plot", parents=[debug],
                            help="average-accuracy and first-task plots from saved accuracy matrices")
    p_plot.add_argument("matrices", nargs="+", metavar="MATRIX_CSV",
                        help="accuracy_matrix_<mode>.csv files of runs (one row per task end, one column per task)")
    p_plot.add_argument("--labels", nargs="+", metavar="LABEL",
                        help="one legend label per matrix (default: '<run directory> (<mode>)' for a run's "
                             "accuracy_matrix_<mode>.csv, else the file name without _accuracy_matrix_mean)")
    p_plot.add_argument("--out", default="plot", help="where to write plotted.csv/.md and the plots")
    p_plot.set_defaults(func=_plot)
    return parser


# The failures a user can cause and fix (a config, a file, a directory, the disk): one line, exit 2. Anything else
# is a bug of ours and keeps its traceback.
USER_ERRORS = (ConfigError, CheckpointError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # e.g. `foovb configs | head -1`: the reader left, nothing to report
        send_to_devnull(sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # before or after a run's own handling (e.g. while importing torch)
        if args.debug:
            traceback.print_exc()
        print("foovb: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        if args.debug:  # the traceback too, the same exit status
            traceback.print_exc()
        text = error
        if isinstance(error, OSError) and error.strerror:
            text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
        print(f"foovb: error: {' '.join(str(text).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
