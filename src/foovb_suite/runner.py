"""The experiment loop: stream -> learner -> evaluation, with checkpoints, resume and plain-file outputs.

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

import bisect
import contextlib
import csv
import io
import json
import math
import os
import platform
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from foovb import FOOVB, distributed
from foovb.priors import XAVIER

from . import metrics, plots
from .baselines import BASELINES
from .config import (
    EXECUTION_KEYS,
    EXECUTION_SCENARIO_KEYS,
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    is_continuous,
    parse_yaml,
    what_it_computes,
)
from .learners import LEARNERS, Learner, learner_hyperparameters, make_learner, make_model
from .metrics import ACCURACY_MODES, PROBABILITY_MODES
from .rundir import (
    CheckpointError,
    RunLock,
    load_checkpoint,
    make_directory,
    not_a_file,
    save_checkpoint,
    send_to_devnull,
    write_atomically,
)
from .scenarios import data_digest
from .tensorboard_log import TensorBoardLog, require_tensorboard

__all__ = ["build_scenario", "run", "RunResult", "RunInterrupted", "TrainingDiverged", "load_learner", "load_model",
           "load_run", "resolve_device", "tasks_seen"]

RunResult = dict[str, Any]


def build_scenario(config: Config):
    """The data stream of the config (imported lazily: MNIST loads in about a second). The custom scenario's
    factory is imported as `foovb_suite.custom` says (a `ConfigError` naming it if it fails)."""
    from .custom import custom_tasks
    from .scenarios import (
        ContinuousPermutedMNIST,
        ContinuousTasks,
        DiscretePermutedMNIST,
        DiscreteTasks,
        JointStream,
        PermutedMNIST,
        RotatedMNIST,
        SplitMNIST,
        VisionMix,
    )

    s = config.scenario
    if s.kind == "custom":
        tasks = custom_tasks(s)
        if s.mode == "discrete":
            scenario = DiscreteTasks(tasks, s.epochs_per_task, s.batch_size, s.seed)
        else:
            scenario = ContinuousTasks(tasks, s.iterations_per_task, s.batch_size, s.seed, s.eval_every)
    elif s.kind == "vision_mix":
        scenario = VisionMix(s.datasets[: s.num_tasks], s.data_dir, s.epochs_per_task, s.batch_size, s.seed,
                             s.train_subset, s.task_agnostic)
    elif s.kind == "rotated_mnist":
        images = PermutedMNIST(1, s.seed, s.pad_to_32, s.normalization)
        scenario = RotatedMNIST(images, s.num_tasks, s.iterations_per_task, s.batch_size, s.max_angle, s.seed,
                                s.eval_every)
    elif s.kind == "split_mnist":
        images = PermutedMNIST(1, s.seed, s.pad_to_32, s.normalization)
        scenario = SplitMNIST(images, s.num_tasks, s.epochs_per_task, s.batch_size, s.seed)
    else:
        benchmark = PermutedMNIST(s.num_tasks, s.seed, s.pad_to_32, s.normalization)
        if s.kind == "discrete_permuted_mnist":
            scenario = DiscretePermutedMNIST(benchmark, s.epochs_per_task, s.batch_size, s.seed, s.train_subset)
        else:
            scenario = ContinuousPermutedMNIST(benchmark, s.iterations_per_task, s.batch_size, s.seed,
                                               s.eval_every)
    return JointStream(scenario, s.seed) if s.joint else scenario


# learner arguments that the runner sets itself: from the top-level `seed` and the scenario's tasks and classes
RUNNER_ARGUMENTS = ("seed", "num_heads", "classes_per_head")


def build_learner(config: Config, scenario, device: torch.device) -> Learner:
    """The config's model (seeded by `config.seed`) on `device`, wrapped in its learner. A learner kind or
    parameter that does not fit raises `ConfigError` naming the key."""
    kind, params = config.learner.kind, config.learner.params
    if kind not in LEARNERS:
        raise ConfigError(f"learner.kind: unknown learner {kind!r} (known: {', '.join(LEARNERS)})")
    for name in RUNNER_ARGUMENTS:
        if name in params:
            raise ConfigError(f"learner.params.{name}: set by the runner (from `seed` and the scenario), "
                              "not a learner parameter")
    if getattr(BASELINES.get(kind), "needs_task_ids", False) and not scenario.task_aware:
        raise ConfigError(f"learner.kind: {kind!r} needs task ids, and {config.scenario.kind} is task-agnostic")
    torch.manual_seed(config.seed)
    num_heads = scenario.num_tasks if scenario.task_aware else 1
    if config.model.kind == "custom":
        from .custom import custom_model

        model = custom_model(config.model, scenario.input_shape, scenario.num_classes * num_heads, device)
    else:
        if config.model.kind == "lenet" and len(scenario.input_shape) != 3:
            raise ConfigError(f"model.kind: the lenet model takes images (channels, height, width); the "
                              f"{config.scenario.kind} scenario's inputs have shape {tuple(scenario.input_shape)}")
        model = make_model(config.model.kind, scenario.input_shape, scenario.num_classes, num_heads,
                           config.model.hidden, config.model.bias).to(device)
    try:
        return make_learner(kind, model, num_heads=num_heads, classes_per_head=scenario.num_classes,
                            seed=config.seed, **params)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"learner.params: {error}") from error


def resolve_device(name: str) -> torch.device:
    """The torch device of config key `device`: "auto" is CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} asked for, but torch {torch.__version__} sees no CUDA GPU "
                              "(--set device=auto or device=cpu; a run directory's config records the device it "
                              "last ran on)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def task_ends(config: Config, scenario) -> list[int]:
    """Iteration count at which each task's period ends (stage boundaries for "tasks seen so far")."""
    if is_continuous(config.scenario):
        d = config.scenario.iterations_per_task
        return [(t + 1) * d for t in range(scenario.num_tasks)]
    inner = getattr(scenario, "scenario", scenario)  # JointStream wraps the sequential scenario
    return list(inner.eval_points)


def tasks_seen(records: list[dict], config: Config) -> list[float]:
    """The x values of the curve plots: the task count at each evaluation (stage + 1), fractional in the
    continuous scenario, whose evaluations every `eval_every` iterations fall inside task periods."""
    if is_continuous(config.scenario):
        return [r["iteration"] / config.scenario.iterations_per_task for r in records]
    return [r["stage"] + 1 for r in records]


def _write_text(path: Path, text: str) -> None:
    write_atomically(text.encode(), path)


class _Evaluator:
    """Accuracy of every task's test set in every prediction mode the learner supports."""

    def __init__(self, scenario, test_subset: int | None, device: torch.device):
        self.test_sets = []
        for task in range(scenario.num_tasks):
            x, y = scenario.test_set(task)
            self.test_sets.append((x[:test_subset].to(device), y[:test_subset].to(device)))

    def __call__(self, learner: Learner, task_aware: bool) -> dict[str, Any]:
        accuracy: dict[str, list[float]] = {}
        calibration: dict[str, dict[str, list[float]]] = {"nll": {}, "ece": {}}
        for task, (x, y) in enumerate(self.test_sets):
            pred = _predict_in_chunks(learner, x, task if task_aware else None)
            modes = ACCURACY_MODES if pred.samples is not None else ("mean",)
            for mode in modes:
                accuracy.setdefault(mode, []).append(metrics.accuracy(pred, y, mode))
            for mode in PROBABILITY_MODES if pred.samples is not None else ("mean",):
                probs = metrics.mode_probabilities(pred, mode)
                calibration["nll"].setdefault(mode, []).append(metrics.nll(probs, y))
                calibration["ece"].setdefault(mode, []).append(metrics.ece(probs, y))
        return {"accuracy": accuracy, **calibration}


def _predict_in_chunks(learner: Learner, x: torch.Tensor, task: int | None, rows: int = 2500):
    parts = [learner.predict(x[i : i + rows], task) for i in range(0, len(x), rows)]
    samples = None if parts[0].samples is None else torch.cat([p.samples for p in parts], 1)
    return metrics.Predictions(torch.cat([p.mean for p in parts]), samples)


def _average_so_far(record: dict) -> float:
    """Average posterior-mean accuracy over the tasks seen by an evaluation (the progress bar's avg_acc)."""
    return float(np.mean(record["accuracy"]["mean"][: record["stage"] + 1]))


def _summary(records: list[dict], ends: list[int], num_tasks: int) -> dict[str, Any]:
    """Final metrics per mode from the evaluation records."""
    out: dict[str, Any] = {}
    last = records[-1]
    for mode in last["accuracy"]:
        matrix = np.array([r["accuracy"][mode] for r in records])
        seen = np.array([[j <= r["stage"] for j in range(num_tasks)] for r in records])
        average = np.where(seen, matrix, 0).sum(1) / seen.sum(1)
        entry = {"average_accuracy": float(average[-1]), "first_task_accuracy": float(matrix[-1, 0]),
                 "average_accuracy_curve": average.tolist()}
        at_ends = [i for i, r in enumerate(records) if r["iteration"] in ends]
        if len(at_ends) == num_tasks and num_tasks > 1:
            square = np.where(np.tril(np.ones((num_tasks, num_tasks), bool)), matrix[at_ends], np.nan)
            entry["forgetting"] = metrics.forgetting(square)
            entry["backward_transfer"] = metrics.backward_transfer(square)
        out[mode] = entry
    return out


class TrainingDiverged(FloatingPointError):
    """Training met non-finite values (a NaN/Inf loss or gradients). The message says where, what to change and
    what was saved; `checkpoint_iteration`: the iteration of the checkpoint left in the run directory (None: none).

    A learner that raises FloatingPointError refuses the step (FOO-VB leaves its posterior unchanged), so its
    state is that of the iterations done and is checkpointed; a learner that returns a non-finite loss has taken the
    step (a baseline's weights may already be NaN), so the last periodic checkpoint is kept as it was."""

    def __init__(self, message: str, checkpoint_iteration: int | None):
        super().__init__(message)
        self.checkpoint_iteration = checkpoint_iteration


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run (a KeyboardInterrupt, so `except KeyboardInterrupt` still catches it); the
    message says what was saved. `checkpoint_iteration`: where `--resume` continues (None: no checkpoint);
    `signal_number`: the signal (SIGINT for a KeyboardInterrupt raised otherwise)."""

    def __init__(self, message: str, checkpoint_iteration: int | None, signal_number: int = signal.SIGINT):
        self.signal_number = int(signal_number)
        super().__init__(message)
        self.checkpoint_iteration = checkpoint_iteration


class _StopNow(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: stop at once (`signal_number`: which one, for the exit status)."""

    def __init__(self, signal_number: int):
        super().__init__()
        self.signal_number = signal_number


class _StderrWhileReadable:
    """The progress bar's stream: sys.stderr until a write fails (a `| tee` stopped by Ctrl-C, a closed terminal),
    then nothing, so that the run goes on to its checkpoint instead of dying in the bar's BrokenPipeError."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except OSError:
            send_to_devnull(2)
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except OSError:
            send_to_devnull(2)

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stderr, name)


@contextlib.contextmanager
def _deferred_interrupt(enabled: bool) -> Iterator[Callable[[], int | None]]:
    """Within the block, a first Ctrl-C (SIGINT) or SIGTERM (what SLURM, Kubernetes and `timeout` send before a
    kill) only records the signal, returned by a function that the training loop checks between iterations, so that
    no step or evaluation is cut in half and the run checkpoints before it stops; a second one raises
    KeyboardInterrupt at once. Not `enabled` (distributed runs, whose processes could stop at different
    iterations), or outside the main thread (where no signal handler can be set), the signals act as usual."""
    requested: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def handler(signum: int, frame: Any) -> None:
        if requested:
            raise _StopNow(signum)
        requested.append(signum)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        try:  # os.write: print could re-enter a write to stderr that the signal cut
            os.write(2, f"\nfoovb: {name}: stopping after this iteration (again: stop at once, keeping the last "
                        "checkpoint)\n".encode())
        except OSError:  # stderr's reader is gone (`| tee`, which the same Ctrl-C stopped): checkpoint all the same
            send_to_devnull(2)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: requested[0] if requested else None
    finally:
        for signum, handler_before in previous.items():
            default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, handler_before if handler_before is not None else default)


def _divergence_advice(learner: Learner) -> str:
    """The config changes that make a diverging run stable, with the learner's current values."""
    optimizer = getattr(learner, "optimizer", None)
    if isinstance(optimizer, FOOVB):
        group = optimizer.param_groups[0]
        changes = [f"a larger learner.params.mc_samples (now {group['mc_samples']}; at least 4)"]
        if group.get("posterior") == "diagonal" and group.get("std_growth") == "paper":
            changes.append("learner.params.std_growth=none or capped (now paper)")
        if group.get("std_init") == XAVIER:
            changes.append("a learner.params.std_init below the layers' own (now xavier: sqrt(2 / (fan_in + fan_out)), "
                           "0.047 on a 784 -> 100 layer)")
        elif group.get("std_init") is not None:
            changes.append(f"a smaller learner.params.std_init (now {group['std_init']:g})")
        if not group.get("antithetic"):
            changes.append("learner.params.antithetic=true")
    elif optimizer is not None and "lr" in optimizer.param_groups[0]:
        changes = [f"a smaller learner.params.lr (now {optimizer.param_groups[0]['lr']:g})"]
    else:
        changes = ["other learner.params"]
    return f"try, in a new run directory (another --out): {', '.join(changes)}"


def _load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by `_TrainingLoop.save` (`rundir.load_checkpoint`: weights_only=True, its digest
    checked), the STDs back as numpy arrays."""
    state = load_checkpoint(path)  # on the CPU: load_state_dict places the tensors
    state["stds"] = {key: value.numpy() for key, value in state["stds"].items()}
    return state


RUN_FILE = "run.json"


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {"learner.params.lr": 0.05, ...}."""
    if not isinstance(config, dict):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _with_defaults(computed: dict[str, Any]) -> dict[str, Any]:
    """A computed config (`what_it_computes`) as recorded in a checkpoint, with the keys added to `Config` since it
    was written at their defaults (as is, if it no longer parses)."""
    try:
        return what_it_computes(config_to_dict(config_from_dict(computed)))
    except ConfigError:
        return computed


def _run_identity(run_dir: Path, checkpoint_path: Path, state: dict[str, Any] | None, computed: dict[str, Any],
                  data: str | None, scenario) -> str:
    """The identity of the run in `run_dir`: a new one for a new run; on --resume, the one run.json holds, after
    checking that the checkpoint `state` belongs to it: the same identity, the same computed config as config.yaml
    and the command line (`computed`), the same data (`data`: the custom scenario's digest), records that fit this
    scenario. A checkpoint of another run, copied in, one written under another config (config.yaml edited since)
    or on other data (a factory that returns other data now) is a CheckpointError naming what differs."""
    advice = "resume it in its own run directory, or start a new run in another directory (--out)"
    recorded = _read_run_id(run_dir)
    if state is None:
        return secrets.token_hex(8)
    _check_records(state, scenario, checkpoint_path)
    run = state.get("run")
    if run is None:  # a checkpoint written before checkpoints recorded their run
        print(f"foovb: warning: {checkpoint_path} was written by an earlier foovb that did not record its run: "
              f"that it belongs to this directory is not verified", file=sys.stderr)
        return recorded or secrets.token_hex(8)
    if run["id"] != recorded:
        here = f"this directory's {RUN_FILE} says {recorded}" if recorded else f"this directory has no {RUN_FILE}"
        raise CheckpointError(f"--resume: {checkpoint_path} belongs to another run (run {run['id']}; {here}): it "
                              f"was copied from another run directory; {advice}")
    saved, here = _flatten(_with_defaults(run["config"])), _flatten(computed)
    changed = sorted(key for key in saved.keys() | here.keys() if saved.get(key) != here.get(key))
    if changed:
        details = "; ".join(f"{key}: checkpoint {saved.get(key, '(absent)')!r}, config.yaml and command line "
                            f"{here.get(key, '(absent)')!r}" for key in changed[:6])
        raise CheckpointError(f"--resume: {checkpoint_path} was written under another config than "
                              f"{run_dir / 'config.yaml'} says ({details}{'; ...' if len(changed) > 6 else ''}): "
                              f"config.yaml was edited after the run started; restore it, or start a new run")
    if run.get("data") != data:
        raise CheckpointError(f"--resume: scenario.factory {computed['scenario']['factory']!r} returns other data "
                              f"than when the run started (SHA-256 {data}, the checkpoint's {run.get('data')}): a "
                              "factory must return the same data at every call (seed its randomness, e.g. from its "
                              "args); restore it, or start a new run")
    return recorded


def _read_run_id(run_dir: Path) -> str | None:
    """The identity in `run_dir`'s run.json (None: no such file); a CheckpointError for a damaged one."""
    path = run_dir / RUN_FILE
    if not path.exists():
        return None
    try:
        run_id = json.loads(path.read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a run identity file ({{\"run_id\": ...}}): {error}") from None
    if not isinstance(run_id, str):
        raise CheckpointError(f"{path} is not a run identity file: its run_id is {run_id!r}")
    return run_id


def _check_records(state: dict[str, Any], scenario, path: Path) -> None:
    """A CheckpointError unless the checkpoint's iteration and evaluation records fit `scenario` (its number of
    tasks and iterations): a checkpoint of a run with other tasks."""
    num_tasks, num_iterations = scenario.num_tasks, scenario.num_iterations
    problem = None
    if not (isinstance(state["iteration"], int) and 0 <= state["iteration"] <= num_iterations):
        problem = f"it stopped at iteration {state['iteration']!r}, this run has {num_iterations}"
    for record in state["records"] if isinstance(state["records"], list) else [None]:
        if problem is not None:
            break
        try:
            widths = {len(values) for values in record["accuracy"].values()}
            if widths != {num_tasks} or not 0 <= record["stage"] < num_tasks:
                problem = f"its evaluations cover {sorted(widths)} tasks, this run has {num_tasks}"
        except (TypeError, KeyError, AttributeError):
            problem = "its evaluation records are malformed"
    if problem is not None:
        raise CheckpointError(f"{path} does not fit this run's scenario ({problem}): resume it with the config it "
                              "was written with, or start a new run")


def _load_learner_state(learner: Learner, state: dict[str, Any], path: Path) -> None:
    """The checkpoint's learner state into `learner`; a state of another model or learner is a CheckpointError."""
    try:
        learner.load_state_dict(state["learner"])
    except (ValueError, KeyError, RuntimeError, TypeError) as error:
        raise CheckpointError(f"{path} does not fit this run's learner and model ({' '.join(str(error).split())}): "
                              "resume it with the config it was written with (the run directory's config.yaml), "
                              "or start a new run") from error
    bad = next((name for name, p in learner.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise CheckpointError(f"{path} holds non-finite weights ({bad}): no run checkpoints such weights, so the file "
                              "was altered or written by something else; start a new run, or restore the file")


class _TrainingLoop:
    """The iterations of a run from `start`: observe, evaluate at the scenario's eval points, checkpoint (at the
    evaluations and every `checkpoint_every` iterations), and stop cleanly on divergence and Ctrl-C."""

    def __init__(self, config: Config, scenario, learner: Learner, device: torch.device, checkpoint_path: Path,
                 main_process: bool, state: dict[str, Any] | None, confirm_lock: Callable[[], None],
                 run: dict[str, Any], board: TensorBoardLog | None = None):
        self.config, self.scenario, self.learner, self.device = config, scenario, learner, device
        self.board = board  # the TensorBoard log (`tensorboard: true`, main process), or None
        self.run = run  # what every checkpoint records it belongs to: the run's identity, computed config, data
        self.checkpoint_path, self.main_process, self.confirm_lock = checkpoint_path, main_process, confirm_lock
        self.saved_at: int | None = None if state is None else state["iteration"]  # the checkpoint on disk
        state = state or {"iteration": 0, "records": [], "train_seconds": 0.0, "stds": {}}
        self.start: int = state["iteration"]
        self.records: list[dict] = state["records"]
        self.train_seconds: float = state["train_seconds"]
        self.stds: dict[str, np.ndarray] = state["stds"]
        self.evaluator = _Evaluator(scenario, config.evaluation.test_subset, device)
        self.ends = task_ends(config, scenario)
        self.eval_points = set(scenario.eval_points)
        self.tic = self.saved_tic = time.perf_counter()  # saved_tic: when the last checkpoint was written

    def save(self, iteration: int) -> None:
        """Checkpoint the learner after `iteration` iterations, with the records and STDs so far (tensors and plain
        Python values only: torch.load's default weights_only=True loads it). Non-finite weights are not saved."""
        self._check_finite_weights(iteration)
        self.train_seconds += time.perf_counter() - self.tic
        if self.main_process:
            self.confirm_lock()  # never two runs writing one directory (RunLock.confirm)
            stds = {key: torch.from_numpy(value) for key, value in self.stds.items()}
            save_checkpoint({"learner": self.learner.state_dict(), "iteration": iteration, "records": self.records,
                             "train_seconds": self.train_seconds, "stds": stds, "run": self.run},
                            self.checkpoint_path)
            self.saved_at = iteration
        self.tic = self.saved_tic = time.perf_counter()

    def train(self, bar, stop_after: int | None, interrupt_requested: Callable[[], bool]) -> int | None:
        """Train to the end (returns None) or to `stop_after` iterations (returns it, checkpointed). Raises
        `TrainingDiverged` and, on Ctrl-C, `RunInterrupted` (checkpointed after the last completed iteration
        unless a second Ctrl-C stopped it at once)."""
        try:
            return self._iterate(bar, stop_after, interrupt_requested)
        except RunInterrupted:
            raise
        except KeyboardInterrupt as error:
            raise RunInterrupted(self._kept_checkpoint(), self.saved_at,
                                 getattr(error, "signal_number", signal.SIGINT)) from error

    def _iterate(self, bar, stop_after: int | None, interrupt_requested: Callable[[], bool]) -> int | None:
        running_loss, last_average = None, _average_so_far(self.records[-1]) if self.records else float("nan")
        for iteration, batch in self.scenario.batches(self.start):
            loss = self._observe(iteration, batch)
            running_loss = loss if running_loss is None else 0.98 * running_loss + 0.02 * loss
            done = iteration + 1
            if self.board is not None:
                self.board.loss(done, loss)
            evaluated = done in self.eval_points
            if evaluated:
                last_average = _average_so_far(self._evaluate(done))
            if bar is not None:
                bar.update(1)
                if done % 50 == 0 or evaluated:  # refresh=False: the bar redraws at its own interval (a log: 60 s)
                    bar.set_postfix(task=int(batch.task.float().mean().round()), loss=f"{running_loss:.3f}",
                                    avg_acc="-" if np.isnan(last_average) else f"{last_average:.4f}", refresh=False)
            if evaluated:
                self.save(done)
                if self.main_process:
                    write_metrics(self.checkpoint_path.parent, self.records)
            elif (done % self.config.checkpoint_every == 0
                  or time.perf_counter() - self.saved_tic >= 60 * self.config.checkpoint_minutes):
                self.save(done)
            stop = stop_after is not None and done >= stop_after
            signum = interrupt_requested()
            if stop or signum is not None:
                if self.saved_at != done:
                    self.save(done)
                if stop:
                    return done
                raise RunInterrupted(f"saved a checkpoint after {done} of {self.scenario.num_iterations} iterations "
                                     f"in {self.checkpoint_path}", done, signum)
        return None

    def _observe(self, iteration: int, batch) -> float:
        """One training step on `batch`; non-finite values raise `TrainingDiverged`."""
        task = None
        if self.scenario.task_aware:
            task = int(batch.task[0])
            if not bool((batch.task == task).all()):
                raise ValueError("a task-aware learner got a batch mixing several tasks: per-sample task heads are "
                                 "not supported")
        try:
            loss = self.learner.observe(batch.x.to(self.device), batch.y.to(self.device), task)
        except FloatingPointError as error:  # the step was refused: the learner is as after `iteration` iterations
            self.save(iteration)
            run_dir = str(self.checkpoint_path.parent)
            saved = (f"the state after {iteration} iterations is saved in {self.checkpoint_path} (the failed step "
                     f"changed nothing): foovb_suite.load_learner({run_dir!r}) inspects it; --resume retries "
                     "from it, with new noise")
            raise self._diverged(iteration, str(error), saved) from error
        if not math.isfinite(loss):  # the step was taken: keep the last checkpoint as it is
            raise self._diverged(iteration, f"the loss is {loss}", self._kept_checkpoint()
                                 + (" (--resume repeats the same steps)" if self.saved_at is not None else ""))
        return loss

    def _diverged(self, iteration: int, cause: str, saved: str) -> TrainingDiverged:
        task = min(bisect.bisect_right(self.ends, iteration), self.scenario.num_tasks - 1)
        what = (f"training diverged after {iteration} of {self.scenario.num_iterations} iterations (task {task + 1} "
                f"of {self.scenario.num_tasks}): {cause}")
        return TrainingDiverged("\n  ".join([what, _divergence_advice(self.learner), saved]), self.saved_at)

    def _check_finite_weights(self, iteration: int) -> None:
        """A step that made the weights non-finite returns the finite loss computed before it (the baselines):
        evaluated, such a model scores chance-level accuracy that looks like a result; stop instead."""
        if not all(bool(torch.isfinite(p).all()) for p in self.learner.model.parameters()):
            raise self._diverged(iteration, "the model's weights are not finite after the last step",
                                 self._kept_checkpoint())

    def _kept_checkpoint(self) -> str:
        if self.saved_at is None:
            return "no checkpoint had been written yet (nothing to resume)"
        return (f"the last checkpoint, after {self.saved_at} of {self.scenario.num_iterations} iterations, is kept "
                f"in {self.checkpoint_path}")

    def _evaluate(self, done: int) -> dict[str, Any]:
        """Evaluate every task after `done` iterations; append the record (and the posterior STDs)."""
        self._check_finite_weights(done)
        self.train_seconds += time.perf_counter() - self.tic
        stage = min(bisect.bisect_left(self.ends, done), self.scenario.num_tasks - 1)
        record = {"iteration": done, "stage": stage, **self.evaluator(self.learner, self.scenario.task_aware),
                  "train_seconds": self.train_seconds}
        self.records.append(record)
        if self.config.evaluation.histograms and hasattr(self.learner, "posterior_std"):
            self.stds[f"iteration_{done}"] = self.learner.posterior_std()
        if self.board is not None:
            self.board.evaluation(record, self.learner.posterior_stds() if hasattr(self.learner, "posterior_stds")
                                  else None)
        self.tic = time.perf_counter()
        return record


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
    try:
        scenario = build_scenario(config)
    except ConfigError:
        raise
    except ValueError as error:  # the data files or the scenario's settings (e.g. a train_subset above the data)
        raise ConfigError(f"scenario: {error}") from error
    # a bad learner config fails before anything is written, and before the run directory is looked at (its
    # error names the key, not "already holds a finished run")
    learner = build_learner(config, scenario, device)
    if resume and not (run_dir / "checkpoint.pt").is_file():
        kind = not_a_file(run_dir / "checkpoint.pt")
        raise FileNotFoundError(f"--resume: {run_dir / 'checkpoint.pt'} is {kind}, not a checkpoint file" if kind
                                else f"--resume: no checkpoint at {run_dir / 'checkpoint.pt'}")
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
    if resume:  # parsed, so that keys added to Config since the run started compare as their defaults
        saved = _flatten(what_it_computes(config_to_dict(saved_config(run_dir))))
        computed = _flatten(what_it_computes(resolved))
        changed = sorted(key for key in saved.keys() | computed.keys() if saved.get(key) != computed.get(key))
        if changed:
            details = ", ".join(f"{key}: {saved.get(key, '(absent)')!r} there, {computed.get(key, '(absent)')!r} here"
                                for key in changed[:6])
            raise ConfigError(f"--resume: the config differs from the one in {run_dir / 'config.yaml'} "
                              f"({details}{', ...' if len(changed) > 6 else ''}); only {', '.join(EXECUTION_KEYS)} "
                              f"and {', '.join('scenario.' + key for key in EXECUTION_SCENARIO_KEYS)} may change")
    state = _load_checkpoint(checkpoint_path) if resume else None
    data = data_digest(scenario)
    run_id = _run_identity(run_dir, checkpoint_path, state, what_it_computes(resolved), data, scenario)
    if state is not None:
        _load_learner_state(learner, state, checkpoint_path)
    if distributed_run:  # every rank then holds rank 0's posterior and noise generator
        try:
            distributed.distribute(learner.optimizer, "mc")
        except ValueError as error:  # fewer samples than processes, or processes built with different settings
            raise ConfigError(f"torchrun: {error}") from None
    if main_process:
        make_directory(run_dir / "plots")
        confirm_lock()
        if not (run_dir / RUN_FILE).is_file():  # a new run, or one begun before runs had an identity
            _write_text(run_dir / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")
        _write_text(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    board = None
    if config.tensorboard and main_process:  # a resumed run's points follow its checkpoint's iteration
        board = TensorBoardLog(run_dir / "tensorboard", config.tensorboard_every, 0 if state is None
                               else state["iteration"])
    loop = _TrainingLoop(config, scenario, learner, device, checkpoint_path, main_process, state, confirm_lock,
                         {"id": run_id, "config": what_it_computes(resolved), "data": data}, board)
    bar = None
    if progress and main_process:
        from tqdm import tqdm

        bar = tqdm(total=scenario.num_iterations, initial=loop.start, desc=config.name, unit="it",
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 60.0, file=_StderrWhileReadable())
    # the outputs are written inside the block too: a signal while they are written waits for them to be complete
    with _deferred_interrupt(enabled=not distributed_run) as interrupt_requested:
        try:
            stopped_at = loop.train(bar, stop_after, interrupt_requested)
        finally:
            if bar is not None:
                bar.close()
            if board is not None:  # the end of the run, an interruption, a divergence
                board.close()
        if stopped_at is not None:
            return {"interrupted_at": stopped_at}
        summary = _final_summary(config, scenario, learner, device, distributed_run, loop)
        if main_process:
            confirm_lock()
            write_outputs(run_dir, loop.records, summary, loop.stds, scenario, config)
    return summary


def _final_summary(config: Config, scenario, learner: Learner, device: torch.device, distributed_run: bool,
                   loop: _TrainingLoop) -> RunResult:
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
        "modes": _summary(records, ends, scenario.num_tasks),
    }


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    """metrics.jsonl and metrics.csv of the evaluations so far (after each one during a run, each file replaced
    whole: a reader never sees half of one)."""
    _write_text(run_dir / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in records))
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["iteration", "stage", "task", "mode", "accuracy", "nll", "ece"])
    for r in records:
        for mode, values in r["accuracy"].items():
            for task, value in enumerate(values):
                writer.writerow([r["iteration"], r["stage"], task, mode, value,
                                 r["nll"].get(mode, [None] * len(values))[task],
                                 r["ece"].get(mode, [None] * len(values))[task]])
    _write_text(run_dir / "metrics.csv", table.getvalue())


def write_outputs(run_dir: Path, records: list[dict], summary: dict, stds: dict[str, np.ndarray], scenario,
                  config: Config) -> None:
    """All plain-file outputs and plots of a finished run, each written whole; summary.json, which marks the run
    finished, last (a run killed before it is resumed with --resume, which writes them again)."""
    write_metrics(run_dir, records)
    for mode in records[-1]["accuracy"]:
        matrix, table = np.array([r["accuracy"][mode] for r in records]), io.StringIO()
        np.savetxt(table, matrix, delimiter=",", fmt="%.6f",
                   header=",".join(f"task_{t}" for t in range(matrix.shape[1])))
        _write_text(run_dir / f"accuracy_matrix_{mode}.csv", table.getvalue())
    if stds:
        archive = io.BytesIO()
        np.savez_compressed(archive, **stds)
        write_atomically(archive.getvalue(), run_dir / "stds.npz")
    plot_dir = run_dir / "plots"
    stages = tasks_seen(records, config)
    for mode, entry in summary["modes"].items():
        label = f"{summary['learner']} ({mode})"
        plots.plot_average_accuracy({label: (stages, entry["average_accuracy_curve"])},
                                    plot_dir / f"average_accuracy_{mode}.png")
        first = [r["accuracy"][mode][0] for r in records]
        plots.plot_first_task_accuracy({label: (stages, first)}, plot_dir / f"first_task_accuracy_{mode}.png")
        plots.plot_accuracy_matrix(np.array([r["accuracy"][mode] for r in records]),
                                   plot_dir / f"accuracy_matrix_{mode}.png")
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
        plots.plot_std_histograms(list(stds.values()), plot_dir / "std_histograms.png",
                                  initial_std=params["std_init"] if one_initial_std else None,
                                  labels=labels, title=title)
    if hasattr(scenario, "task_probabilities"):
        iterations = np.linspace(0, scenario.num_iterations - 1, 1000).astype(int)
        plots.plot_task_schedule(iterations, scenario.task_probabilities(iterations).numpy(),
                                 plot_dir / "task_schedule.png")
    _write_text(run_dir / "summary.json", json.dumps(summary, indent=2))


def experiment_key(config: dict[str, Any]) -> str:
    """What a run computes, up to its seeds: the resolved config (learner defaults filled in) without `name`,
    `seed`, `scenario.seed` and the execution keys (`what_it_computes`), as canonical JSON. Runs with equal keys
    are seeds of one experiment (`foovb compare`)."""
    resolved = what_it_computes(config_to_dict(config_from_dict(config)))
    for key in ("name", "seed"):
        resolved.pop(key)
    resolved["scenario"].pop("seed")
    learner = resolved["learner"]
    learner["params"] = learner_hyperparameters(learner["kind"], learner["params"])
    return json.dumps(resolved, sort_keys=True)


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's summary and records (for `foovb compare`)."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json (not a finished run)")
    try:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        summary = json.loads(summary_path.read_text())
        problem = _outputs_disagree(summary, records)
    except json.JSONDecodeError as error:  # a file cut short (a full disk, a copy stopped halfway)
        problem = str(error)
    if problem is not None:
        raise CheckpointError(f"{run_dir}: a damaged output file ({problem}); `foovb run CONFIG --out {run_dir} "
                              "--resume` rebuilds the outputs from its checkpoint")
    return {"dir": run_dir, "summary": summary, "records": records, "config": config_to_dict(saved_config(run_dir))}


def _outputs_disagree(summary: Any, records: list[Any]) -> str | None:
    """Why a run's summary.json and metrics.jsonl are not one run's (one cut short at a line boundary, emptied,
    copied from another run), or None: every mode's curve has one entry per record, and the first task's final
    accuracy is the last record's."""
    try:
        if not summary["modes"]:
            return "summary.json lists no evaluation modes"
        for mode, entry in summary["modes"].items():
            if len(entry["average_accuracy_curve"]) != len(records):
                return (f"summary.json's {mode} curve has {len(entry['average_accuracy_curve'])} evaluations, "
                        f"metrics.jsonl {len(records)}")
            if records[-1]["accuracy"][mode][0] != entry["first_task_accuracy"]:
                return f"metrics.jsonl's last {mode} evaluation is not the one summary.json ends with"
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        return f"summary.json or metrics.jsonl is not structured as a run's ({type(error).__name__}: {error})"
    return None


def saved_config(run_dir: str | Path) -> Config:
    """The config a run directory was started with (its config.yaml); a ConfigError naming that file if it is
    missing or damaged."""
    path = Path(run_dir) / "config.yaml"
    try:
        return config_from_dict(parse_yaml(path.read_text(), path.name))  # bounded depth and aliases
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing: the run directory's copy of the config it was started with; "
                          "restore it, or start the run in a new directory") from None
    except (yaml.YAMLError, UnicodeDecodeError, ConfigError) as error:
        what = " ".join(str(error).split())
        raise ConfigError(f"{path}, the config the run was started with, is damaged ({what}); restore it, "
                          "or start the run in a new directory") from None


def load_learner(run_dir: str | Path, device: str | torch.device = "cpu") -> Learner:
    """The learner of a run directory as its checkpoint holds it (a finished run's: the end of training), on
    `device`; FOO-VB's with its posterior, e.g. for `foovb.predict.predict(learner.optimizer, x, 10)`. Works on
    unfinished (interrupted, diverged) runs too. It builds the run's scenario for the model's shapes: MNIST loads in
    about a second; the vision mix needs its data directory. The global random state is left as it was."""
    run_dir = Path(run_dir)
    checkpoint_path = run_dir / "checkpoint.pt"
    if not checkpoint_path.is_file():
        kind = not_a_file(checkpoint_path)
        raise FileNotFoundError(f"{checkpoint_path} is {kind}, not a checkpoint file" if kind else
                                f"{run_dir} has no {checkpoint_path.name} (not a run directory, or a run stopped "
                                "before its first checkpoint)")
    config = saved_config(run_dir)
    with torch.random.fork_rng(devices=[]):  # build_learner seeds the model's initialisation
        learner = build_learner(config, build_scenario(config), resolve_device(str(device)))
    _load_learner_state(learner, _load_checkpoint(checkpoint_path), checkpoint_path)
    return learner


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The trained network of a run directory (`load_learner`'s model) in eval mode: its weights are the final
    ones, FOO-VB's the posterior mean. A multi-head (task-aware) model returns every head's logits, concatenated."""
    return load_learner(run_dir, device).model.eval()
