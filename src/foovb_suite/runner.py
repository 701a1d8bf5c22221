"""A run (`run`): stream -> learner -> evaluation as a config says, with checkpoints, resume and plain-file outputs,
in a run directory that one run at a time holds. It builds the pieces (`factories`), checks what --resume continues
(`resume`), hands the iterations to the training loop (`loop`) under the deferred Ctrl-C (`signals`) and writes the
outputs (`outputs`); `loading` reads a run directory back.

Run directory layout:
    config.yaml              the resolved config
    run.json                 the run's identity, drawn when it started ({"run_id": ...}); every checkpoint records it
                             and the config it computes with, and --resume refuses a checkpoint of another run
    metrics.jsonl            one record per evaluation (iteration, stage, per-task accuracy per mode, NLL, ECE),
                             rewritten after every evaluation: readable while the run goes on
    metrics.csv              the same, one row per (evaluation, task, mode)
    accuracy_matrix_<mode>.csv   rows: evaluations, columns: tasks
    summary.json             final average / first-task accuracy, forgetting, BWT per mode, timing, hardware, device
    stds.npz                 posterior STDs at every evaluation (Bayesian learners)
    checkpoint.pt            learner state + iteration + records + STDs + the run it belongs to (for --resume,
                             `load_learner` and `load_model`); tensors and plain Python values only: torch.load's
                             default weights_only=True loads it
    plots/*.png              average accuracy, first-task accuracy, accuracy matrix, STD histograms, schedule
    tensorboard/             with `tensorboard: true` (--tensorboard): TensorBoard event files written during the run
                             (the training loss, the accuracies, the posterior STDs: `foovb_suite.tensorboard_log`)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from foovb import distributed

from .config import Config, ConfigError, config_to_dict, what_it_computes
from .custom import model_record
from .evaluation import metrics_per_mode
from .factories import build_learner, build_scenario, resolve_device
from .learners import Learner
from .loading import load_learner_state, load_run, read_checkpoint
from .loop import TrainingLoop
from .metrics import ACCURACY_MODES
from .outputs import file_digest, write_outputs, write_text
from .resume import RUN_FILE, check_config_unchanged, run_disagrees, run_identity
from .rundir import CheckpointError, RunDirectoryBusy, RunLock, make_directory, not_a_file
from .scenarios.in_memory import data_digest
from .signals import StderrWhileReadable, deferred_interrupt
from .tensorboard_log import TensorBoardLog, require_tensorboard

__all__ = ["RunResult", "run"]

RunResult = dict[str, Any]


# the files a run writes in its directory (besides checkpoint.pt, run.json, plots/ and tensorboard/)
OUTPUT_FILES = ("config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "stds.npz",
                *(f"accuracy_matrix_{mode}.csv" for mode in ACCURACY_MODES))


def run(config: Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
        stop_after: int | None = None) -> RunResult:
    """Train and evaluate as the config says, writing everything to `run_dir`.

    Args:
        resume: continue from `run_dir/checkpoint.pt` (same final result as an uninterrupted run).
        progress: show a tqdm progress bar.
        stop_after: stop after this many iterations (simulates an interruption; for tests).
    Returns the summary (also in summary.json).
    Raises:
        TrainingDiverged: on a NaN/Inf loss or gradients; the message says what to change and what was saved.
        RunInterrupted: on Ctrl-C or SIGTERM. The first one lets the current iteration (and its evaluation)
            finish and checkpoints it, so that `resume` continues as if uninterrupted; a second one stops at once,
            keeping the last checkpoint. Checkpoints are also written every `checkpoint_every` iterations and at
            most `checkpoint_minutes` apart.
        RunDirectoryBusy: another live run holds `run_dir` (its lock, `rundir.RunLock`).
        rundir.CheckpointError: `resume` from a checkpoint that is unreadable, foreign or altered.
    """
    run_dir = Path(run_dir)
    device = resolve_device(config.device)
    # under torchrun: MC-parallel FOO-VB (docs/distributed.md); only rank 0 writes files.
    try:
        distributed_run = distributed.setup_run(config.learner.kind, device)
    except ValueError as error:  # a baseline under torchrun
        raise ConfigError(f"learner.kind: {error}") from None
    if distributed_run and device.type == "cuda":  # NCCL: every process on its own GPU (LOCAL_RANK)
        device = torch.device("cuda", torch.cuda.current_device())
    main_process = not distributed_run or torch.distributed.get_rank() == 0
    if config.tensorboard and main_process:  # before anything is written
        require_tensorboard()
    if config.threads:
        torch.set_num_threads(config.threads)
    if resume and not distributed_run and (summary := _finished_summary(run_dir, config)) is not None:
        return summary
    try:
        scenario = build_scenario(config)
    except ConfigError:
        raise
    except ValueError as error:  # the data files or the scenario's settings (e.g. a train_subset above the data)
        raise ConfigError(f"scenario: {error}") from error
    if config.evaluation.test_subset is not None:  # x[:n] would take them all, and the config say n
        smallest = min(len(scenario.test_set(task)[1]) for task in range(scenario.num_tasks))
        if config.evaluation.test_subset > smallest:
            raise ConfigError(f"evaluation.test_subset must be in [1, {smallest}] (the smallest test set), got "
                              f"{config.evaluation.test_subset}")
    # a bad learner config fails before anything is written, and before the run directory is looked at (its
    # error names the key, not "already holds a finished run")
    learner = build_learner(config, scenario, device)
    if resume and (busy := RunLock.busy_message(run_dir)) is not None:  # before a first checkpoint too
        raise RunDirectoryBusy(busy)
    if resume and not (run_dir / "checkpoint.pt").is_file():
        kind = not_a_file(run_dir / "checkpoint.pt")
        raise FileNotFoundError(f"--resume: {run_dir / 'checkpoint.pt'} is {kind}, not a checkpoint file" if kind
                                else f"--resume: no checkpoint at {run_dir / 'checkpoint.pt'}")
    if not resume and not any((run_dir / name).exists() for name in (RUN_FILE, "checkpoint.pt", "summary.json")):
        # not a run's directory (those hold one of these three): its files are the user's
        taken = sorted(name for name in OUTPUT_FILES if (run_dir / name).exists())
        if taken:  # (checked before the lock, whose file would be left there)
            raise FileExistsError(f"{run_dir} holds {', '.join(taken)} but no run ({RUN_FILE}): a run there would "
                                  f"overwrite {'it' if len(taken) == 1 else 'them'} (your own config.yaml?); choose "
                                  "a new or empty directory with --out")
    with RunLock(run_dir) if main_process else contextlib.nullcontext() as lock:  # one writer per run directory
        return _run_locked(config, run_dir, scenario, learner, device, distributed_run, main_process, resume=resume,
                           progress=progress, stop_after=stop_after,
                           confirm_lock=lock.confirm if lock is not None else lambda: None)


def _run_locked(config: Config, run_dir: Path, scenario, learner: Learner, device: torch.device,
                distributed_run: bool, main_process: bool, *, resume: bool, progress: bool,
                stop_after: int | None, confirm_lock: Callable[[], None]) -> RunResult:
    """`run` once its directory is locked: check what the directory holds, resume or start, train, write outputs."""
    checkpoint_path = run_dir / "checkpoint.pt"
    if not resume and (run_dir / "summary.json").exists():
        raise FileExistsError(f"{run_dir} already holds a finished run; choose another directory or --resume")
    if not resume and checkpoint_path.exists():
        raise FileExistsError(f"{run_dir} holds an unfinished run ({checkpoint_path.name}): continue it with "
                              "--resume, or choose another directory")
    resolved = config_to_dict(config)
    if resume:
        check_config_unchanged(run_dir, resolved)
    state = read_checkpoint(checkpoint_path) if resume else None
    data = data_digest(scenario)
    model = model_record(config.model, learner.model)
    run_id = run_identity(run_dir, checkpoint_path, state, what_it_computes(resolved), data, scenario, model,
                          warn=main_process)
    if state is not None:
        load_learner_state(learner, state, checkpoint_path)
    if distributed_run:  # every rank then holds rank 0's posterior and noise generator
        try:
            distributed.distribute(learner.optimizer, "mc")
        except ValueError as error:  # fewer samples than processes, or processes built with different settings
            raise ConfigError(f"torchrun: {error}") from None
    if main_process:
        make_directory(run_dir / "plots")
        confirm_lock()
        _write_run_files(run_dir, run_id, resolved, config_too=True, new_run=state is None)
    board = None
    if config.tensorboard and main_process:  # a resumed run's points follow its checkpoint's iteration
        board = TensorBoardLog(run_dir / "tensorboard", config.tensorboard_every, 0 if state is None
                               else state["iteration"])
    loop = TrainingLoop(config, scenario, learner, device, checkpoint_path, main_process, state, confirm_lock,
                        {"id": run_id, "config": what_it_computes(resolved), "data": data, "model": model}, board)
    bar = None
    if progress and main_process:
        from tqdm import tqdm

        bar = tqdm(total=scenario.num_iterations, initial=loop.start, desc=config.name, unit="it",
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 60.0, file=StderrWhileReadable())
    # the outputs are written inside the block too: a signal while they are written waits for them to be complete
    with deferred_interrupt(enabled=not distributed_run) as interrupt_requested:
        try:
            stopped_at = loop.train(bar, stop_after, interrupt_requested)
        finally:
            if bar is not None:
                bar.close()
            if board is not None:  # the end of the run, an interruption, a divergence
                board.close()
        if stopped_at is not None:
            return {"interrupted_at": stopped_at}
        interrupt_requested.then = ("training has ended: writing the run's outputs, then exiting (again: stop at "
                                    "once; --resume writes them)")
        summary = _final_summary(config, scenario, learner, device, distributed_run, loop)
        if main_process:
            confirm_lock()
            _write_run_files(run_dir, run_id, resolved, config_too=False)  # deleted during the run: restored
            write_outputs(run_dir, loop.records, summary, loop.stds, scenario, config)
    return summary


def _write_run_files(run_dir: Path, run_id: str, resolved: dict[str, Any], *, config_too: bool,
                     new_run: bool = False) -> None:
    """run.json for a `new_run` (over the one of an attempt killed before its first checkpoint, which would make
    this run's checkpoint and summary read as copied from another run) or where it is missing (a run begun before
    runs had an identity, or one deleted during the run), and config.yaml (`config_too`: at the start, with this
    command line's execution keys; else where it is missing): a finished run can be compared and resumed."""
    if new_run or not (run_dir / RUN_FILE).is_file():
        write_text(run_dir / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")
    if config_too or not (run_dir / "config.yaml").is_file():
        write_text(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))


def _finished_summary(run_dir: Path, config: Config) -> RunResult | None:
    """--resume of a run that finished with whole outputs: its summary, with no data loaded, nothing trained or
    rewritten (a rewrite recorded the command line's threads as the run's; the checkpoint is read, to warn where it is
    damaged or another run's); None where there is a run to continue, outputs to rebuild from the checkpoint
    (damaged, missing or changed since: summary.json's digests), a live run in the directory, or a config that
    differs."""
    if not (run_dir / "summary.json").is_file() or RunLock.busy_message(run_dir) is not None:
        return None
    try:
        check_config_unchanged(run_dir, config_to_dict(config))  # else the usual path says what is wrong
        summary = load_run(run_dir)["summary"]
    except (OSError, ValueError, ConfigError, CheckpointError):  # damaged: the resume rebuilds the outputs
        return None
    changed = [name for name, digest in summary.get("outputs", {}).items() if file_digest(run_dir / name) != digest]
    if changed:  # deleted, emptied or copied over since the run wrote them (summaries before session 56: unchecked)
        print(f"foovb: {run_dir}: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} missing or changed "
              "since the run wrote them: rebuilding the outputs from its checkpoint", file=sys.stderr)
        return None
    try:
        state = read_checkpoint(run_dir / "checkpoint.pt")
        problem = run_disagrees(run_dir, state.get("run"), config, "checkpoint.pt")
    except (OSError, CheckpointError) as error:
        problem = str(error)
    if problem is not None:
        print(f"foovb: warning: {run_dir}'s results are whole, but its checkpoint cannot give the trained model "
              f"(load_model, load_learner): {problem}", file=sys.stderr)
    print(f"foovb: {run_dir} holds a finished run: nothing to resume", file=sys.stderr)
    return summary


def _final_summary(config: Config, scenario, learner: Learner, device: torch.device, distributed_run: bool,
                   loop: TrainingLoop) -> RunResult:
    """summary.json of a finished run."""
    records, train_seconds, ends = loop.records, loop.train_seconds, loop.ends
    return {
        "name": config.name,
        "learner": getattr(learner, "name", config.learner.kind),
        "scenario": config.scenario.kind,
        "num_tasks": scenario.num_tasks,
        "iterations": scenario.num_iterations,
        "train_seconds": train_seconds,
        "seconds_per_iteration": train_seconds / max(scenario.num_iterations, 1),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                    f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "device": str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})",
        "processes": torch.distributed.get_world_size() if distributed_run else 1,
        "modes": metrics_per_mode(records, ends, scenario.num_tasks),
        # what `foovb compare` checks the files by, the custom scenario's data and model (SHA-256; null for built-ins)
        "run": {key: loop.run[key] for key in ("id", "config", "data", "model")},
    }
