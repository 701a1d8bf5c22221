"""The experiment runner, config validation and CLI, end to end on real (subsampled) MNIST."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, page_files

from foovb_suite import factories, loading, metrics, plots, runner
from foovb_suite.cli import main
from foovb_suite.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, load_config
from foovb_suite.evaluation import tasks_seen
from foovb_suite.factories import resolve_device
from foovb_suite.learners import LEARNERS
from foovb_suite.loading import experiment_key, load_model, load_run
from foovb_suite.runner import run

QUICK = {
    "name": "quick",
    "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 2, "epochs_per_task": 1, "train_subset": 1024,
                 "batch_size": 64},
    "model": {"kind": "mlp", "hidden": [32, 32]},
    "learner": {"kind": "foovb", "params": {"preset": "paper", "posterior": "diagonal", "mc_samples": 4,
                                            "eval_samples": 4}},
    "evaluation": {"test_subset": 500},
    "checkpoint_every": 7,
    "device": "cpu",  # the same numbers on every machine; the GPU test below overrides it
}


def quick(**changes) -> dict:
    data = json.loads(json.dumps(QUICK))
    return apply_overrides(data, [f"{k}={v}" for k, v in changes.items()])


# QUICK turned into the continuous scenario, evaluated every `scenario.eval_every` iterations
CONTINUOUS = {"scenario.kind": "continuous_permuted_mnist", "scenario.train_subset": "null",
              "scenario.epochs_per_task": 20, "scenario.iterations_per_task": 10}


def _spy_on_observe(monkeypatch) -> list:
    """The `task` argument of every `observe` call of the learners that `run` builds from now on."""
    tasks = []
    build = factories.build_learner

    def build_and_spy(config, scenario, device):
        learner = build(config, scenario, device)
        observe = learner.observe

        def spy(x, y, task=None):
            tasks.append(task)
            return observe(x, y, task)

        learner.observe = spy
        return learner

    monkeypatch.setattr(runner, "build_learner", build_and_spy)
    return tasks


class _Crash(Exception):
    """A simulated crash in the middle of a run (unlike `stop_after`, nothing is saved on the way out)."""


def _crash_at(monkeypatch, iteration: int) -> None:
    """The runs that follow crash when their stream reaches `iteration` (0-based): `iteration` iterations done."""
    build = factories.build_scenario

    def build_and_break(config):
        scenario = build(config)
        batches = scenario.batches

        def crashing(start: int = 0):
            for i, batch in batches(start):
                if i == iteration:
                    raise _Crash(iteration)
                yield i, batch

        scenario.batches = crashing
        return scenario

    monkeypatch.setattr(runner, "build_scenario", build_and_break)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"scenario.bacth_size": 3}, "scenario.bacth_size"),
        ({"scenario.batch_size": "abc"}, "scenario.batch_size"),
        ({"scenario.batch_size": 0}, "scenario.batch_size"),
        ({"scenario.kind": "rotated"}, "scenario.kind"),
        ({"scenario.max_angle": 90.0}, "scenario.max_angle: not read"),
        ({"scenario.kind": "rotated_mnist", "scenario.train_subset": "null", "scenario.epochs_per_task": 20,
          "scenario.max_angle": 0}, "scenario.max_angle: must be in"),
        ({"scenario.kind": "split_mnist", "scenario.train_subset": "null", "scenario.num_tasks": 6},
         "scenario.num_tasks: Split MNIST has 5"),
        ({"model.kind": "lenet", "model.hidden": "[100, 100]", "model.bias": "false"}, "model.bias"),
        ({"model.hidden": "[10, -1]"}, "model.hidden[1]"),
        ({"evaluation.test_subset": "true"}, "evaluation.test_subset"),
        ({"seed": -1}, "seed"),
        ({"device": "gpu"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"scenario.eval_every": 5}, "scenario.eval_every"),
        ({"scenario.kind": "continuous_permuted_mnist", "scenario.train_subset": "null"}, "scenario.epochs_per_task"),
        ({"scenario.iterations_per_task": 10}, "scenario.iterations_per_task"),
        ({"scenario.datasets": "[mnist]"}, "scenario.datasets"),
        ({"model.kind": "lenet"}, "model.hidden"),
        ({"scenario.kind": "vision_mix", "scenario.data_dir": "d", "scenario.train_subset": "null",
          "scenario.num_tasks": 3, "scenario.datasets": "[mnist, fashion_mnist]"}, "scenario.num_tasks"),
        ({"scenario.kind": "vision_mix", "scenario.data_dir": "d", "scenario.train_subset": "null",
          "scenario.datasets": "[mnist, fashoin_mnist]"}, "scenario.datasets: unknown dataset 'fashoin_mnist'"),
        ({**CONTINUOUS, "scenario.eval_every": 0}, "scenario.eval_every: must be a positive integer"),
        ({**CONTINUOUS, "scenario.eval_every": -5}, "scenario.eval_every: must be a positive integer"),
        ({"scenario.seed": -1}, r"scenario.seed: must be in \[0, 2\*\*32\)"),
        # 2**32 drew the stream of seed 0 with another purpose (numpy's SeedSequence splits it into 32-bit words)
        ({"scenario.seed": 2**32}, r"scenario.seed: must be in \[0, 2\*\*32\), got 4294967296"),
        ({"seed": 2**64}, r"seed: must be in \[0, 2\*\*63\), got 18446744073709551616"),  # torch.manual_seed failed
        ({"threads": 0}, "threads: must be a positive integer"),
        ({"scenario.joint": "true", "learner.kind": "si"}, "learner.kind: si consolidates each task"),
        ({"threads": -2}, "threads: must be a positive integer"),
        ({"scenario.kind": "custom"}, "scenario.factory: the custom scenario needs one, 'module:function'"),
        ({"scenario.kind": "custom", "scenario.factory": "my_tasks.py"},
         "scenario.factory: expected 'module:function'"),
        ({"scenario.kind": "custom", "scenario.factory": "m:f", "scenario.mode": "gradual"},
         "scenario.mode: must be 'discrete' or 'continuous'"),
        ({"scenario.kind": "custom", "scenario.factory": "m:f", "scenario.mode": "continuous"},
         r"scenario.epochs_per_task: not read by the custom \(mode: continuous\) scenario"),
        ({"scenario.kind": "custom", "scenario.factory": "m:f", "scenario.iterations_per_task": 10},
         r"scenario.iterations_per_task: not read by the custom \(mode: discrete\) scenario"),
        ({"scenario.kind": "custom", "scenario.factory": "m:f", "scenario.args": "{1: 2}"}, "scenario.args: "),
        ({"scenario.kind": "custom", "scenario.factory": "m:f", "scenario.num_classes": 0}, "scenario.num_classes"),
        ({"scenario.mode": "continuous"}, "scenario.mode: not read by the discrete_permuted_mnist scenario"),
        ({"scenario.factory": "m:f"}, "scenario.factory: not read"),
        ({"model.kind": "custom"}, "model.hidden: the custom model's layers are not set here"),
        ({"model.kind": "custom", "model.hidden": "[100, 100]"}, "model.factory: the custom model needs one"),
        ({"model.factory": "m:f"}, "model.factory: read by the custom model only"),
        ({"model.args": "{depth: 2}"}, "model.args: read by the custom model only"),
    ],
)
def test_bad_config_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key if "\\" in key else key.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(quick(**change))


def test_overrides_and_yaml_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nscenario: {kind: discrete_permuted_mnist, num_tasks: 3}\nlearner: {kind: foovb}\n")
    config = load_config(path, ["scenario.batch_size=32", "learner.params={mc_samples: 2}"])
    assert (config.scenario.num_tasks, config.scenario.batch_size) == (3, 32)
    assert config.learner.params == {"mc_samples": 2}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("text", "overrides", "message"), [
    ("", [], r"scenario.kind: .* does not name its scenario"),  # the defaults alone: a paper-scale run of hours
    ("name: x\nlearner: {kind: sgd}\n", [], r"scenario.kind: .* does not name its scenario"),
    ("scenario: {kind: split_mnist}\n", [], r"learner.kind: .* does not name its learner"),
    ("- a\n- b\n", ["seed=1"], r"config: expected a mapping, got \['a', 'b'\]"),
    ("just a string\n", ["seed=1"], "config: expected a mapping"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n", ["=3"], r"--set '=3': empty key"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n", ["scenario..kind=x"], "empty key"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n", ["scenario=3"], "^scenario: expected a mapping, got 3"),
    # these three were TypeError tracebacks: keys of mixed types sorted, a list as a key hashed
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\non: 1\nx: 2\n", [],
     r"^True: unknown key \(YAML reads an unquoted on/off/yes/no/true/false key as a boolean: quote it\)"),
    ("scenario: {kind: split_mnist, [a]: 1}\nlearner: {kind: sgd}\n", [], r"a key must be a plain value, got \['a'\]"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n\xe9: 1\n", [], "is not a YAML config in UTF-8"),
    # a misspelt section is named (it was "learner.kind: ... does not name its learner"), and its closest key
    ("scenario: {kind: split_mnist}\nlerner: {kind: sgd}\n", [], r"^lerner: unknown key \(did you mean 'learner'\?\)"),
    ("scenario: {kind: split_mnist, epochs_per_tsk: 1}\nlearner: {kind: sgd}\n", [],
     r"^scenario.epochs_per_tsk: unknown key \(did you mean 'epochs_per_task'\?\)"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n", ["learner.params={lr:0.001}"],  # YAML's key lr:0.001
     r"YAML reads 'lr:0.001' as one key with no value; a colon needs a space after it: \{lr: 0.001\}"),
    ("scenario: {kind: split_mnist}\nlearner: {kind: sgd}\n", ["model.args={block: {hidden:64}}"],  # nested
     r"YAML reads 'hidden:64' as one key"),
])
def test_config_files_that_are_not_complete_runs_are_errors(tmp_path, text, overrides, message) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode("latin-1"))  # latin-1: the one config in another encoding; the others are ASCII
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


@pytest.mark.parametrize("name", ["../../escape", "..", "a/b", ""])
def test_a_run_name_that_is_not_one_folder_name_is_refused_where_it_becomes_runs_name(tmp_path, capsys, name):
    path = tmp_path / "c.yaml"
    path.write_text("scenario: {kind: split_mnist, num_tasks: 2}\nlearner: {kind: sgd}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["run", str(path), "--set", f"name='{name}'"]) == 2
    assert capsys.readouterr().err.startswith("foovb: error: name: expected a plain name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]
    # a run stored under such a name by an earlier version is still read (compare, load_model, --resume)
    assert config_from_dict({"name": name}).name == name


def test_a_set_value_keeps_its_equals_signs(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nscenario: {kind: split_mnist, num_tasks: 5}\nlearner: {kind: sgd}\n")
    assert load_config(path, ["name=a=b"]).name == "a=b"
    assert apply_overrides({}, ["learner.params.tag=k=v=w"]) == {"learner": {"params": {"tag": "k=v=w"}}}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([*(f"{k}={v}" for k, v in CONTINUOUS.items()), "scenario.eval_every=0"], "scenario.eval_every"),
        (["scenario.seed=-1"], "scenario.seed"),
        (["threads=0"], "threads"),
        (["scenario.kind=vision_mix", "scenario.train_subset=null", "scenario.task_agnostic=maybe"],
         "scenario.task_agnostic"),
    ],
)
def test_cli_refuses_bad_values_naming_the_key(tmp_path, capsys, overrides, key) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(quick()))
    sets = [arg for item in overrides for arg in ("--set", item)]
    assert main(["run", str(config), *sets, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert f"foovb: error: {key}: " in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_cli_names_a_missing_dataset_in_one_line_before_writing(tmp_path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(quick()))
    sets = ["--set", "scenario.kind=vision_mix", "--set", "scenario.train_subset=null", "--set",
            f"scenario.data_dir={tmp_path / 'data'}", "--set", "scenario.num_tasks=2"]
    (tmp_path / "data").mkdir()
    assert main(["run", str(config), *sets, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foovb: error: dataset 'notmnist' was not found; looked in: ") and err.count("\n") == 1
    assert str(tmp_path / "data" / "notmnist") in err
    assert not (tmp_path / "r").exists()


def test_a_data_dir_that_does_not_exist_is_named_in_a_short_line(tmp_path, capsys, monkeypatch) -> None:
    """It was one line of 2,100 characters listing the folders under it, none saying that it does not exist."""
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(quick()))
    monkeypatch.chdir(tmp_path)
    sets = ["--set", "scenario.kind=vision_mix", "--set", "scenario.train_subset=null", "--set",
            "scenario.data_dir=dta", "--set", "scenario.num_tasks=2"]
    assert main(["run", str(config), *sets, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foovb: error: dataset 'notmnist' was not found: scenario.data_dir dta does not exist (a "
                          f"relative path, read from {tmp_path})") and err.count("\n") == 1
    assert "download_dataset('notmnist', 'dta')" in err and len(err) < 500
    assert not (tmp_path / "r").exists()


# --- inputs that would exhaust memory or the stack (issue "no input reaches a traceback") ---------------------


def _laughs(levels: int) -> str:
    """A YAML list of anchors, each ten aliases of the one before ("billion laughs"): 10**levels values expanded."""
    anchors = ["&l0 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]"]
    anchors += [f"&l{k} [{', '.join([f'*l{k - 1}'] * 10)}]" for k in range(1, levels + 1)]
    return f"[{', '.join(anchors)}]"


def _nested(levels: int, inner: str = "") -> str:
    return "[" * levels + inner + "]" * levels


_COMPLETE = "scenario: {kind: split_mnist, num_tasks: 2}\nlearner: {kind: sgd}\n"


# (config text, --set overrides, the refusal): a RecursionError in PyYAML's composer; 10**6 values built (10**9 were
# a MemoryError), then "expected int"; the same through --set
_YAML_BOMBS = [
    (_COMPLETE + f"model: {{hidden: {_nested(50_000)}}}\n", [],
     "{path}: refused: its YAML nests deeper than 100 levels (at line 3)"),
    (_COMPLETE.replace("num_tasks: 2", f"batch_size: {_laughs(6)}"), [],
     "{path}: refused: its YAML holds more than 100000 values once its aliases are expanded"),
    (_COMPLETE, [f"scenario.batch_size={_laughs(6)}"],
     "--set scenario.batch_size: refused: its YAML holds more than 100000 values once its aliases are expanded"),
]


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        *_YAML_BOMBS,
        (_COMPLETE, [f"learner.params.deep={_nested(101)}"],
         "--set learner.params.deep: refused: its YAML nests deeper than 100 levels (at line 1)"),
        # each alias nests an anchor of 50 levels 60 levels deep: the composer sees 61, the expanded value 111
        (_COMPLETE, [f"learner.params.deep=[&a {_nested(50)}, {_nested(60, '*a')}]"],
         "--set learner.params.deep: refused: its YAML nests deeper than 100 levels once its aliases are expanded"),
        (_COMPLETE, ["learner.params.loop=&a [*a]"],  # a list that holds itself
         "--set learner.params.loop: refused: its YAML nests deeper than 100 levels once its aliases are expanded"),
    ],
    ids=["nested-50000-deep", "billion-laughs", "billion-laughs-in-set", "set-nested-101-deep",
         "aliases-nested-deep", "recursive-alias"],
)
def test_yaml_beyond_the_bounds_is_refused_naming_the_file_or_key(tmp_path, text, overrides, message) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    assert str(error.value) == message.format(path=path)


def test_yaml_within_the_bounds_loads_with_its_aliases(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scenario: {kind: split_mnist, num_tasks: 2}\nmodel: {kind: mlp, hidden: &widths [64, 32]}\n"
                    "learner: {kind: sgd, params: {widths: *widths}}\n")
    config = load_config(path, [f"learner.params.deep={_nested(100)}", f"learner.params.laughs={_laughs(3)}"])
    assert config.model.hidden == [64, 32] and config.learner.params["widths"] == [64, 32]
    deep = config.learner.params["deep"]
    for _ in range(99):
        (deep,) = deep
    assert deep == []
    assert len(config.learner.params["laughs"][-1]) == 10


def test_a_directory_as_the_config_is_named_as_one(tmp_path, capsys) -> None:
    """Before: "config file ... does not exist"."""
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path)
    assert str(error.value) == f"config file {tmp_path} is a directory, not a YAML file"
    (tmp_path / "configs").mkdir()
    with pytest.MonkeyPatch.context() as patch:  # a bare name: not a bundled config, a directory here
        patch.chdir(tmp_path)
        assert main(["run", "configs", "--out", "r"]) == 2
    assert capsys.readouterr().err == "foovb: error: config file configs is a directory, not a YAML file\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["configs"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # a 627 GB tensor of pixel permutations
        ({"scenario.num_tasks": 10**8}, "scenario.num_tasks: at most 1000 tasks, got 100000000"),
        ({"scenario.num_tasks": 1001}, "scenario.num_tasks: at most 1000 tasks, got 1001"),
        # 10**7 accuracies: the evaluation points, records and metrics.csv in memory
        ({**CONTINUOUS, "scenario.num_tasks": 1000, "scenario.eval_every": 1},
         "scenario.eval_every: 1 evaluates all 1000 tasks 10000 times, 10000000 accuracies per mode, more than the "
         "maximum of 1000000; evaluate less often"),
        # a 40 GB weight matrix
        ({"model.hidden": "[100000, 100000]"},
         "model.hidden: [100000, 100000] gives the MLP up to 10307200000 weights (from 3072 inputs, the widest "
         "scenario's), more than the maximum of 100000000"),
        ({"threads": 10**6}, "threads: at most 1024, got 1000000"),
    ],
    ids=["num-tasks-1e8", "num-tasks-1001", "eval-every", "hidden", "threads"],
)
def test_sizes_that_drive_allocations_are_bounded(change, message) -> None:
    with pytest.raises(ConfigError) as error:
        config_from_dict(quick(**change))
    assert str(error.value) == message


def test_sizes_at_their_bounds_are_valid() -> None:
    config = config_from_dict(quick(**{**CONTINUOUS, "scenario.num_tasks": 1000, "scenario.eval_every": 10,
                                       "threads": 1024, "model.hidden": "[10000, 6928]"}))
    assert (config.scenario.num_tasks, config.threads) == (1000, 1024)


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        *_YAML_BOMBS,
        (_COMPLETE.replace("split_mnist", "discrete_permuted_mnist"), ["scenario.num_tasks=100000000"],
         "scenario.num_tasks: at most 1000 tasks, got 100000000"),
    ],
    ids=["nested-50000-deep", "billion-laughs", "billion-laughs-in-set", "num-tasks-1e8"],
)
def test_cli_refuses_inputs_that_would_exhaust_memory_in_one_line(tmp_path, capsys, monkeypatch, text, overrides,
                                                                   message) -> None:
    """Before: a RecursionError, MemoryErrors and a 627 GB allocation, each with its traceback."""
    monkeypatch.setattr(runner, "build_scenario", lambda config: pytest.fail("the scenario's data was allocated"))
    path = tmp_path / "c.yaml"
    path.write_text(text)
    sets = [arg for item in overrides for arg in ("--set", item)]
    assert main(["run", str(path), *sets, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"foovb: error: {message.format(path=path)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"learner.params.mc_sample": 3}, "learner.params: .*mc_sample"),
        ({"learner.kind": "foo"}, "learner.kind: unknown learner 'foo'"),
        ({"learner.params.std_init": "abc"}, "learner.params: std_init must be a number .* or .xavier."),
        ({"learner.params.eval_samples": 2.5}, "learner.params: eval_samples must be an integer"),
        ({"learner.params.chunk_size": 0}, "learner.params: chunk_size"),
        ({"learner.params.seed": 5}, "learner.params.seed: set by the runner"),
        ({"learner.kind": "sgd", "learner.params": "{lr: abc}"}, "learner.params: lr must be a number"),
        ({"learner.kind": "si", "learner.params": "{}"}, "learner.kind: 'si' needs task ids"),
    ],
)
def test_bad_learner_config_fails_before_anything_is_written(tmp_path, change, match) -> None:
    config = config_from_dict(quick(**change))
    with pytest.raises(ConfigError, match=match):
        run(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_test_subset_above_the_test_set_is_refused_before_anything_is_written(tmp_path) -> None:
    """evaluation.test_subset=100000 ran on the whole test set and recorded 100000 in the config (a helper's trial,
    session 50), where a train_subset above the data is refused."""
    with pytest.raises(ConfigError, match=r"evaluation.test_subset must be in \[1, 10000\] \(the smallest test "
                                          r"set\), got 1000000"):
        run(config_from_dict(quick(**{"evaluation.test_subset": 10**6})), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_directory_with_an_unfinished_run_is_not_reused_without_resume(tmp_path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(quick()))
    run_dir = tmp_path / "r"
    assert run(config_from_dict(quick()), run_dir, progress=False, stop_after=9) == {"interrupted_at": 9}
    saved = (run_dir / "config.yaml").read_text()
    # another config into the same directory: refused, the unfinished run left as it was (still resumable)
    assert main(["run", str(config), "--set", "learner.params.mc_samples=2", "--out", str(run_dir),
                 "--no-progress"]) == 2
    assert "unfinished run" in capsys.readouterr().err
    assert main(["run", str(config), "--set", "learner.params.mc_samples=2", "--out", str(run_dir),
                 "--resume", "--no-progress"]) == 2
    assert "--resume: the config differs" in capsys.readouterr().err
    assert main(["run", str(config), "--set", "learner.params={mc_samples: 2", "--out", str(run_dir)]) == 2
    assert "--set learner.params: invalid YAML" in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == saved


def test_a_directory_that_holds_the_users_own_files_is_not_a_run_directory(tmp_path, capsys) -> None:
    """`foovb run myexp/config.yaml --out myexp` replaced the user's commented config.yaml with the resolved one,
    with exit 0 (a helper's trial, session 50): a directory without run.json that holds a file a run writes is
    refused, nothing in it touched; a directory with run.json (a run stopped before its first checkpoint) is not."""
    experiment = tmp_path / "myexp"
    experiment.mkdir()
    config = experiment / "config.yaml"
    config.write_text("# my notes\n" + json.dumps(quick()))
    written = config.read_text()
    assert main(["run", str(config), "--out", str(experiment), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"foovb: error: {experiment} holds config.yaml but no run (run.json): a run there would "
                          "overwrite it")
    assert config.read_text() == written and sorted(p.name for p in experiment.iterdir()) == ["config.yaml"]
    started = tmp_path / "started"  # killed before its first checkpoint: run.json and config.yaml, no checkpoint
    assert run(config_from_dict(quick()), started, progress=False, stop_after=9) == {"interrupted_at": 9}
    (started / "checkpoint.pt").unlink()
    assert run(config_from_dict(quick()), started, progress=False)["num_tasks"] == 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "full"
    summary = run(config_from_dict(quick()), run_dir, progress=False)
    return run_dir, summary


def test_a_bad_learner_key_is_reported_before_the_run_directory_is_looked_at(finished_run, tmp_path,
                                                                             capsys) -> None:
    """A bad learner parameter names the key, not "already holds a finished run" (or another directory error)."""
    run_dir, _ = finished_run
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(quick()))
    for out, extra in ((run_dir, []), (run_dir, ["--resume"]), (tmp_path / "new", ["--resume"])):
        assert main(["run", str(config), "--set", "learner.params.bogus=1", "--out", str(out), "--no-progress",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert "foovb: error: learner.params: " in err and "'bogus'" in err, err
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before
    assert not (tmp_path / "new").exists()


def test_end_to_end_learns_and_writes_every_output(finished_run) -> None:
    run_dir, summary = finished_run
    modes = summary["modes"]
    assert set(modes) == {"mean", "bma", "single"}
    assert summary["device"] == "cpu"
    # 2 tasks, 16 batches each: far above the 10% of chance on both tasks.
    assert modes["mean"]["average_accuracy"] > 0.6
    assert modes["mean"]["first_task_accuracy"] > 0.5
    for name in ["config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "stds.npz", "checkpoint.pt",
                 "accuracy_matrix_mean.csv", "accuracy_matrix_bma.csv", "accuracy_matrix_single.csv"]:
        assert (run_dir / name).stat().st_size > 0, name
    for name in ["average_accuracy_mean.png", "first_task_accuracy_mean.png", "std_histograms.png",
                 "accuracy_matrix_mean.png"]:
        assert (run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [16, 32]
    matrix = np.loadtxt(run_dir / "accuracy_matrix_mean.csv", delimiter=",")
    assert matrix.shape == (2, 2)
    np.testing.assert_allclose(matrix[-1].mean(), modes["mean"]["average_accuracy"])
    stds = np.load(run_dir / "stds.npz")
    assert len(stds.files) == 2 and all(stds[k].size == 784 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
                                        for k in stds.files)


def test_resume_after_interruption_gives_the_same_metrics(finished_run, tmp_path) -> None:
    _, uninterrupted = finished_run
    config = config_from_dict(quick())
    partial = run(config, tmp_path / "r", progress=False, stop_after=21)
    assert partial == {"interrupted_at": 21}
    # the metrics of the evaluations so far (after task 1, iteration 16) are on disk already, as they will stay
    written = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    final = [json.loads(line) for line in (finished_run[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in written] == [16] and written[0]["accuracy"] == final[0]["accuracy"]
    rows = list(csv.DictReader((tmp_path / "r" / "metrics.csv").read_text().splitlines()))
    assert rows and {r["iteration"] for r in rows} == {"16"}
    # a run started before a config key existed resumes, the key taking its default (QUICK leaves it unset)
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    del saved["evaluation"]["histograms"]
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump(saved))
    # execution settings may change on resume (here a thread count and checkpoint interval)
    threads = torch.get_num_threads()
    resumed = run(config_from_dict(quick(threads=1, checkpoint_every=5)), tmp_path / "r", resume=True,
                  progress=False)
    torch.set_num_threads(threads)
    assert resumed["modes"] == uninterrupted["modes"]
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["threads"] == 1


def test_a_run_takes_one_thread_unless_told_otherwise(tmp_path) -> None:
    """One thread by default (measured faster on a busy 2-core host, the same numbers on every machine); null gives
    torch's default."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert config_from_dict(quick()).threads == 1
        run(config_from_dict(quick()), tmp_path / "one", progress=False, stop_after=1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert config_from_dict(quick(threads="null")).threads is None
        run(config_from_dict(quick(threads="null")), tmp_path / "all", progress=False, stop_after=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_crashed_run_resumes_from_its_latest_checkpoint(finished_run, tmp_path, monkeypatch) -> None:
    """Crashes (nothing saved on the way out, unlike stop_after) right after an evaluation and after a periodic
    checkpoint: each checkpoint holds its iteration, the records and STDs so far, and the resumed run ends as the
    uninterrupted one (the same summary, records and stds.npz). QUICK: evaluations at 16 and 32, checkpoint_every
    7; the learner is task-agnostic: observe() never gets a task id."""
    full_dir, uninterrupted = finished_run
    config, run_dir = config_from_dict(quick()), tmp_path / "r"
    tasks = _spy_on_observe(monkeypatch)
    for crash, resume, saved_at in ((18, False, 16), (23, True, 21)):  # 16: the evaluation; 21: 3 * 7
        with monkeypatch.context() as patch:
            _crash_at(patch, crash)
            with pytest.raises(_Crash):
                run(config, run_dir, resume=resume, progress=False)
        state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
        assert state["iteration"] == saved_at
        assert [r["iteration"] for r in state["records"]] == [16]
        assert list(state["stds"]) == ["iteration_16"]
    resumed = run(config, run_dir, resume=True, progress=False)
    assert resumed["modes"] == uninterrupted["modes"]

    def records(directory):
        return [{k: v for k, v in r.items() if k != "train_seconds"} for r in load_run(directory)["records"]]

    assert records(run_dir) == records(full_dir)
    stds, expected = np.load(run_dir / "stds.npz"), np.load(full_dir / "stds.npz")
    assert stds.files == expected.files == ["iteration_16", "iteration_32"]
    for key in expected.files:
        np.testing.assert_array_equal(stds[key], expected[key])
    assert tasks == [None] * (18 + 7 + 11)  # iterations 0-17, 16-22 and 21-31


def test_evaluations_at_task_ends_count_the_tasks_seen(finished_run) -> None:
    """The evaluation at the end of task t has stage t (tasks 0..t seen): the average accuracy after the first task
    is the first task's accuracy."""
    run_dir, summary = finished_run
    records = load_run(run_dir)["records"]
    assert [r["stage"] for r in records] == [0, 1]
    assert tasks_seen(records, load_config(run_dir / "config.yaml")) == [1, 2]
    for mode, entry in summary["modes"].items():
        matrix = np.loadtxt(run_dir / f"accuracy_matrix_{mode}.csv", delimiter=",")
        assert entry["average_accuracy_curve"][0] == records[0]["accuracy"][mode][0]
        assert entry["average_accuracy_curve"][0] == pytest.approx(matrix[0, 0], abs=1e-6)
        assert entry["average_accuracy_curve"][1] == pytest.approx(matrix[1].mean(), abs=1e-6)


def test_evaluation_is_on_the_test_sets(finished_run) -> None:
    """The final record's numbers, recomputed from the saved learner on each task's test set (first test_subset)."""
    run_dir, _ = finished_run
    config = load_config(run_dir / "config.yaml")
    scenario = factories.build_scenario(config)
    learner = factories.build_learner(config, scenario, torch.device("cpu"))
    learner.load_state_dict(torch.load(run_dir / "checkpoint.pt", weights_only=False)["learner"])
    last, subset = load_run(run_dir)["records"][-1], config.evaluation.test_subset
    assert last["iteration"] == scenario.num_iterations
    for task in range(scenario.num_tasks):
        x, y = scenario.test_set(task)
        pred = learner.predict(x[:subset], None)
        for mode, values in last["accuracy"].items():
            assert metrics.accuracy(pred, y[:subset], mode) == values[task], (task, mode)
        assert metrics.nll(metrics.mode_probabilities(pred, "mean"), y[:subset]) == last["nll"]["mean"][task]


def test_consolidation_baseline_with_adam_resumes_exactly(tmp_path) -> None:
    """The checkpoint carries the baseline's inner Adam state and its running importance, not only the weights."""
    config = config_from_dict(quick(**{"learner.kind": "ewc_online",
                                       "learner.params": "{lr: 0.001, reg: 10.0, optimizer: adam}", "threads": 1}))
    uninterrupted = run(config, tmp_path / "full", progress=False)
    assert run(config, tmp_path / "r", progress=False, stop_after=21) == {"interrupted_at": 21}
    assert run(config, tmp_path / "r", resume=True, progress=False)["modes"] == uninterrupted["modes"]


def test_device_resolution_and_errors(monkeypatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device: 'cuda' asked for.*no CUDA GPU"):
        resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_matches_the_cpu_run_and_resumes(finished_run, tmp_path) -> None:
    _, on_cpu = finished_run
    config = config_from_dict(quick(device="cuda"))
    uninterrupted = run(config, tmp_path / "whole", progress=False)
    assert run(config, tmp_path / "gpu", progress=False, stop_after=21) == {"interrupted_at": 21}
    on_gpu = run(config, tmp_path / "gpu", resume=True, progress=False)
    assert on_gpu["device"].startswith("cuda")
    for mode, entry in on_cpu["modes"].items():
        # resumed = uninterrupted on the GPU (the same noise; float rounding may differ); the CPU run draws other
        # noise (the GPU's generator), so it is only close
        assert on_gpu["modes"][mode]["average_accuracy"] == pytest.approx(
            uninterrupted["modes"][mode]["average_accuracy"], abs=0.01)
        assert on_gpu["modes"][mode]["average_accuracy"] == pytest.approx(entry["average_accuracy"], abs=0.1)


def test_resume_refuses_a_changed_config_and_a_missing_checkpoint(finished_run, tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        run(config_from_dict(quick()), tmp_path / "none", resume=True, progress=False)
    run_dir, _ = finished_run
    with pytest.raises(ValueError, match=r"differs.*\(learner.params.mc_samples: 4 there, 2 here\)"):
        run(config_from_dict(quick(**{"learner.params.mc_samples": 2})), run_dir, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"differs.*\(seed: 0 there, 5 here\); only threads"):
        run(config_from_dict(quick(seed=5, threads=1)), run_dir, resume=True, progress=False)


def test_baseline_and_continuous_scenario_and_compare(finished_run, tmp_path, capsys, monkeypatch) -> None:
    config = tmp_path / "sgd.yaml"
    config.write_text(json.dumps(quick(**{
        "learner.kind": "sgd", "learner.params": "{lr: 0.05}", "scenario.kind": "continuous_permuted_mnist",
        "scenario.iterations_per_task": 12, "scenario.train_subset": "null", "scenario.eval_every": 5,
        "scenario.epochs_per_task": 20})))  # epochs_per_task back at its default: not read by this scenario
    assert main(["run", str(config), "--out", str(tmp_path / "sgd"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "sgd" / "summary.json").read_text())
    assert set(summary["modes"]) == {"mean"}
    assert "forgetting" in summary["modes"]["mean"]  # task ends are evaluated although 5 does not divide 12
    assert (tmp_path / "sgd" / "plots" / "task_schedule.png").exists()
    records = [json.loads(r) for r in (tmp_path / "sgd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [5, 10, 12, 15, 20, 24]
    sgd_config = load_config(config)
    assert tasks_seen(records, sgd_config) == pytest.approx([5 / 12, 10 / 12, 1, 15 / 12, 20 / 12, 2])
    run_dir, _ = finished_run
    assert main(["compare", str(run_dir), str(tmp_path / "sgd"), "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()
    assert len(table) == 1 + 3 + 1  # header, three FOO-VB modes, SGD
    assert (tmp_path / "cmp" / "average_accuracy.png").exists()
    assert "average_accuracy" in capsys.readouterr().out
    drawn = []
    monkeypatch.setattr(plots, "plot_average_accuracy", lambda curves, path: drawn.extend(curves))
    assert main(["compare", str(run_dir), str(tmp_path / "sgd"), "--out", str(tmp_path / "cmp2"),
                 "--plot-modes", "mean"]) == 0
    assert sorted(drawn) == sorted([f"{run_dir.name} (mean)", "sgd (mean)"])
    assert len((tmp_path / "cmp2" / "compare.csv").read_text().splitlines()) == 1 + 3 + 1  # table: every mode
    drawn.clear()
    assert main(["compare", str(run_dir), str(tmp_path / "sgd"), "--out", str(tmp_path / "cmp3"),
                 "--plot-runs", "sgd"]) == 0
    assert drawn == ["sgd (mean)"]
    assert len((tmp_path / "cmp3" / "compare.csv").read_text().splitlines()) == 1 + 3 + 1  # table: every run
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "cmp4"), "--plot-runs", "sgd"]) == 2
    assert "--plot-runs" in capsys.readouterr().err
    # a mode none of the plotted runs has (SGD: the mean only) was a ValueError traceback from the plot
    assert main(["compare", str(run_dir), str(tmp_path / "sgd"), "--out", str(tmp_path / "cmp5"),
                 "--plot-runs", "sgd", "--plot-modes", "bma"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "foovb: error: --plot-modes: none of the plotted runs has bma (they have mean)")


@pytest.mark.slow
def test_std_histograms_are_labelled_by_evaluation(tmp_path, monkeypatch) -> None:
    """Continuous runs with eval_every also evaluate inside task periods: their histograms say where."""
    drawn = {}
    monkeypatch.setattr(plots, "plot_std_histograms",
                        lambda stds, path, initial_std=None, labels=None, title="": drawn.update(labels=labels))
    config = config_from_dict(quick(**{
        "scenario.kind": "continuous_permuted_mnist", "scenario.iterations_per_task": 10, "scenario.eval_every": 5,
        "scenario.train_subset": "null", "scenario.epochs_per_task": 20, "learner.params.mc_samples": 2,
        "threads": 1}))
    run(config, tmp_path / "cont", progress=False)
    assert drawn["labels"] == ["5 iterations (0.50 tasks)", "10 iterations (1.00 tasks)",
                               "15 iterations (1.50 tasks)", "20 iterations (2.00 tasks)"]


def test_compare_names_runs_of_equal_directory_names_by_their_paths(finished_run, tmp_path, capsys) -> None:
    """Two runs in directories of one name are named by their paths. One run given twice, as the same path, through
    a symlink or as a copy (a user's trial, session 56: counted as two seeds, std 0), is refused."""
    run_dir, _ = finished_run
    runs = [tmp_path / parent / run_dir.name for parent in ("x", "y")]
    shutil.copytree(run_dir, runs[0])
    run(config_from_dict({**quick(), "seed": 1}), runs[1], progress=False)
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare.csv").read_text().splitlines()))
    assert [r["run"] for r in rows] == [str(runs[0])] * 3 + [str(runs[1])] * 3
    (tmp_path / "link").symlink_to(runs[0])
    for twice, how in ((runs[0], "the same directory"), (tmp_path / "link", "the same directory"),
                       (run_dir, "the same run identity: a copy")):
        assert main(["compare", str(runs[0]), str(twice), "--out", str(tmp_path / "cmp2")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("foovb: error: a run directory is given twice") and how in err and err.count("\n") == 1


def test_experiment_key_ignores_only_seeds_name_and_execution_keys() -> None:
    key = experiment_key(quick())
    assert experiment_key(quick(seed=3, threads=1, checkpoint_every=5, name="other", device="auto",
                                **{"scenario.seed": 4})) == key
    assert experiment_key(quick(**{"learner.params.mc_samples": 2})) != key
    # a default written out, or a change of how the step is computed only, is the same experiment
    assert experiment_key(quick(**{"learner.params.std_init": 0.047, "learner.params.batched": "false"})) == key
    assert experiment_key(quick(**{"scenario.batch_size": 32})) != key


@pytest.mark.slow
def test_compare_averages_over_seeds(finished_run, tmp_path, capsys) -> None:
    run_dir, summary = finished_run
    other = tmp_path / "seed1"
    other_summary = run(config_from_dict(quick(seed=1, threads=1, **{"scenario.seed": 1})), other, progress=False)
    shutil.copytree(run_dir, tmp_path / "copy")
    changed = tmp_path / "k2"  # another experiment (a config copied in is refused: test_run_recovery)
    changed_summary = run(config_from_dict(quick(**{"learner.params.mc_samples": 2})), changed, progress=False)
    assert main(["compare", str(run_dir), str(other), str(changed), "--out", str(tmp_path / "cmp")]) == 0
    rows = list(csv.DictReader((tmp_path / "cmp" / "compare_seeds.csv").read_text().splitlines()))
    modes = ("mean", "bma", "single")
    assert [(r["experiment"], r["mode"]) for r in rows] == [(n, m) for n in (run_dir.name, "k2") for m in modes]
    for row in rows[:3]:
        values = [s["modes"][row["mode"]]["average_accuracy"] for s in (summary, other_summary)]
        forgetting = [s["modes"][row["mode"]]["forgetting"] for s in (summary, other_summary)]
        first = [s["modes"][row["mode"]]["first_task_accuracy"] for s in (summary, other_summary)]
        assert float(row["forgetting_mean"]) == pytest.approx(np.mean(forgetting), abs=1e-4)
        assert float(row["first_task_accuracy_mean"]) == pytest.approx(np.mean(first), abs=1e-4)
        finals = np.mean([np.loadtxt(d / f"accuracy_matrix_{row['mode']}.csv", delimiter=",")[-1]
                          for d in (run_dir, other)], axis=0)
        assert [float(x) for x in row["final_accuracy_per_task_mean"].split(" / ")] == pytest.approx(finals, abs=1e-4)
        assert (row["runs"], row["seeds"], row["num_runs"]) == (f"{run_dir.name} seed1", "0 1", "2")
        assert float(row["average_accuracy_mean"]) == pytest.approx(np.mean(values), abs=1e-4)
        assert float(row["average_accuracy_std"]) == pytest.approx(np.std(values, ddof=1), abs=1e-4)
        assert (float(row["average_accuracy_min"]), float(row["average_accuracy_max"])) == pytest.approx(
            (min(values), max(values)), abs=1e-4)
    assert rows[3]["average_accuracy_std"] == ""  # one run: no spread
    assert float(rows[3]["forgetting_mean"]) == pytest.approx(changed_summary["modes"]["mean"]["forgetting"],
                                                              abs=1e-4)
    assert "repeat a seed" not in capsys.readouterr().err
    assert main(["compare", str(run_dir), str(tmp_path / "copy"), "--out", str(tmp_path / "cmp2")]) == 2
    assert "are one run (the same run identity: a copy)" in capsys.readouterr().err  # one run, not two seeds
    run(config_from_dict(quick()), tmp_path / "again", progress=False)  # another run of the same seed
    assert main(["compare", str(run_dir), str(tmp_path / "again"), "--out", str(tmp_path / "cmp2")]) == 0
    assert "repeat a seed" in capsys.readouterr().err


def test_plot_from_saved_accuracy_matrices(finished_run, tmp_path, capsys, monkeypatch) -> None:
    run_dir, summary = finished_run
    hand = tmp_path / "hand.csv"  # A_3 = (0.5 + 0.7 + 0.9) / 3, first task 0.9 -> 0.8 -> 0.5
    hand.write_text("# task_0,task_1,task_2\n0.9,0.1,0.1\n0.8,0.95,0.1\n0.5,0.7,0.9\n")
    drawn = {}
    monkeypatch.setattr(plots, "plot_average_accuracy", lambda curves, path: drawn.update(average=curves))
    monkeypatch.setattr(plots, "plot_first_task_accuracy", lambda curves, path: drawn.update(first=curves))
    saved = run_dir / "accuracy_matrix_mean.csv"
    assert main(["plot", str(saved), str(hand), "--labels", "run", "by hand", "--out", str(tmp_path / "p")]) == 0
    rows = list(csv.DictReader((tmp_path / "p" / "plotted.csv").read_text().splitlines()))
    assert [r["label"] for r in rows] == ["run", "by hand"]
    assert float(rows[0]["average_accuracy"]) == pytest.approx(summary["modes"]["mean"]["average_accuracy"], abs=1e-4)
    assert float(rows[0]["first_task_accuracy"]) == pytest.approx(
        summary["modes"]["mean"]["first_task_accuracy"], abs=1e-4)
    assert float(rows[1]["average_accuracy"]) == pytest.approx(0.7, abs=1e-4)
    np.testing.assert_allclose(drawn["average"]["by hand"][1], [0.9, 0.875, 0.7])
    np.testing.assert_allclose(drawn["first"]["by hand"][1], [0.9, 0.8, 0.5])
    np.testing.assert_array_equal(drawn["first"]["by hand"][0], [1, 2, 3])
    assert main(["plot", str(saved), str(hand), "--out", str(tmp_path / "p1")]) == 0
    assert list(drawn["average"]) == [f"{run_dir.name} (mean)", "hand"]  # default labels
    assert main(["plot", str(hand), str(hand), "--out", str(tmp_path / "p2")]) == 2  # same default label
    assert "labels must differ, got ['hand', 'hand'] (read from the runs' names): name each matrix with --labels" \
        in capsys.readouterr().err
    assert main(["plot", str(hand), "--labels", "a", "b", "--out", str(tmp_path / "p3")]) == 2
    assert "2 labels for 1 matrices" in capsys.readouterr().err
    rectangular = tmp_path / "evaluations.csv"  # a continuous run's matrix: one row per evaluation
    rectangular.write_text("0.9,0.1\n0.8,0.9\n0.7,0.9\n")
    assert main(["plot", str(rectangular), "--out", str(tmp_path / "p4")]) == 2
    assert "must be square" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "p5")]) == 2


def test_plot_refuses_a_matrix_copied_into_another_runs_directory(finished_run, tmp_path, capsys) -> None:
    run_dir, _ = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    assert main(["plot", str(copy / "accuracy_matrix_mean.csv"), "--out", str(tmp_path / "p0")]) == 0  # its own
    capsys.readouterr()
    (copy / "accuracy_matrix_mean.csv").write_text("0.9,0.1\n0.8,0.95\n")  # another run's, the name kept
    assert main(["plot", str(copy / "accuracy_matrix_mean.csv"), "--out", str(tmp_path / "p")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "copied from another run?" in error[0] and "summary.json" in error[0]
    assert not (tmp_path / "p").exists()
    (copy / "summary.json").unlink()  # an unfinished run's directory, or a folder of saved matrices: not checked
    assert main(["plot", str(copy / "accuracy_matrix_mean.csv"), "--out", str(tmp_path / "p")]) == 0


@pytest.mark.parametrize(("content", "says"), [
    ("iteration,task,loss\n10,0,0.5\n", "not an accuracy matrix, which holds numbers only"),  # metrics.csv
    (",0,1\n0,0.9,0.1\n1,0.8,0.9\n", "not an accuracy matrix, which holds numbers only"),  # pandas' to_csv
    ("90,10\n80,90\n", r"fractions in \[0, 1\], found 90 \(percentages"),  # plotted as if 90x better
    ("", "empty \\(no accuracies\\)")])
def test_plot_refuses_what_is_not_an_accuracy_matrix_in_one_line(tmp_path, capsys, content, says) -> None:
    path = tmp_path / "m.csv"
    path.write_text(content)
    assert main(["plot", str(path), "--out", str(tmp_path / "p")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"foovb: error: {path}: ") and re.search(says, error[0])
    assert "eval_every" not in error[0]
    assert not (tmp_path / "p").exists()


def test_cli_reports_config_errors(tmp_path, capsys) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("scenario: {kind: split_mnist, batch_size: -3}\nlearner: {kind: sgd}\n")
    assert main(["run", str(config), "--out", str(tmp_path / "x")]) == 2
    assert "scenario.batch_size" in capsys.readouterr().err


def _write_idx(path, array: np.ndarray) -> str:
    """An IDX gz file; returns the MD5SUMS.uncompressed line of its content."""
    import gzip
    import hashlib

    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    content = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(content))
    return f"{hashlib.md5(content).hexdigest()}  {path.name.removesuffix('.gz')}"


def _write_learnable_idx_dataset(directory, seed: int, train: int = 96, test: int = 40) -> None:
    """MNIST-layout files whose class c is a bright 6x6 square at a class-specific place, plus noise, and the
    MD5SUMS.uncompressed that declares them (a stand-in dataset: the real one's digests would refuse them)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    sums = []
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count)
        images = rng.integers(0, 60, (count, 28, 28))
        for i, c in enumerate(labels):
            row, col = divmod(int(c), 5)
            images[i, 4 + 12 * row : 10 + 12 * row, 2 + 5 * col : 8 + 5 * col] = 255
        sums.append(_write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images))
        sums.append(_write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels))
    (directory / "MD5SUMS.uncompressed").write_text("\n".join(sums) + "\n")


@pytest.mark.slow
def test_vision_mix_task_aware_lenet_end_to_end(tmp_path, monkeypatch) -> None:
    """Multi-head LeNet on two (synthetic stand-in) datasets through FOO-VB's step_batched (one sample at a time
    on the CPU, as for every Conv2d model); the learner gets each batch's task id."""
    tasks = _spy_on_observe(monkeypatch)
    for name, seed in (("fashion_mnist", 1), ("notmnist", 2)):
        _write_learnable_idx_dataset(tmp_path / "data" / name, seed)
    config = config_from_dict({
        "name": "vision", "scenario": {"kind": "vision_mix", "num_tasks": 2, "epochs_per_task": 4,
                                       "batch_size": 16, "data_dir": str(tmp_path / "data"),
                                       "datasets": ["fashion_mnist", "notmnist"]},
        "model": {"kind": "lenet"},
        "learner": {"kind": "foovb", "params": {"std_init": 0.02, "mc_samples": 4, "eval_samples": 2}},
    })
    summary = run(config, tmp_path / "run", progress=False)
    assert tasks == [0] * 24 + [1] * 24
    # 24 steps per task on 96 images: the class squares are easy, chance is 10%.
    assert summary["modes"]["mean"]["average_accuracy"] > 0.3
    assert summary["modes"]["mean"]["first_task_accuracy"] > 0.3


def test_every_shipped_config_is_valid() -> None:
    from pathlib import Path

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(configs) >= 10
    for path in configs:
        config = load_config(path)
        assert config.name == path.stem or path.stem == "demo", path


def test_vision_mix_task_agnostic_and_subset_end_to_end(tmp_path, monkeypatch) -> None:
    """The task-agnostic vision mix (issue 39): one 10-way head shared by the datasets, no task id for the learner
    or at evaluation; `train_subset` trains on the first N images of each dataset; its joint oracle runs, and so
    does the task-aware one (single-task batches)."""
    tasks = _spy_on_observe(monkeypatch)
    for name, seed in (("fashion_mnist", 1), ("notmnist", 2)):
        _write_learnable_idx_dataset(tmp_path / "data" / name, seed)
    scenario = {"kind": "vision_mix", "num_tasks": 2, "epochs_per_task": 4, "batch_size": 16, "train_subset": 64,
                "task_agnostic": True, "data_dir": str(tmp_path / "data"), "datasets": ["fashion_mnist", "notmnist"]}
    config = config_from_dict({"name": "vision", "scenario": scenario, "model": {"kind": "lenet"},
                               "learner": {"kind": "sgd", "params": {"lr": 0.05}}})
    learner = factories.build_learner(config, factories.build_scenario(config), torch.device("cpu"))
    assert learner.model[-1].out_features == 10  # one shared head (task-aware: 2 heads, 20 outputs)
    summary = run(config, tmp_path / "run", progress=False)
    assert tasks == [None] * 32  # 64 of the 96 images, 4 epochs of 4 batches, per dataset
    assert summary["iterations"] == 32 and summary["modes"]["mean"]["average_accuracy"] > 0.3
    joint = config_from_dict({**config_to_dict(config), "scenario": {**scenario, "joint": True}})
    assert run(joint, tmp_path / "joint", progress=False)["modes"]["mean"]["average_accuracy"] > 0.3
    tasks.clear()  # the task-aware joint oracle: single-task batches of both datasets, each with its task id
    aware_joint = config_from_dict({**config_to_dict(config),
                                    "scenario": {**scenario, "task_agnostic": False, "joint": True}})
    assert run(aware_joint, tmp_path / "aware_joint", progress=False)["modes"]["mean"]["average_accuracy"] > 0.3
    assert len(tasks) == 32 and sorted(set(tasks)) == [0, 1] and tasks[:16] != sorted(tasks[:16])
    with pytest.raises(ValueError, match=r"train_subset must be in \[1, 96\]"):
        factories.build_scenario(config_from_dict({**config_to_dict(config),
                                                "scenario": {**scenario, "train_subset": 97}}))


def test_a_run_resumes_with_its_data_directory_moved(tmp_path) -> None:
    """scenario.data_dir says where the datasets are, not what the run computes: a run moved to a machine that
    keeps them elsewhere (or resumed from another working directory, with a relative data_dir) was refused as a
    changed config. It resumes to the uninterrupted run's metrics; any other change is still refused."""
    for name, seed in (("fashion_mnist", 1), ("notmnist", 2)):
        _write_learnable_idx_dataset(tmp_path / "data" / name, seed)
    scenario = {"kind": "vision_mix", "num_tasks": 2, "epochs_per_task": 1, "batch_size": 16, "train_subset": 64,
                "data_dir": str(tmp_path / "data"), "datasets": ["fashion_mnist", "notmnist"]}
    config = {"name": "vision", "scenario": scenario, "model": {"kind": "mlp", "hidden": [8]},
              "learner": {"kind": "sgd", "params": {"lr": 0.05}}, "evaluation": {"test_subset": 20}}
    uninterrupted = run(config_from_dict(config), tmp_path / "whole", progress=False)
    assert run(config_from_dict(config), tmp_path / "r", progress=False, stop_after=5) == {"interrupted_at": 5}
    (tmp_path / "data").rename(tmp_path / "moved")
    moved = {**config, "scenario": {**scenario, "data_dir": str(tmp_path / "moved")}}
    with pytest.raises(ConfigError, match=r"\(learner.params.lr: 0.05 there, 0.5 here\); only .* and scenario.data_dir "
                                          "may change"):
        run(config_from_dict({**moved, "learner": {"kind": "sgd", "params": {"lr": 0.5}}}), tmp_path / "r",
            resume=True, progress=False)
    resumed = run(config_from_dict(moved), tmp_path / "r", resume=True, progress=False)
    assert resumed["modes"] == uninterrupted["modes"]
    assert loading.experiment_key(moved) == loading.experiment_key(config)


# --- your own data and model: the custom scenario and model ------------------------------------------------------

SUITE_PAGE = Path(__file__).parent.parent / "docs" / "suite.md"


def _documented_commands() -> list[list[str]]:
    """The commands of docs/suite.md's custom example (the bash block of "Your own data and model"), as the
    arguments of `foovb`."""
    section = SUITE_PAGE.read_text().split("\n## Your own data and model\n")[1].split("\n## ")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("foovb ")]


def _without_plots(monkeypatch) -> None:
    """The runs that follow draw no plots (the slowest outputs; the documented example's test draws them)."""
    for name in dir(plots):
        if name.startswith("plot_"):
            monkeypatch.setattr(plots, name, lambda *args, **kwargs: None)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """tmp_path as the working directory; the modules imported from it are forgotten after the test."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def example_dir(user_dir):
    """docs/suite.md's custom example (two_tasks.py, two_tasks.yaml) saved in the working directory."""
    for name, content in page_files(SUITE_PAGE).items():
        (user_dir / name).write_text(content)
    return user_dir


def _records(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "train_seconds"} for r in load_run(run_dir)["records"]]


def test_the_documented_custom_example_runs_and_compares(example_dir, capsys) -> None:
    """docs/suite.md's module, YAML and commands, as a reader runs them: FOO-VB with the custom model on the
    two-task stream, SGD on it, and `foovb compare` on the two runs."""
    commands = _documented_commands()
    assert [argv[0] for argv in commands] == ["run", "run", "compare"]
    for argv in commands:
        assert main([*argv, *(["--no-progress"] if argv[0] == "run" else [])]) == 0, capsys.readouterr().err
    foovb_dir, sgd_dir = Path("runs/two_tasks"), Path("runs/two_tasks_sgd")
    summary = json.loads((foovb_dir / "summary.json").read_text())
    assert (summary["scenario"], summary["num_tasks"], summary["iterations"]) == ("custom", 2, 2 * 3 * 13)
    assert set(summary["modes"]) == {"mean", "bma", "single"}
    assert summary["modes"]["mean"]["average_accuracy"] > 0.9  # two easy tasks of four classes
    assert [r["iteration"] for r in load_run(foovb_dir)["records"]] == [39, 78]  # every task's end
    saved = yaml.safe_load((foovb_dir / "config.yaml").read_text())  # the config as given, defaults filled in
    assert {key: saved["scenario"][key] for key in ("kind", "factory", "args", "mode", "num_tasks")} == {
        "kind": "custom", "factory": "two_tasks:make_tasks", "args": {"examples_per_class": 200, "seed": 0},
        "mode": "discrete", "num_tasks": 2}
    assert {key: saved["model"][key] for key in ("kind", "factory", "args")} == {
        "kind": "custom", "factory": "two_tasks:make_model", "args": {"hidden": 64}}
    for name in ("average_accuracy_mean.png", "first_task_accuracy_mean.png", "accuracy_matrix_mean.png",
                 "std_histograms.png"):
        assert (foovb_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    with open("runs/compare/compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["learner"], r["scenario"], r["mode"]) for r in rows] == [
        ("two_tasks", "foovb-auto", "custom", "mean"), ("two_tasks", "foovb-auto", "custom", "bma"),
        ("two_tasks", "foovb-auto", "custom", "single"), ("two_tasks_sgd", "sgd", "custom", "mean")]
    assert "differ in their protocol" not in capsys.readouterr().err
    model = load_model(foovb_dir)  # the module is found from the working directory
    assert (model[1].out_features, model[-1].out_features) == (64, 4)  # hidden: 64; 4 classes, from the labels
    assert (sgd_dir / "summary.json").is_file()


@pytest.mark.parametrize("mode", ["discrete", "continuous"])
def test_an_interrupted_custom_run_resumes_to_the_uninterrupted_result(example_dir, monkeypatch, mode) -> None:
    config = example_dir / "two_tasks.yaml"
    if mode == "continuous":  # as docs/suite.md says
        config.write_text(config.read_text().replace("epochs_per_task: 3",
                                                     "mode: continuous\n  iterations_per_task: 40"))
    _without_plots(monkeypatch)
    assert main(["run", str(config), "--out", "whole", "--no-progress"]) == 0
    with monkeypatch.context() as patch:
        _crash_at(patch, 50)  # after the first evaluation's checkpoint (39 or 40 iterations)
        with pytest.raises(_Crash):
            main(["run", str(config), "--out", "resumed", "--no-progress"])
    assert torch.load(example_dir / "resumed" / "checkpoint.pt")["iteration"] == (39 if mode == "discrete" else 40)
    assert main(["run", str(config), "--out", "resumed", "--no-progress", "--resume"]) == 0
    whole, resumed = (json.loads((example_dir / d / "summary.json").read_text()) for d in ("whole", "resumed"))
    assert resumed["modes"] == whole["modes"]
    assert _records(example_dir / "resumed") == _records(example_dir / "whole")
    assert [r["iteration"] for r in _records(example_dir / "whole")] == ([39, 78] if mode == "discrete" else [40, 80])


def _interrupted_then_edited(example_dir, monkeypatch, old: str, new: str) -> None:
    """The documented example run in "r", interrupted after its checkpoint at iteration 5; then `old` in its module
    replaced by `new` (the module imported afresh at the next run)."""
    _without_plots(monkeypatch)
    with monkeypatch.context() as patch:
        _crash_at(patch, 10)
        with pytest.raises(_Crash):
            main(["run", "two_tasks.yaml", "--out", "r", "--no-progress", "--set", "checkpoint_every=5"])
    module = example_dir / "two_tasks.py"
    assert old in module.read_text()
    module.write_text(module.read_text().replace(old, new))
    del sys.modules["two_tasks"]


def test_resume_refuses_a_factory_that_returns_other_data(example_dir, monkeypatch, capsys) -> None:
    _interrupted_then_edited(example_dir, monkeypatch, "centres = 2 * torch.randn", "centres = 3 * torch.randn")
    assert main(["run", "two_tasks.yaml", "--out", "r", "--no-progress", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("foovb: error: --resume: scenario.factory 'two_tasks:make_tasks' returns other data than "
                          "when the run started (SHA-256 ") and err.count("\n") == 1, err


@pytest.mark.parametrize("edit", ["activation", "comment"])
def test_resume_refuses_a_model_factory_that_builds_another_model(example_dir, monkeypatch, capsys, edit) -> None:
    """A user's trial changed the factory's activation and resumed: the checkpoint's weights trained on in another
    network, silently. Now another model (its modules as printed) is an error; the factory's file edited with the
    same modules (a comment here; a function in a forward would be too) resumes with a warning naming the file."""
    old = "nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),"
    _interrupted_then_edited(example_dir, monkeypatch, old, old.replace("ReLU", "Tanh") if edit == "activation" else
                             old + "  # hidden layer")
    module = example_dir / "two_tasks.py"
    code = main(["run", "two_tasks.yaml", "--out", "r", "--no-progress", "--resume"])
    err = capsys.readouterr().err
    if edit == "activation":
        assert code == 2
        assert err.startswith("foovb: error: --resume: model.factory 'two_tasks:make_model' builds another model than "
                              "when the run started") and err.count("\n") == 1, err
        assert not (example_dir / "r" / "summary.json").exists()
    else:
        assert code == 0, err
        assert f"foovb: warning: --resume: {module.resolve()}, which holds model.factory 'two_tasks:make_model', " \
               "changed since checkpoint.pt was written" in err, err
        assert (example_dir / "r" / "summary.json").is_file()


def test_resume_warns_when_a_file_defining_the_models_class_changed(example_dir, monkeypatch, capsys) -> None:
    """The model's class lives in a module the factory's file imports, and its forward (which the printout does not
    show) is edited before --resume: only the factory's file was hashed before session 56, so the run resumed in
    silence on another network. Now the warning names that module's file."""
    layers = example_dir / "my_layers.py"
    layers.write_text("import torch\nfrom torch import nn\n\n\nclass Scaled(nn.Module):\n"
                      "    def forward(self, x):\n        return torch.relu(x)\n")
    module = example_dir / "two_tasks.py"
    old = "nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),"
    assert old in module.read_text()
    module.write_text("from my_layers import Scaled\n" + module.read_text().replace(
        old, old.replace("nn.ReLU()", "Scaled()")))
    _interrupted_then_edited(example_dir, monkeypatch, "Scaled", "Scaled")  # the factory's file unchanged
    layers.write_text(layers.read_text().replace("torch.relu(x)", "torch.tanh(x)"))
    del sys.modules["my_layers"]
    code = main(["run", "two_tasks.yaml", "--out", "r", "--no-progress", "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "foovb: warning: --resume: module 'my_layers' (it defines a class of the model) changed since " \
           "checkpoint.pt was written; its modules are the same" in err, err
    assert str(module.resolve()) not in err, err
    record = json.loads((example_dir / "r" / "summary.json").read_text())["run"]["model"]
    assert list(record["classes"]) == ["my_layers"] and str(layers) not in json.dumps(record["classes"])  # no paths


@pytest.mark.parametrize("edit", ["data", "model"])
def test_compare_does_not_average_one_config_trained_on_other_data(example_dir, monkeypatch, capsys, edit) -> None:
    """The factory's module edited between two seeds of one config: compare averaged them as one experiment's seeds
    (summary.json did not record the data, nor the model before session 54); now each is its own row, with a warning.
    Two seeds on the same data and model are still one row."""
    _without_plots(monkeypatch)
    module = example_dir / "two_tasks.py"
    old, new = (("centres = 2 * torch.randn", "centres = 3 * torch.randn") if edit == "data" else
                ("hidden), nn.ReLU(),", "hidden), nn.Tanh(),"))
    for seed, out in ((0, "a"), (1, "b"), (2, "c")):
        if out == "c":  # the module edited before the third run
            assert old in module.read_text()
            module.write_text(module.read_text().replace(old, new))
            del sys.modules["two_tasks"]
        assert main(["run", "two_tasks.yaml", "--out", out, "--no-progress", "--set", f"seed={seed}"]) == 0
    records = [json.loads((example_dir / d / "summary.json").read_text())["run"] for d in "abc"]
    changed = [record[edit] if edit == "data" else record["model"]["modules"] for record in records]
    assert changed[0] == changed[1] != changed[2] and len(changed[0]) == 64
    capsys.readouterr()
    assert main(["compare", "a", "b", "c", "--out", "cmp"]) == 0
    assert "[a, b] and [c] have one config but were trained on different data or models" in capsys.readouterr().err
    with open("cmp/compare_seeds.csv") as f:
        rows = [(r["runs"], r["num_runs"]) for r in csv.DictReader(f) if r["mode"] == "mean"]
    assert rows == [("a b", "2"), ("c", "1")]


def test_factories_are_imported_from_the_config_files_directory(tmp_path, user_dir, monkeypatch, capsys) -> None:
    folder, elsewhere = tmp_path / "experiment", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    for name, content in page_files(SUITE_PAGE).items():
        (folder / name).write_text(content)
    monkeypatch.chdir(elsewhere)
    _without_plots(monkeypatch)
    path_before = list(sys.path)
    assert main(["run", str(folder / "two_tasks.yaml"), "--set", "scenario.epochs_per_task=1", "--out", "r",
                 "--no-progress"]) == 0
    assert sys.modules["two_tasks"].__file__ == str(folder / "two_tasks.py")
    assert sys.path == path_before  # the directories lead sys.path only while a factory is imported and called
    # the hint it prints says where load_model finds the modules (it printed load_model('r') alone, which fails here)
    assert capsys.readouterr().out.endswith(f"model: foovb_suite.load_model('{elsewhere.resolve() / 'r'}') (learner: "
                                            f"load_learner), run in {folder.resolve()} or with it on sys.path: the "
                                            "factories' modules are there\n")
    assert main(["run", str(folder / "two_tasks.yaml"), "--set", "scenario.factory=nowhere:make_tasks", "--out",
                 "r2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "foovb: error: scenario.factory 'nowhere:make_tasks': no module named 'nowhere'; 'module:function' imports "
        f"the module from the working directory {elsewhere.resolve()}, then the config file's directory "
        f"{folder.resolve()}, then sys.path (the installed packages): put nowhere.py there\n")


BROKEN_FACTORIES = """import torch
import two_tasks


def raising(**kwargs):
    raise RuntimeError("no data today")


def number(**kwargs):
    return 42


def not_a_model(**kwargs):
    return "mlp"


def too_wide(input_shape, num_classes, **kwargs):
    return torch.nn.Linear(input_shape[0], num_classes + 1)


def one_pair(**kwargs):
    return two_tasks.make_tasks()[0]


def no_tasks(**kwargs):
    return []


def nan_input(**kwargs):
    tasks = two_tasks.make_tasks()
    tasks[1][0].tensors[0][5, 3] = float("nan")
    return tasks


def label_beyond(**kwargs):
    tasks = two_tasks.make_tasks()
    tasks[1][1].tensors[1][2] = 7
    return tasks


def bad_width(input_shape, num_classes, hidden=64, width="abc"):
    return torch.nn.Linear(input_shape[0], width)
"""


@pytest.mark.parametrize(("change", "message"), [
    ("scenario.factory=nowhere:make_tasks", "scenario.factory 'nowhere:make_tasks': no module named 'nowhere'; "
     "'module:function' imports the module from the working directory {dir}, then sys.path (the installed "
     "packages): put nowhere.py there"),
    ("scenario.factory=two_tasks:make_taks", "scenario.factory 'two_tasks:make_taks': module 'two_tasks' "
     "({dir}/two_tasks.py) has no attribute 'make_taks' (did you mean 'make_tasks'?); if that is not your module: "
     "'module:function' imports the module from the working directory {dir}, then sys.path (the installed "
     "packages): put two_tasks.py there"),
    ("scenario.factory=needs_more:make_tasks", "scenario.factory 'needs_more:make_tasks': importing needs_more "
     "raised ModuleNotFoundError: No module named 'no_such_dependency' (at {dir}/needs_more.py:1)"),
    ("scenario.factory=broken:raising",
     "scenario.factory 'broken:raising' raised RuntimeError: no data today (at {dir}/broken.py:6)"),
    ("scenario.factory=broken:number", "scenario.factory 'broken:number': expected a list of tasks, each a (train, "
     "test) pair of torch Datasets, got int"),
    ("scenario.args.n=3", "scenario.args: two_tasks:make_tasks cannot be called with them (got an unexpected "
     "keyword argument 'n')"),
    ("scenario.num_tasks=3", "scenario.num_tasks: 3, but scenario.factory 'two_tasks:make_tasks' returned 2 "
     "task(s); set scenario.num_tasks: 2 (or fewer: the first tasks)"),
    ("scenario.num_classes=3", "scenario.num_classes: 3, but the labels of scenario.factory 'two_tasks:make_tasks' "
     "go up to 3"),
    ("scenario.factory=broken:one_pair", "scenario.factory 'broken:one_pair' returned a tuple of 2 Datasets, not a "
     "list of tasks: return one (train, test) pair per task, [(train_0, test_0), (train_1, test_1), ...]"),
    ("scenario.factory=broken:no_tasks", "scenario.factory 'broken:no_tasks' returned no tasks (an empty list): "
     "return one (train, test) pair per task"),
    ("scenario.factory=broken:nan_input", "scenario.factory 'broken:nan_input': task 1's training set: non-finite "
     "inputs (NaN or inf) in 1 example(s), the first example 5"),  # not a divergence blamed on the settings
    ("scenario.factory=broken:label_beyond", "scenario.factory 'broken:label_beyond': task 1's test set "
     "has label(s) [7] that no training set holds, and the model's outputs are the largest label + 1 (8): a label "
     "out of range? If those classes are meant, set scenario.num_classes"),  # an 8-way model, silently
    ("model.factory=broken:not_a_model", "model.factory 'broken:not_a_model': expected a torch.nn.Module, got str"),
    ("model.factory=broken:too_wide", "model.factory 'broken:too_wide': its model maps inputs of shape (2, 20) to "
     "(2, 5), expected logits of shape (2, 4) (4 classes)"),
    ("model.args.num_classes=3", "model.args.num_classes: set by the runner (4, from the stream); leave it out"),
    ("learner.kind=si", "learner.kind: 'si' needs task ids, and custom is task-agnostic"),
])
def test_a_factory_that_fails_is_one_error_line_naming_it(example_dir, capsys, change, message) -> None:
    (example_dir / "broken.py").write_text(BROKEN_FACTORIES)
    (example_dir / "needs_more.py").write_text("import no_such_dependency\n")
    sets = [change, *(["learner.params={}"] if change.startswith("learner") else [])]
    assert main(["run", "two_tasks.yaml", *(arg for item in sets for arg in ("--set", item)), "--out", "r",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == f"foovb: error: {message.format(dir=example_dir.resolve())}\n"
    assert not (example_dir / "r").exists()


def test_an_error_raised_inside_torch_names_the_users_line_first(example_dir, capsys) -> None:
    """It named torch's line alone (linear.py), not the factory's line that passed the bad value."""
    (example_dir / "broken.py").write_text(BROKEN_FACTORIES)
    assert main(["run", "two_tasks.yaml", "--set", "model.factory=broken:bad_width", "--out", "r",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    line = next(number for number, text in enumerate(BROKEN_FACTORIES.splitlines(), 1) if "width)" in text)
    assert re.fullmatch(rf"foovb: error: model.factory 'broken:bad_width' raised TypeError: .* \(at "
                        rf"{re.escape(str(example_dir.resolve()))}/broken.py:{line}, raised in \S+/torch/nn/modules/"
                        r"linear.py:\d+\)\n", err), err


@pytest.mark.parametrize("kind", [kind for kind in LEARNERS if kind != "si"])  # si: the error line above
def test_every_learner_trains_the_builtin_mlp_on_a_custom_stream(example_dir, monkeypatch, kind) -> None:
    _without_plots(monkeypatch)
    sets = [f"learner.kind={kind}", "learner.params={}", "model={kind: mlp, hidden: [16]}",
            "scenario.epochs_per_task=1"]
    assert main(["run", "two_tasks.yaml", *(arg for item in sets for arg in ("--set", item)), "--out", "r",
                 "--no-progress"]) == 0
    summary = json.loads((example_dir / "r" / "summary.json").read_text())
    assert (summary["scenario"], summary["iterations"]) == ("custom", 26)
    assert 0 <= summary["modes"]["mean"]["average_accuracy"] <= 1
    trained = load_model(example_dir / "r")
    config = loading.saved_config(example_dir / "r")
    initial = factories.build_learner(config, factories.build_scenario(config), torch.device("cpu")).model
    assert [layer.out_features for layer in trained if hasattr(layer, "out_features")] == [16, 4]  # 4 classes
    assert any(not torch.equal(a, b) for a, b in zip(initial.parameters(), trained.parameters(), strict=True))


def test_a_custom_model_is_given_the_input_shape_and_the_logits_to_output(user_dir) -> None:
    """The model factory takes them by **kwargs here; in the task-aware vision mix the logits are tasks x classes.
    The model is built after torch.manual_seed(seed): the same weights every time."""
    (user_dir / "nets.py").write_text(
        "import torch\n\nGIVEN = []\n\n\ndef make(**given):\n    GIVEN.append(given)\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, given['num_classes']))\n")
    config = config_from_dict(quick(**{"scenario.kind": "vision_mix", "scenario.data_dir": "d",
                                       "model.kind": "custom", "model.hidden": "[100, 100]",
                                       "model.factory": "nets:make", "model.args": "{depth: 1}"}))
    stream = SimpleNamespace(num_tasks=2, task_aware=True, input_shape=(3, 32, 32), num_classes=10)
    first, second = (factories.build_learner(config, stream, torch.device("cpu")) for _ in range(2))
    assert sys.modules["nets"].GIVEN == [{"input_shape": (3, 32, 32), "num_classes": 20, "depth": 1}] * 2
    assert first.model[-1].out_features == 20
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True))


def _tensorboard_events(run_dir: Path):
    """The EventAccumulator of a run's RUN/tensorboard/ event files, every point kept."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def _steps(events, tag: str) -> list[int]:
    return [point.step for point in events.Scalars(tag)]


def test_tensorboard_logs_loss_accuracies_and_posterior_stds_during_the_run(tmp_path, capsys) -> None:
    """TINY (20 iterations, evaluations after 10 and 20) with --tensorboard: the loss every tensorboard_every
    iterations, each task's accuracy in every mode at each evaluation (metrics.jsonl's), FOO-VB's STDs per layer."""
    pytest.importorskip("tensorboard")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    run_dir = tmp_path / "r"
    assert main(["run", str(config), "--set", "threads=1", "--set", "tensorboard_every=3", "--out", str(run_dir),
                 "--no-progress", "--tensorboard"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["tensorboard"] is True and saved["tensorboard_every"] == 3
    events = _tensorboard_events(run_dir)
    assert _steps(events, "train/loss") == [3, 6, 9, 12, 15, 18, 20]  # and the last two iterations' at the end
    assert all(0 < point.value < 10 for point in events.Scalars("train/loss"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [10, 20]
    for mode in ("mean", "bma", "single"):
        for task in range(2):
            points = events.Scalars(f"accuracy/{mode}/task_{task}")
            assert [p.step for p in points] == [10, 20]
            np.testing.assert_allclose([p.value for p in points], [r["accuracy"][mode][task] for r in records],
                                       rtol=1e-6)
        average = [p.value for p in events.Scalars(f"accuracy/{mode}/average_seen")]
        np.testing.assert_allclose(average, [records[0]["accuracy"][mode][0], np.mean(records[1]["accuracy"][mode])],
                                   rtol=1e-6)
    layers = [f"{i}.{kind}" for i in (1, 3, 5) for kind in ("weight", "bias")]
    assert sorted(events.Tags()["histograms"]) == sorted(f"posterior_std/{name}" for name in layers)
    final = np.load(run_dir / "stds.npz")["iteration_20"]  # every weight's STD, layer after layer
    for name in layers:
        assert [h.step for h in events.Histograms(f"posterior_std/{name}")] == [10, 20]
        low, mean, high = (events.Scalars(f"posterior_std/{name}/{s}")[-1].value for s in ("min", "mean", "max"))
        assert 0 < low <= mean <= high
    minima = [events.Scalars(f"posterior_std/{name}/min")[-1].value for name in layers]
    np.testing.assert_allclose(min(minima), final.min(), rtol=1e-6)


def test_tensorboard_of_a_baseline_has_no_stds_and_resume_may_turn_it_on(tmp_path) -> None:
    """SGD has no posterior: accuracies (mean mode only) and loss, no STD tags. `tensorboard` is an execution
    setting: a run started without it resumes with it, logging from the checkpoint on."""
    pytest.importorskip("tensorboard")
    data = {**TINY, "learner": {"kind": "sgd", "params": {}}, "threads": 1}
    assert run(config_from_dict(data), tmp_path / "r", progress=False, stop_after=5) == {"interrupted_at": 5}
    assert not (tmp_path / "r" / "tensorboard").exists()
    run(config_from_dict({**data, "tensorboard": True, "tensorboard_every": 2}), tmp_path / "r", resume=True,
        progress=False)
    events = _tensorboard_events(tmp_path / "r")
    assert _steps(events, "train/loss") == [6, 8, 10, 12, 14, 16, 18, 20]
    assert sorted(events.Tags()["scalars"]) == sorted(["train/loss", "accuracy/mean/average_seen",
                                                       "accuracy/mean/task_0", "accuracy/mean/task_1"])
    assert events.Tags()["histograms"] == []
    assert _steps(events, "accuracy/mean/task_1") == [10, 20]


def test_tensorboard_resumes_a_crashed_run_in_the_same_directory(tmp_path, monkeypatch) -> None:
    """A crash after 13 iterations (checkpoint after 10): the event file is closed on the way out, and the resumed
    run adds its own, purging the interrupted run's points after the checkpoint (purge_step), so that every step
    has one point."""
    pytest.importorskip("tensorboard")
    config = config_from_dict({**TINY, "threads": 1, "tensorboard": True, "tensorboard_every": 2})
    _crash_at(monkeypatch, 13)
    with pytest.raises(_Crash):
        run(config, tmp_path / "r", progress=False)
    events = _tensorboard_events(tmp_path / "r")
    assert _steps(events, "train/loss") == [2, 4, 6, 8, 10, 12, 13]  # 13: the pending loss, written on the way out
    assert _steps(events, "accuracy/mean/task_0") == [10]
    crashed_twelve = events.Scalars("train/loss")[5]
    monkeypatch.undo()
    run(config, tmp_path / "r", resume=True, progress=False)
    assert len(list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = _tensorboard_events(tmp_path / "r")
    assert _steps(events, "train/loss") == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]  # 13 purged
    assert _steps(events, "accuracy/mean/task_0") == [10, 20]
    assert [h.step for h in events.Histograms("posterior_std/1.weight")] == [10, 20]
    # step 12 (the mean loss of iterations 11 and 12) is the resumed run's point, of the same value (resume repeats
    # the same steps)
    twelve = events.Scalars("train/loss")[5]
    assert twelve.wall_time > crashed_twelve.wall_time and twelve.value == crashed_twelve.value


def test_tensorboard_without_its_package_is_one_error_line_before_anything_is_written(tmp_path, capsys,
                                                                                    monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    assert main(["run", str(config), "--out", str(tmp_path / "r"), "--no-progress", "--tensorboard"]) == 2
    assert capsys.readouterr().err == ('foovb: error: --tensorboard needs the tensorboard package: '
                                       'pip install "foovb[tensorboard]"\n')
    assert not (tmp_path / "r").exists()


def test_tensorboard_is_an_execution_setting_kept_by_the_resume_command(tmp_path) -> None:
    """Runs that differ in it are one experiment (`foovb compare`), and the command printed on Ctrl-C keeps it."""
    from foovb_suite.cli import _interrupted_message, build_parser

    assert experiment_key(quick(tensorboard="true", tensorboard_every=5)) == experiment_key(quick())
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    args = build_parser().parse_args(["run", "c.yaml", "--out", str(tmp_path), "--no-progress", "--tensorboard"])
    assert _interrupted_message("saved", args, tmp_path).endswith(
        f"resume with: foovb run c.yaml --out {tmp_path} --resume --no-progress --tensorboard")


def test_compare_and_plot_refuse_an_out_that_would_mix_outputs(finished_run, tmp_path, capsys) -> None:
    """A user's trial (session 56): `foovb compare ... --out RUN` wrote its table and plots into a finished run's
    directory, and `foovb plot --out` over a compare's directory replaced its plots beside its compare.csv."""
    run_dir, _ = finished_run
    before = sorted(p.name for p in run_dir.rglob("*"))
    matrix = str(run_dir / "accuracy_matrix_mean.csv")
    for argv in (["compare", str(run_dir), "--out", str(run_dir)], ["plot", matrix, "--out", str(run_dir)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"foovb: error: --out {run_dir} is a run directory") and err.count("\n") == 1, err
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "cmp")]) == 0
    assert main(["plot", matrix, "--out", str(tmp_path / "cmp")]) == 2
    assert "holds the outputs of another command (compare.csv)" in capsys.readouterr().err
    assert main(["plot", matrix, "--out", str(tmp_path / "p")]) == 0
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "p")]) == 2
    assert "holds the outputs of another command (plotted.csv)" in capsys.readouterr().err
