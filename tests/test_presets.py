"""The diagonal family's recommended preset (the model's torch-initialised weights as the prior mean, each layer's
own prior std) against the paper's preset on a short real-data stream where retention matters: 5
permuted-MNIST tasks x 10 passes over 512 images, K = 4 (docs/results.md, "The default prior"). Seeds 0/1/2
measured: recommended 0.744/0.738/0.754 average and 0.674/0.665/0.675 first task, against the paper preset's
0.717/0.721/0.718 and 0.646/0.652/0.624; the test runs seed 0 (about 25 s). (FOOVB(model)'s posterior "auto",
matrix-variate on this MLP, seed 0: 0.787 / 0.737 against the paper preset's 0.701 / 0.729.)"""


import pytest

from foovb_suite.cli import config_path
from foovb_suite.config import load_config
from foovb_suite.runner import run

STREAM = ["scenario.num_tasks=5", "scenario.epochs_per_task=10", "scenario.train_subset=512", "scenario.batch_size=128",
          "learner.params.mc_samples=4", "learner.params.eval_samples=0", "evaluation.test_subset=1000", "threads=2",
          "learner.params.posterior=diagonal"]


def _average_and_first(tmp_path, preset: str) -> tuple[float, float]:
    config = load_config(config_path("demo"), [*STREAM, f"learner.params.preset={preset}"])
    summary = run(config, tmp_path / preset, progress=False)
    mean = summary["modes"]["mean"]
    return mean["average_accuracy"], mean["first_task_accuracy"]


@pytest.mark.slow
def test_the_recommended_preset_beats_the_paper_preset_on_a_short_stream(tmp_path):
    recommended, paper = _average_and_first(tmp_path, "recommended"), _average_and_first(tmp_path, "paper")
    assert recommended[0] > paper[0] + 0.015, (recommended, paper)  # measured: +2.7 points
    assert recommended[1] > paper[1] + 0.015, (recommended, paper)  # the first task: retention (+2.8)
