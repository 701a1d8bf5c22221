"""The iterations of a run (`TrainingLoop`): observe, evaluate at the stream's eval points, checkpoint, and stop
cleanly on divergence (`TrainingDiverged`) and on Ctrl-C (`signals.RunInterrupted`)."""

from __future__ import annotations

import bisect
import contextlib
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foovb import FOOVB
from foovb.priors import XAVIER

from .config import Config
from .evaluation import Evaluator, average_so_far, task_ends
from .learners import Learner
from .outputs import write_metrics
from .rundir import CheckpointError, load_checkpoint, save_checkpoint
from .signals import RunInterrupted
from .tensorboard_log import TensorBoardLog

__all__ = ["TrainingDiverged", "TrainingLoop"]


class TrainingDiverged(FloatingPointError):
    """Training met non-finite values (a NaN/Inf loss or gradients). The message says where, what to change and
    what was saved; `checkpoint_iteration`: the iteration of the checkpoint left in the run directory (None: none).

    A learner that raises FloatingPointError refuses the step (FOO-VB leaves its posterior unchanged), so its
    state is that of the iterations done and is checkpointed; a learner that returns a non-finite loss has taken the
    step (a baseline's weights may already be NaN), so the last periodic checkpoint is kept as it was."""

    def __init__(self, message: str, checkpoint_iteration: int | None):
        super().__init__(message)
        self.checkpoint_iteration = checkpoint_iteration


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


class TrainingLoop:
    """The iterations of a run from `start`: observe, evaluate at the scenario's eval points, checkpoint (at the
    evaluations and every `checkpoint_every` iterations), and stop cleanly on divergence and Ctrl-C."""

    def __init__(self, config: Config, scenario, learner: Learner, device: torch.device, checkpoint_path: Path,
                 main_process: bool, state: dict[str, Any] | None, confirm_lock: Callable[[], None],
                 run: dict[str, Any], board: TensorBoardLog | None = None):
        self.config, self.scenario, self.learner, self.device = config, scenario, learner, device
        self.board = board  # the TensorBoard log (`tensorboard: true`, main process), or None
        self.run = run  # what every checkpoint records it belongs to: the run's identity, computed config, data, model
        self.checkpoint_path, self.main_process, self.confirm_lock = checkpoint_path, main_process, confirm_lock
        self.saved_at: int | None = None if state is None else state["iteration"]  # the checkpoint on disk
        self.saving: int | None = None  # the iteration of a checkpoint being written
        state = state or {"iteration": 0, "records": [], "train_seconds": 0.0, "stds": {}}
        self.start: int = state["iteration"]
        self.records: list[dict] = state["records"]
        self.train_seconds: float = state["train_seconds"]
        self.stds: dict[str, np.ndarray] = state["stds"]
        self.evaluator = Evaluator(scenario, config.evaluation.test_subset, device)
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
            self.saving = iteration
            save_checkpoint({"learner": self.learner.state_dict(), "iteration": iteration, "records": self.records,
                             "train_seconds": self.train_seconds, "stds": stds, "run": self.run},
                            self.checkpoint_path)
            self.saved_at, self.saving = iteration, None
        self.tic = self.saved_tic = time.perf_counter()

    def train(self, bar, stop_after: int | None, interrupt_requested: Callable[[], int | None]) -> int | None:
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

    def _iterate(self, bar, stop_after: int | None, interrupt_requested: Callable[[], int | None]) -> int | None:
        running_loss, last_average = None, average_so_far(self.records[-1]) if self.records else float("nan")
        for iteration, batch in self.scenario.batches(self.start):
            loss = self._observe(iteration, batch)
            running_loss = loss if running_loss is None else 0.98 * running_loss + 0.02 * loss
            done = iteration + 1
            if self.board is not None:
                self.board.loss(done, loss)
            evaluated = done in self.eval_points
            if evaluated:
                last_average = average_so_far(self._evaluate(done))
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
        if self.saving is not None:  # a second signal stopped save(): the file holds the checkpoint before, or this
            with contextlib.suppress(OSError, CheckpointError):  # one if it was written whole; say which
                self.saved_at = load_checkpoint(self.checkpoint_path)["iteration"]
            self.saving = None
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
        nan_tasks = sorted({task + 1 for values in record.get("nll", {}).values()
                            for task, value in enumerate(values) if math.isnan(value)})
        if nan_tasks:  # finite weights whose logits overflow: chance-level accuracy that looks like a result
            raise self._diverged(done, f"the model's outputs on the test set of task(s) {nan_tasks} are not finite "
                                       "(a NaN log-likelihood: weights so large that the logits overflow)",
                                 self._kept_checkpoint())
        self.records.append(record)
        if self.config.evaluation.histograms and hasattr(self.learner, "posterior_std"):
            self.stds[f"iteration_{done}"] = self.learner.posterior_std()
        if self.board is not None:
            self.board.evaluation(record, self.learner.posterior_stds() if hasattr(self.learner, "posterior_stds")
                                  else None)
        self.tic = time.perf_counter()
        return record
