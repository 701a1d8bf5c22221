"""One protocol per scenario: every shipped config of a benchmark feeds its learner the same data, input pipeline,
model and evaluation (issue 38: the discrete baselines once ran 784-pixel inputs while FOO-VB ran the authors'
32x32 padded ones), and `foovb compare` warns when the runs it tabulates do not."""

import json
from pathlib import Path

import pytest
import yaml

from foovb_suite.cli import main
from foovb_suite.config import load_config, protocol_of

CONFIGS = Path(__file__).parent.parent / "configs"


def benchmark_of(path: Path) -> str:
    """The benchmark a shipped config belongs to: its name up to the learner's part (`discrete_pmnist_mas` ->
    `discrete_pmnist`, `discrete_pmnist_joint` -> `discrete_pmnist`)."""
    config = load_config(path)
    for suffix in ("_joint", f"_{config.learner.kind}"):
        if suffix in config.name:
            return config.name[: config.name.index(suffix)]
    raise AssertionError(f"{path.name}: its name does not name its learner ({config.learner.kind})")


def benchmarks() -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.stem != "demo":
            groups.setdefault(benchmark_of(path), []).append(path)
    return groups


def test_the_benchmarks_are_the_suites_scenarios() -> None:
    assert set(benchmarks()) == {"discrete_pmnist", "continuous_pmnist", "split_mnist", "mesu_protocol",
                                 "rotated_mnist", "vision_mix", "mnist_fashion"}


@pytest.mark.parametrize("suite_benchmark", sorted(benchmarks()))
def test_every_learner_of_a_benchmark_has_one_protocol(suite_benchmark: str) -> None:
    paths = benchmarks()[suite_benchmark]
    reference = protocol_of(load_config(paths[0]))
    for path in paths[1:]:
        protocol = protocol_of(load_config(path))
        differing = {key: (reference[key], protocol[key]) for key in reference if protocol[key] != reference[key]}
        assert not differing, f"{path.name} differs from {paths[0].name} in {differing}"


def test_the_discrete_stream_is_padded_for_every_learner() -> None:
    """The input pipeline of the authors' diagonal code (igolan/bgd), on which the paper's ~88% was measured."""
    for path in benchmarks()["discrete_pmnist"]:
        assert load_config(path).scenario.pad_to_32, path.name


def test_the_protocol_leaves_out_seeds_and_the_joint_switch_and_holds_the_pipeline() -> None:
    base = load_config(CONFIGS / "discrete_pmnist_sgd.yaml")
    assert protocol_of(load_config(CONFIGS / "discrete_pmnist_sgd.yaml", ["seed=3", "scenario.seed=3",
                                                                         "threads=1"])) == protocol_of(base)
    assert protocol_of(load_config(CONFIGS / "discrete_pmnist_joint.yaml")) == protocol_of(base)
    for change in ("scenario.pad_to_32=false", "scenario.batch_size=64", "scenario.epochs_per_task=2",
                   "scenario.normalization=none", "model.hidden=[200,200]", "evaluation.test_subset=100"):
        assert protocol_of(load_config(CONFIGS / "discrete_pmnist_sgd.yaml", [change])) != protocol_of(base), change


def finished_run(path: Path, pad: bool, accuracy: float) -> Path:
    """A hand-made finished run of 2 tasks: config.yaml, summary.json, metrics.jsonl."""
    path.mkdir(parents=True)
    config = {"name": path.name, "learner": {"kind": "sgd", "params": {"lr": 0.01}},
              "scenario": {"kind": "discrete_permuted_mnist", "num_tasks": 2, "pad_to_32": pad}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    modes = {"mean": {"average_accuracy": accuracy, "first_task_accuracy": accuracy, "forgetting": 0.0,
                      "average_accuracy_curve": [accuracy, accuracy]}}
    (path / "summary.json").write_text(json.dumps({
        "learner": "sgd", "scenario": "discrete_permuted_mnist", "num_tasks": 2, "iterations": 20,
        "train_seconds": 1.0, "seconds_per_iteration": 0.05, "modes": modes}))
    records = [{"stage": s, "iteration": 10 * (s + 1), "accuracy": {"mean": [accuracy] * (s + 1)}} for s in range(2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_compare_warns_when_the_runs_differ_in_their_protocol(tmp_path, capsys) -> None:
    padded = finished_run(tmp_path / "padded", True, 0.8)
    padded_too = finished_run(tmp_path / "padded_too", True, 0.7)
    unpadded = finished_run(tmp_path / "unpadded", False, 0.6)

    assert main(["compare", str(padded), str(padded_too), "--out", str(tmp_path / "same")]) == 0
    assert "protocol" not in capsys.readouterr().err
    assert "protocol" not in (tmp_path / "same" / "compare.md").read_text()

    assert main(["compare", str(padded), str(unpadded), str(padded_too), "--out", str(tmp_path / "mixed")]) == 0
    err = capsys.readouterr().err
    assert "foovb: warning: the runs differ in their protocol" in err
    assert "scenario.pad_to_32: true (padded, padded_too); false (unpadded)" in err
    table = (tmp_path / "mixed" / "compare.md").read_text()
    assert "- scenario.pad_to_32: true (padded, padded_too); false (unpadded)" in table
    assert len([line for line in err.splitlines() if line.startswith("  ")]) == 1  # only the key that differs
