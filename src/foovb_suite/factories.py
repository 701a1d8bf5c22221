"""What a config builds: its stream (`build_scenario`), its model wrapped in its learner (`build_learner`) and its
device (`resolve_device`). The custom scenario's and model's factories are imported as `foovb_suite.custom` says."""

from __future__ import annotations

import torch

from .baselines import BASELINES
from .config import Config, ConfigError
from .learners import LEARNERS, Learner, make_learner
from .models import make_model

__all__ = ["RUNNER_ARGUMENTS", "build_learner", "build_scenario", "resolve_device"]


def build_scenario(config: Config):
    """The data stream of the config (imported lazily: MNIST loads in about a second). The custom scenario's
    factory is imported as `foovb_suite.custom` says (a `ConfigError` naming it if it fails)."""
    from .custom import custom_tasks
    from .scenarios.in_memory import ContinuousTasks, DiscreteTasks
    from .scenarios.joint import JointStream
    from .scenarios.mnist import (
        ContinuousPermutedMNIST,
        DiscretePermutedMNIST,
        MNISTImages,
        PermutedMNIST,
        RotatedMNIST,
        SplitMNIST,
    )
    from .scenarios.vision_mix import VisionMix

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
        images = MNISTImages(s.pad_to_32, s.normalization)
        scenario = RotatedMNIST(images, s.num_tasks, s.iterations_per_task, s.batch_size, s.max_angle, s.seed,
                                s.eval_every)
    elif s.kind == "split_mnist":
        images = MNISTImages(s.pad_to_32, s.normalization)
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
