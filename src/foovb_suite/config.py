"""Experiment configuration: a YAML file mapped onto typed dataclasses and validated before any training.

A bad config (unknown key, wrong type, impossible value) raises `ConfigError` naming the key, e.g.
`scenario.batch_size: expected int, got 'abc'`. `--set key.sub=value` overrides are parsed as YAML values.
YAML nested deeper than `MAX_YAML_DEPTH` or holding more than `MAX_YAML_VALUES` values once its aliases are expanded
is refused before any object is built, and the sizes that drive allocations (tasks, evaluations, the MLP's weights,
threads) have maxima.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import itertools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .data.datasets import DATASET_NAMES

__all__ = ["ConfigError", "Config", "load_config", "apply_overrides", "config_from_dict", "config_to_dict"]

SCENARIOS = ("discrete_permuted_mnist", "continuous_permuted_mnist", "vision_mix", "split_mnist",
             "rotated_mnist", "custom")
PERMUTED_MNIST = SCENARIOS[:2]
MNIST_STREAMS = (*PERMUTED_MNIST, "split_mnist", "rotated_mnist")
CUSTOM_MODES = ("discrete", "continuous")  # the custom scenario's tasks: one after another, or mixed gradually
CUSTOM_DISCRETE, CUSTOM_CONTINUOUS = CUSTOM_STREAMS = tuple(f"custom (mode: {mode})" for mode in CUSTOM_MODES)
# streams evaluated by iteration, not by task
CONTINUOUS = ("continuous_permuted_mnist", "rotated_mnist", CUSTOM_CONTINUOUS)
# scenario keys read by some streams only (`stream_of`); the others must leave them at their defaults
SCENARIO_KEYS = {
    "epochs_per_task": ("discrete_permuted_mnist", "vision_mix", "split_mnist", CUSTOM_DISCRETE),
    "iterations_per_task": CONTINUOUS,
    "max_angle": ("rotated_mnist",),
    "pad_to_32": MNIST_STREAMS,
    "normalization": MNIST_STREAMS,
    "train_subset": ("discrete_permuted_mnist", "vision_mix", *CUSTOM_STREAMS),
    "eval_every": CONTINUOUS,
    "data_dir": ("vision_mix",),
    "datasets": ("vision_mix",),
    "task_agnostic": ("vision_mix",),
    "mode": CUSTOM_STREAMS,
    "factory": CUSTOM_STREAMS,
    "args": CUSTOM_STREAMS,
    "num_classes": CUSTOM_STREAMS,
}
FACTORY_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""A factory: "module:function", the module (dotted) importable, the function an attribute of it (dotted)."""


MAX_YAML_DEPTH = 100
"""The deepest a config's YAML may nest (the bundled configs nest 3 deep); aliases expanded."""
MAX_YAML_VALUES = 100_000
"""The most values (scalars, lists, mappings) a config's YAML may hold once its aliases are expanded: a few
kilobytes of aliases of aliases ("billion laughs") would otherwise build billions of values."""
MAX_TASKS = 1_000
"""The most tasks a stream may have (the paper's have 10); each has its own input permutation, evaluations and
row and column of the accuracy matrix."""
MAX_ACCURACIES = 1_000_000
"""The most accuracies per mode a run may record (evaluations x tasks): each task's end of 1,000 tasks, or 100,000
evaluations of a continuous stream of 10 tasks."""
MAX_MLP_WEIGHTS = 100_000_000
"""The most weights model.hidden may give the MLP's hidden layers (counted from the widest input, 3x32x32): 175
times the paper's largest (1024-400-400)."""
MAX_THREADS = 1_024
"""The most threads a run may ask torch for (each is a thread with its own stack)."""
_WIDEST_INPUT = 3 * 32 * 32  # the vision mix's CIFAR-10 images: no scenario feeds the MLP more inputs


class _YamlTooLarge(Exception):
    """A YAML document beyond :data:`MAX_YAML_DEPTH` or :data:`MAX_YAML_VALUES`; the message says which."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading ``1e6`` and ``5.8e6`` as numbers (YAML 1.1 leaves them strings; 1.2 does not),
    refusing a key given twice in one mapping (PyYAML keeps the last one silently), and refusing to compose nodes
    nested deeper than :data:`MAX_YAML_DEPTH` (:class:`_YamlTooLarge`: PyYAML's composer recurses per level)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        """How many nodes enclose the one being composed."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self._depth == MAX_YAML_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise _YamlTooLarge(f"nests deeper than {MAX_YAML_DEPTH} levels (at line {line})")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain value, got {key!r}", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


class ConfigError(ValueError):
    """An invalid configuration; the message starts with the offending key."""


@dataclass
class ScenarioConfig:
    kind: str = "discrete_permuted_mnist"
    num_tasks: int = 10
    epochs_per_task: int = 20  # discrete permuted MNIST, vision mix and split MNIST
    iterations_per_task: int = 20 * 469  # continuous permuted MNIST and rotated MNIST (one period)
    max_angle: float = 180.0  # rotated MNIST: the rotation reached at the end of the stream, in degrees
    batch_size: int = 128
    pad_to_32: bool = False
    normalization: str = "standard"  # permuted MNIST inputs: "standard" (zero mean, unit variance), "none" ([0,1])
    train_subset: int | None = None  # first N training images (of each dataset, vision mix; quick runs)
    eval_every: int | None = None  # continuous: evaluate every N iterations (default: once per task period)
    joint: bool = False  # the joint-training oracle: all tasks mixed
    task_agnostic: bool = False  # vision mix: no task labels, one 10-way head shared by the datasets
    data_dir: str | None = None  # vision mix: where its datasets are (also looked for where system packages put them)
    datasets: list[str] = field(default_factory=lambda: ["mnist", "notmnist", "fashion_mnist", "svhn", "cifar10"])
    seed: int = 0  # the data streams (permutations, batch order): in [0, 2**32)
    mode: str = "discrete"  # custom: the tasks one after another ("discrete") or mixed gradually ("continuous")
    factory: str | None = None  # custom: "module:function" returning the tasks, a list of (train, test) Datasets
    args: dict[str, Any] = field(default_factory=dict)  # custom: the factory's keyword arguments
    num_classes: int | None = None  # custom: the output size (default: the largest label + 1)


@dataclass
class ModelConfig:
    kind: str = "mlp"
    hidden: list[int] = field(default_factory=lambda: [100, 100])
    bias: bool = True  # mlp: biases in every layer (MESU's comparison network has none)
    factory: str | None = None  # custom: "module:function" returning the nn.Module
    args: dict[str, Any] = field(default_factory=dict)  # custom: the factory's keyword arguments


@dataclass
class LearnerConfig:
    kind: str = "foovb"
    params: dict[str, Any] = field(default_factory=dict)  # hyperparameters of the learner


@dataclass
class EvalConfig:
    test_subset: int | None = None  # first N test examples of each task (quick runs)
    histograms: bool = True  # save posterior STDs at every evaluation (Bayesian learners)


# How a run executes, not what it computes: `--resume` accepts a change of these (e.g. resuming on a machine with
# more cores or a GPU, or watching it in TensorBoard); a different thread count or device may change the last bits
# of floating-point results.
EXECUTION_KEYS = ("threads", "device", "checkpoint_every", "checkpoint_minutes", "tensorboard", "tensorboard_every")
# Where a run reads its data, not what it computes: `--resume` accepts a new data directory too (the run moved to a
# machine that keeps the datasets elsewhere, or resumed from another working directory: a relative one), and
# `foovb compare` takes runs that differ in it for seeds of one experiment.
EXECUTION_SCENARIO_KEYS = ("data_dir",)


def what_it_computes(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved config (`config_to_dict`) without the keys of how and where the run executes."""
    kept = {key: value for key, value in config.items() if key not in EXECUTION_KEYS}
    kept["scenario"] = {key: value for key, value in config.get("scenario", {}).items()
                        if key not in EXECUTION_SCENARIO_KEYS}
    return kept


@dataclass
class Config:
    name: str = "run"
    seed: int = 0
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    checkpoint_every: int = 2000  # iterations between checkpoints (plus one at every evaluation)
    checkpoint_minutes: float = 5.0  # and at most this long between checkpoints (a SIGKILL loses at most that much)
    # torch.set_num_threads; None: torch's default (every core). 1 by default: the demo trained in 17.0 s with 1 thread
    # against 12.5 s with 2 on an idle 2-core host, but 17.2 s against 41 s beside one busy process (session 38), and
    # one thread gives the same numbers on every machine
    threads: int | None = 1
    device: str = "auto"  # "auto" (CUDA when torch sees a GPU, else the CPU), "cpu", "cuda" or "cuda:N"
    tensorboard: bool = False  # write TensorBoard event files under RUN/tensorboard/ during the run (--tensorboard)
    tensorboard_every: int = 50  # iterations between the training-loss points of the TensorBoard log


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _check_type(key, value, inner)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(annotation)
        return [_check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool) or not isinstance(value, annotation):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
    return value


def _refuse_unknown_keys(cls: type, data: dict, prefix: str) -> None:
    """A ConfigError naming the first key of `data` that `cls` has no field for, with the closest field's name."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), names, n=1)
        hint = (" (YAML reads an unquoted on/off/yes/no/true/false key as a boolean: quote it)"
                if isinstance(unknown[0], bool) else f" (did you mean {close[0]!r}?)" if close else "")
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key{hint} (known: {', '.join(sorted(names))})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    _refuse_unknown_keys(cls, data, prefix)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def stream_of(scenario: ScenarioConfig) -> str:
    """The stream a scenario config describes, which decides the keys it reads (`SCENARIO_KEYS`): its kind, and for
    the custom scenario its mode too ("custom (mode: continuous)")."""
    return f"custom (mode: {scenario.mode})" if scenario.kind == "custom" else scenario.kind


def is_continuous(scenario: ScenarioConfig) -> bool:
    """Whether the stream is evaluated by iteration (its tasks mixed, or a drift), not at task ends."""
    return stream_of(scenario) in CONTINUOUS


def _check_factory(section: str, factory: str | None, args: dict[str, Any], kind: str, returns: str) -> None:
    """The custom scenario's or model's `factory` and `args` (keys `section`.factory and `section`.args): a
    "module:function" string and keyword arguments; no import here (`foovb_suite.custom` imports it)."""
    if factory is None:
        raise ConfigError(f"{section}.factory: the custom {kind} needs one, 'module:function': a function of a "
                          f"Python module that returns {returns}")
    if not FACTORY_PATTERN.fullmatch(factory):
        raise ConfigError(f"{section}.factory: expected 'module:function' (e.g. 'my_tasks:make_tasks', the module "
                          f"my_tasks.py in the working directory or the config file's), got {factory!r}")
    bad = next((key for key in args if not isinstance(key, str) or not key.isidentifier()), None)
    if bad is not None:
        raise ConfigError(f"{section}.args: keyword arguments of the factory are named by identifiers, got {bad!r}")


def _positive(key: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{key}: must be a positive integer, got {value}")


def validate(config: Config) -> Config:
    """Value checks that do not need data (types are checked when parsing)."""
    s = config.scenario
    if s.kind not in SCENARIOS:
        raise ConfigError(f"scenario.kind: unknown scenario {s.kind!r} (known: {', '.join(SCENARIOS)})")
    for key in ("num_tasks", "epochs_per_task", "iterations_per_task", "batch_size", "train_subset",
                "eval_every"):
        _positive(f"scenario.{key}", getattr(s, key))
    if s.num_tasks > MAX_TASKS:
        raise ConfigError(f"scenario.num_tasks: at most {MAX_TASKS} tasks, got {s.num_tasks}")
    # seed: torch.manual_seed takes 64-bit integers. scenario.seed: 32 bits, the first word of the keys of the
    # scenario's streams (scenarios.base._generator), where a larger one would give another seed's streams
    for key, seed, bits in (("scenario.seed", s.seed, 32), ("seed", config.seed, 63)):
        if not 0 <= seed < 2**bits:
            raise ConfigError(f"{key}: must be in [0, 2**{bits}), got {seed}")
    if s.normalization not in ("standard", "none"):
        raise ConfigError(f"scenario.normalization: must be 'standard' or 'none', got {s.normalization!r}")
    if s.mode not in CUSTOM_MODES:
        raise ConfigError(f"scenario.mode: must be {' or '.join(map(repr, CUSTOM_MODES))}, got {s.mode!r}")
    defaults = ScenarioConfig()
    for key, streams in SCENARIO_KEYS.items():
        if stream_of(s) not in streams and getattr(s, key) != getattr(defaults, key):
            raise ConfigError(f"scenario.{key}: not read by the {stream_of(s)} scenario (only by "
                              f"{', '.join(streams)}); leave it out")
    if s.kind == "custom":
        _check_factory("scenario", s.factory, s.args, "scenario", "its tasks, a list of (train, test) pairs of "
                       "torch Datasets")
        _positive("scenario.num_classes", s.num_classes)
    if s.kind == "vision_mix":
        unknown = sorted(set(s.datasets) - set(DATASET_NAMES))
        if unknown:
            raise ConfigError(f"scenario.datasets: unknown dataset {unknown[0]!r} (known: {', '.join(DATASET_NAMES)})")
        if s.num_tasks > len(s.datasets):
            raise ConfigError(f"scenario.num_tasks: {s.num_tasks} tasks, but scenario.datasets lists "
                              f"{len(s.datasets)} datasets (one per task)")
    if s.eval_every is not None:  # continuous streams (else refused above): an evaluation every eval_every iterations
        evaluations = s.num_tasks * s.iterations_per_task // s.eval_every
        if evaluations * s.num_tasks > MAX_ACCURACIES:
            raise ConfigError(f"scenario.eval_every: {s.eval_every} evaluates all {s.num_tasks} tasks {evaluations} "
                              f"times, {evaluations * s.num_tasks} accuracies per mode, more than the maximum of "
                              f"{MAX_ACCURACIES}; evaluate less often")
    if not 0 < s.max_angle <= 360:
        raise ConfigError(f"scenario.max_angle: must be in (0, 360] degrees, got {s.max_angle}")
    if s.joint and config.learner.kind == "si":  # SI consolidates when the task id changes: at almost every batch
        raise ConfigError("learner.kind: si consolidates each task when the task id changes, and the joint oracle's "
                          "batches mix the tasks; run the oracle with a plain optimiser (sgd, adam)")
    if s.kind == "split_mnist" and s.num_tasks > 5:
        raise ConfigError(f"scenario.num_tasks: Split MNIST has 5 digit pairs, got {s.num_tasks}")
    m, model_defaults = config.model, ModelConfig()
    if m.kind not in ("mlp", "lenet", "custom"):
        raise ConfigError(f"model.kind: unknown model {m.kind!r} (known: mlp, lenet, custom)")
    if m.kind != "mlp" and m.hidden != model_defaults.hidden:
        raise ConfigError(f"model.hidden: the {m.kind} model's layers are not set here; hidden sizes are for the mlp")
    if m.kind != "mlp" and not m.bias:
        raise ConfigError(f"model.bias: the {m.kind} model's layers are not set here; bias: false is for the mlp")
    if m.kind == "custom":
        _check_factory("model", m.factory, m.args, "model", "the torch.nn.Module")
    elif m.factory != model_defaults.factory or m.args != model_defaults.args:
        raise ConfigError(f"model.{'factory' if m.factory is not None else 'args'}: read by the custom model only, "
                          f"not the {m.kind}; leave it out")
    _positive("evaluation.test_subset", config.evaluation.test_subset)
    _positive("checkpoint_every", config.checkpoint_every)
    _positive("tensorboard_every", config.tensorboard_every)
    if not (math.isfinite(config.checkpoint_minutes) and config.checkpoint_minutes > 0):
        raise ConfigError(f"checkpoint_minutes: expected a positive number, got {config.checkpoint_minutes!r}")
    _positive("threads", config.threads)
    if config.threads is not None and config.threads > MAX_THREADS:
        raise ConfigError(f"threads: at most {MAX_THREADS}, got {config.threads}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {config.device!r}")
    for i, width in enumerate(config.model.hidden):
        _positive(f"model.hidden[{i}]", width)
    widths = [_WIDEST_INPUT, *config.model.hidden]
    weights = sum(inputs * outputs for inputs, outputs in itertools.pairwise(widths))
    if weights > MAX_MLP_WEIGHTS:
        raise ConfigError(f"model.hidden: {config.model.hidden} gives the MLP up to {weights} weights (from "
                          f"{_WIDEST_INPUT} inputs, the widest scenario's), more than the maximum of {MAX_MLP_WEIGHTS}")
    return config


def default_run_dir(config: Config) -> Path:
    """runs/NAME, where a run goes without --out: the name must be one plain folder name (checked here, not in
    `validate`, so that runs stored under other names are still read)."""
    name = config.name
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0\n"):
        raise ConfigError(f"name: expected a plain name (the run's folder under runs/), got {name!r}; or give --out")
    return Path("runs") / name


def config_from_dict(data: dict) -> Config:
    return validate(_build(Config, data, ""))


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def protocol_of(config: Config) -> dict[str, Any]:
    """The evaluation protocol a run's accuracies depend on besides its learner: the scenario (data, input
    pipeline, batch size, length) without its seed and the joint-oracle switch, the model and the evaluation
    settings, as flat ``"section.key": value`` pairs. Learners compare only on one protocol (docs/results.md,
    "Input padding"): `foovb compare` warns when its runs differ here."""
    flat = {}
    for section in ("scenario", "model", "evaluation"):
        for key, value in dataclasses.asdict(getattr(config, section)).items():
            if (section, key) not in (("scenario", "seed"), ("scenario", "joint"), ("evaluation", "histograms")):
                flat[f"{section}.{key}"] = value
    return flat


def _glued_key(value: Any) -> str | None:
    """A key of a mapping in `value` (nested too) written `name:number` or `name:true` with no value: YAML read
    `{lr:0.001}`, the colon without its space, as one key."""
    if isinstance(value, list):
        return next((key for item in value if (key := _glued_key(item)) is not None), None)
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        name, colon, rest = str(key).partition(":")
        if item is None and colon and name.isidentifier() and re.fullmatch(r"[-+.\w]+", rest) \
                and isinstance(yaml.safe_load(rest), bool | int | float):
            return str(key)
        if (nested := _glued_key(item)) is not None:
            return nested
    return None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `key.sub=value` overrides (value parsed as YAML) to a raw config mapping."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {data!r}")
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a mapping")
        value = parse_yaml(raw, f"--set {key}")
        glued = _glued_key(value)
        if glued is not None:  # {lr:0.001}: YAML's key "lr:0.001", with no value
            name, _, rest = glued.partition(":")
            raise ConfigError(f"--set {item!r}: YAML reads {glued!r} as one key with no value; a colon needs a "
                              f"space after it: {{{name}: {rest}}}")
        node[parts[-1]] = value
    return data


def _check_expanded_size(root: yaml.Node) -> None:
    """Raise :class:`_YamlTooLarge` where the composed document ``root``, its aliases expanded, holds more than
    :data:`MAX_YAML_VALUES` values or nests deeper than :data:`MAX_YAML_DEPTH` (an alias to an enclosing node,
    an endless nesting, included). Each node is walked once: an alias costs what its node holds without
    rebuilding it."""
    walked: dict[int, tuple[int, int]] = {}  # id(node) -> (values it holds, levels it nests), once walked

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        if depth > MAX_YAML_DEPTH:
            raise _YamlTooLarge(f"nests deeper than {MAX_YAML_DEPTH} levels once its aliases are expanded")
        if id(node) not in walked:
            if isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            else:
                children = node.value if isinstance(node, yaml.SequenceNode) else []
            values, levels = 1, 1
            for child in children:
                child_values, child_levels = walk(child, depth + 1)
                values, levels = values + child_values, max(levels, child_levels + 1)
            walked[id(node)] = values, levels
        values, levels = walked[id(node)]
        if values > MAX_YAML_VALUES:
            raise _YamlTooLarge(f"holds more than {MAX_YAML_VALUES} values once its aliases are expanded")
        if depth + levels - 1 > MAX_YAML_DEPTH:
            raise _YamlTooLarge(f"nests deeper than {MAX_YAML_DEPTH} levels once its aliases are expanded")
        return values, levels

    walk(root, 1)


def parse_yaml(text: str, where: str) -> Any:
    """The value of YAML ``text`` (``where`` names it in errors), read with :class:`_Loader` (a SafeLoader) and
    checked by :func:`_check_expanded_size` before any Python object is built."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:  # an empty document
            return None
        _check_expanded_size(root)
        return loader.construct_document(root)
    except _YamlTooLarge as error:
        raise ConfigError(f"{where}: refused: its YAML {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}: invalid YAML ({' '.join(str(error).split())})") from error
    finally:
        loader.dispose()


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply overrides, parse and validate."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file" if path.exists() else
                          f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:  # a binary file (a checkpoint), or a config saved in another encoding
        raise ConfigError(f"{path} is not a YAML config in UTF-8 ({error.reason} at byte {error.start})") from None
    data = apply_overrides(parse_yaml(text, str(path)) or {}, overrides or [])
    if isinstance(data, dict):  # a misspelt section (lerner:) named before "does not name its learner"
        _refuse_unknown_keys(Config, data, "")
    for section, example in (("scenario", "discrete_permuted_mnist"), ("learner", "foovb")):
        if section not in data or isinstance(data[section], dict) and "kind" not in data[section]:
            # the defaults alone are a paper-scale run of hours: a file must say what it runs
            raise ConfigError(f"{section}.kind: {path} does not name its {section} (e.g. {section}: {{kind: "
                              f"{example}}}); `foovb configs` lists complete configs to copy")
    return config_from_dict(data)
