"""A run watched live in TensorBoard (`foovb run ... --tensorboard`, config key `tensorboard: true`): event files
under `RUN/tensorboard/`, written during the run.

Tags (the step of every point is the iteration count):
    train/loss                         mean training loss of the iterations since the previous point, every
                                       `tensorboard_every` iterations and at the run's end (fewer iterations
                                       right after a resume)
    accuracy/<mode>/task_<t>           each task's test accuracy at every evaluation, per prediction mode (mean;
                                       bma and single for Bayesian learners): metrics.jsonl's values
    accuracy/<mode>/average_seen       the average over the tasks seen so far
    posterior_std/<param>/mean|min|max the posterior STDs of each parameter tensor at every evaluation (learners with
                                       `posterior_stds()`: FOO-VB and MESU), and their histogram posterior_std/<param>

On `--resume` a new event file is added to the same directory with `purge_step` = the checkpoint's iteration + 1:
TensorBoard drops the points that the interrupted run wrote after its last checkpoint, which the resumed run
writes again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError

__all__ = ["TensorBoardLog", "require_tensorboard"]

MISSING = '--tensorboard needs the tensorboard package: pip install "foovb[tensorboard]"'


def require_tensorboard() -> type:
    """torch's `SummaryWriter` class; a `ConfigError` (one line) when the tensorboard package is not installed."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard may be imported already: check the package itself)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(MISSING) from None
    except Exception as error:  # noqa: BLE001 - installed but broken (protobuf's "Descriptors cannot be created")
        cause = " ".join(str(error).split())[:200] or type(error).__name__
        raise ConfigError(f"tensorboard is installed but fails to import ({type(error).__name__}: {cause}): repair "
                          "or reinstall it (pip install --force-reinstall tensorboard), or run without "
                          "--tensorboard") from None
    return SummaryWriter


class TensorBoardLog:
    """The TensorBoard event files of one run: `loss` after every iteration, `evaluation` after every evaluation
    (which flushes the file, so the point shows at once), `close` at the end, however the run ends.

    Args:
        log_dir: where the event files go (`RUN/tensorboard`).
        every: iterations between the training-loss points.
        start: the iteration the run starts from (a checkpoint's, on --resume; 0 for a new run): the points of
            earlier event files at later iterations are purged.
    """

    def __init__(self, log_dir: Path, every: int, start: int):
        self.writer = require_tensorboard()(log_dir=str(log_dir), purge_step=start + 1)
        self.every = every
        self.losses: list[float] = []  # the losses since the previous point
        self.done = start  # iterations made so far

    def loss(self, done: int, loss: float) -> None:
        """The loss of the iteration that made `done` iterations; a point (their mean) every `every` iterations."""
        self.losses.append(loss)
        self.done = done
        if done % self.every == 0:
            self.writer.add_scalar("train/loss", float(np.mean(self.losses)), done)
            self.losses.clear()

    def evaluation(self, record: dict[str, Any], stds: dict[str, Any] | None) -> None:
        """An evaluation's accuracies (`record`, as in metrics.jsonl) and the posterior STDs of each parameter
        tensor (`stds`, by name; None for learners without a posterior), then flush."""
        done, seen = record["iteration"], record["stage"] + 1
        for mode, values in record["accuracy"].items():
            for task, value in enumerate(values):
                self.writer.add_scalar(f"accuracy/{mode}/task_{task}", value, done)
            self.writer.add_scalar(f"accuracy/{mode}/average_seen", float(np.mean(values[:seen])), done)
        for name, std in (stds or {}).items():
            values = std.detach().float().flatten().cpu()
            for statistic in ("mean", "min", "max"):
                self.writer.add_scalar(f"posterior_std/{name}/{statistic}", getattr(values, statistic)().item(), done)
            self.writer.add_histogram(f"posterior_std/{name}", values, done)
        self.writer.flush()

    def close(self) -> None:
        """Write what is pending (the mean loss of the iterations since the last point, at the last one: a run's
        end; a point after an interruption's checkpoint is purged when it resumes) and close the event file."""
        if self.losses:
            self.writer.add_scalar("train/loss", float(np.mean(self.losses)), self.done)
            self.losses.clear()
        self.writer.close()
