"""A run directory read back: the config it was started with (`saved_config`), a finished run's outputs (`load_run`,
for `foovb compare`, which groups runs by `experiment_key`), its checkpoint (`read_checkpoint`) and the learner and
model that the checkpoint holds (`load_learner`, `load_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from .config import Config, ConfigError, config_from_dict, config_to_dict, parse_yaml, what_it_computes
from .factories import build_learner, build_scenario, resolve_device
from .learners import Learner, learner_hyperparameters
from .rundir import CheckpointError, load_checkpoint, not_a_file

__all__ = ["experiment_key", "load_learner", "load_learner_state", "load_model", "load_run", "read_checkpoint",
           "saved_config"]


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
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} does not exist" if not run_dir.exists() else
                                f"{run_dir} is a file, not a run directory")
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
    config = saved_config(run_dir)
    if "run" in summary:  # its run recorded (since session 51): run.json's identity and the whole config compared
        from .resume import run_disagrees  # (resume imports this module)

        problem = run_disagrees(run_dir, summary["run"], config, "summary.json")
        if problem is not None:  # config.yaml or the results copied from another run
            raise CheckpointError(f"{problem}; restore the run's own files, or rerun it")
    elif (problem := _config_disagrees(summary, config)) is not None:  # an earlier run's: what its summary names
        raise CheckpointError(f"{run_dir}: config.yaml is not the config of the run whose results are there "
                              f"({problem}); restore the run's own config.yaml")
    return {"dir": run_dir, "summary": summary, "records": records, "config": config_to_dict(config)}


def _config_disagrees(summary: dict[str, Any], config: Config) -> str | None:
    """Why a summary.json that records no run (written before session 51) was not written by a run of `config` (its
    name, scenario or learner differ), or None. A key summary.json lacks is not compared."""
    learner = config.learner.kind
    for what, configured in (("name", config.name), ("scenario", config.scenario.kind), ("learner", learner)):
        written = summary.get(what, configured)
        if written != configured and not (what == "learner" and learner == "foovb" and str(written).startswith(
                "foovb-")):  # FOO-VB's summary names its family: "foovb-kronecker"
            return f"summary.json's {what} is {written!r}, config.yaml's {configured!r}"
    return None


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
    state = read_checkpoint(checkpoint_path)
    from .resume import run_disagrees  # (resume imports this module)

    problem = run_disagrees(run_dir, state.get("run"), config, checkpoint_path.name)
    if problem is not None:  # another run's weights
        raise CheckpointError(f"{problem}; restore the run's own files")
    with torch.random.fork_rng(devices=[]):  # build_learner seeds the model's initialisation
        learner = build_learner(config, build_scenario(config), resolve_device(str(device)))
    load_learner_state(learner, state, checkpoint_path)
    return learner


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The trained network of a run directory (`load_learner`'s model) in eval mode: its weights are the final
    ones, FOO-VB's the posterior mean. A multi-head (task-aware) model returns every head's logits, concatenated."""
    return load_learner(run_dir, device).model.eval()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint written by `TrainingLoop.save` (`rundir.load_checkpoint`: weights_only=True, its digest
    checked), the STDs back as numpy arrays."""
    state = load_checkpoint(path)  # on the CPU: load_state_dict places the tensors
    state["stds"] = {key: value.numpy() for key, value in state["stds"].items()}
    return state


def load_learner_state(learner: Learner, state: dict[str, Any], path: Path) -> None:
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
