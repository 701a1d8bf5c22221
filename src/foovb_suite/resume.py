"""What --resume checks before it continues a run: that the config computes what the run's config.yaml does
(`check_config_unchanged`), and that the checkpoint belongs to the run in the directory, written under its config, on
its data, for its custom model, with records that fit its scenario (`run_identity`, which also draws a new run's
identity for run.json)."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

from .config import (
    EXECUTION_KEYS,
    EXECUTION_SCENARIO_KEYS,
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    what_it_computes,
)
from .loading import saved_config
from .rundir import CheckpointError

__all__ = ["RUN_FILE", "check_config_unchanged", "run_disagrees", "run_identity"]

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


def check_config_unchanged(run_dir: Path, resolved: dict[str, Any]) -> None:
    """--resume: a ConfigError unless the config (`resolved`, `config_to_dict`'s) computes what the one in
    `run_dir`'s config.yaml does: only the execution keys may change."""
    # parsed, so that keys added to Config since the run started compare as their defaults
    saved = _flatten(what_it_computes(config_to_dict(saved_config(run_dir))))
    computed = _flatten(what_it_computes(resolved))
    changed = sorted(key for key in saved.keys() | computed.keys() if saved.get(key) != computed.get(key))
    if changed:
        details = ", ".join(f"{key}: {saved.get(key, '(absent)')!r} there, {computed.get(key, '(absent)')!r} here"
                            for key in changed[:6])
        raise ConfigError(f"--resume: the config differs from the one in {run_dir / 'config.yaml'} "
                          f"({details}{', ...' if len(changed) > 6 else ''}); only {', '.join(EXECUTION_KEYS)} "
                          f"and {', '.join('scenario.' + key for key in EXECUTION_SCENARIO_KEYS)} may change")


def run_identity(run_dir: Path, checkpoint_path: Path, state: dict[str, Any] | None, computed: dict[str, Any],
                 data: str | None, scenario, model: dict[str, Any] | None = None, *, warn: bool = True) -> str:
    """The identity of the run in `run_dir`: a new one for a new run; on --resume, the one run.json holds, after
    checking that the checkpoint `state` belongs to it: the same identity, the same computed config as config.yaml
    and the command line (`computed`), the same data (`data`: the custom scenario's digest), the same custom model
    (`model`: `custom.model_record`), records that fit this scenario. A checkpoint of another run, copied in, one
    written under another config (config.yaml edited since), on other data (a factory that returns other data now) or
    for a model of other modules is a CheckpointError naming what differs; a model factory's source file edited since,
    its modules the same, a warning (its forward may compute otherwise, or only a comment changed; `warn`: False on
    all but one process of a distributed run)."""
    advice = "resume it in its own run directory, or start a new run in another directory (--out)"
    recorded = _read_run_id(run_dir)
    if state is None:
        return secrets.token_hex(8)
    _check_records(state, scenario, checkpoint_path)
    run = state.get("run")
    if run is None:  # a checkpoint written before checkpoints recorded their run
        if warn:
            print(f"foovb: warning: {checkpoint_path} was written by an earlier foovb that did not record its run: "
                  f"that it belongs to this directory is not verified", file=sys.stderr)
        return recorded or secrets.token_hex(8)
    if run["id"] != recorded:
        if recorded is None:  # run.json deleted here, or a checkpoint copied into a directory that never had one
            raise CheckpointError(
                f"--resume: {checkpoint_path} belongs to run {run['id']}, and this directory has no {RUN_FILE}. If "
                f"this is that run's own directory (its {RUN_FILE} was deleted), restore it: {RUN_FILE} holding "
                f'{{"run_id": "{run["id"]}"}}; if the checkpoint was copied here from another run directory, '
                f"{advice}")
        raise CheckpointError(f"--resume: {checkpoint_path} belongs to another run (run {run['id']}; this "
                              f"directory's {RUN_FILE} says {recorded}): it was copied from another run directory; "
                              f"{advice}")
    details = _config_changes(run["config"], computed, "checkpoint", "config.yaml and command line")
    if details:
        raise CheckpointError(f"--resume: {checkpoint_path} was written under another config than "
                              f"{run_dir / 'config.yaml'} says ({details}): config.yaml was edited after the run "
                              f"started, or copied from another run; restore it, or start a new run")
    if run.get("data") != data:
        raise CheckpointError(f"--resume: scenario.factory {computed['scenario']['factory']!r} returns other data "
                              f"than when the run started (SHA-256 {data}, the checkpoint's {run.get('data')}): a "
                              "factory must return the same data at every call (seed its randomness, e.g. from its "
                              "args); restore it, or start a new run")
    _check_model(run.get("model"), model, computed, checkpoint_path, warn)
    return recorded


def _check_model(recorded: dict[str, Any] | None, model: dict[str, Any] | None,
                 computed: dict[str, Any], checkpoint_path: Path, warn: bool) -> None:
    """--resume of a custom model: the factory must build the modules it built when the run started (an error), from
    the same source files (a warning naming them: the printout does not show a forward's functions; the files that
    define its classes are recorded since session 56). Checkpoints written before session 54 record no model: not
    checked."""
    if recorded is None or model is None:
        return
    factory = computed.get("model", {}).get("factory")
    if recorded["modules"] != model["modules"]:
        raise CheckpointError(f"--resume: model.factory {factory!r} builds another model than when the run started "
                              f"(its modules as printed differ: a layer, a size or an activation module changed, the "
                              f"checkpoint's weights would be trained on by another network); restore it, or start "
                              "a new run")
    changed = _changed_model_files(recorded, model, factory)
    if changed and warn:
        print(f"foovb: warning: --resume: {changed} changed since {checkpoint_path.name} was written; its modules are "
              "the same. If the change alters what the model computes (a function in its forward), this run mixes "
              "two models: start a new run", file=sys.stderr)


def _changed_model_files(recorded: dict[str, Any], model: dict[str, Any], factory: str | None) -> str:
    """The model's source files whose hashes differ, as the warning names them ("" if none): the factory's file, and
    the modules of the user's that define its classes where both records hold them (since session 56)."""
    changed = []
    if recorded["source"] != model["source"]:
        changed.append(f"{model['file'] or recorded['file'] or 'the file'}, which holds model.factory {factory!r},")
    before, now = recorded.get("classes"), model.get("classes")
    if before is not None and now is not None:
        changed += [f"module {name!r} (it defines a class of the model)" for name in sorted(before.keys() | now.keys())
                    if before.get(name) != now.get(name)]
    return " and ".join(changed)


def _config_changes(recorded: dict[str, Any], computed: dict[str, Any], there: str, here: str) -> str:
    """The keys whose values differ between a computed config recorded by a run (a checkpoint's, summary.json's;
    keys added to `Config` since compared at their defaults) and `computed`, at most 6 named; "" if none."""
    saved, now = _flatten(_with_defaults(recorded)), _flatten(computed)
    changed = sorted(key for key in saved.keys() | now.keys() if saved.get(key) != now.get(key))
    return "; ".join(f"{key}: {there} {saved.get(key, '(absent)')!r}, {here} {now.get(key, '(absent)')!r}"
                     for key in changed[:6]) + ("; ..." if len(changed) > 6 else "")


def run_disagrees(run_dir: Path, run: Any, config: Config, what: str) -> str | None:
    """Why `what` (a checkpoint or summary.json of `run_dir`), whose record of its run is `run` ({"id", "config"}),
    is not the run in `run_dir`: another identity than run.json's (copied from another run directory), or another
    computed config than config.yaml's (`config`: edited, or copied from another run); None if it is, or if the
    record or run.json is absent (written by an earlier foovb, or run.json deleted: --resume says how to restore)."""
    if not isinstance(run, dict) or "id" not in run:
        return None
    recorded = _read_run_id(run_dir)
    if recorded is not None and run["id"] != recorded:
        return (f"{what} belongs to run {run['id']}, but {run_dir / RUN_FILE} says {recorded}: it was copied from "
                "another run directory")
    details = _config_changes(run.get("config", {}), what_it_computes(config_to_dict(config)), what, "config.yaml")
    if details:
        return (f"{run_dir / 'config.yaml'} is not the config {what} was written under ({details}): edited, or "
                "copied from another run")
    return None


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
