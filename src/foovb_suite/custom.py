"""Your own data and model in `foovb run`: the factories of the custom scenario and the custom model.

A factory is named ``"module:function"`` in the config (``scenario.factory``, ``model.factory``), its keyword
arguments under ``args``. The module is imported from the working directory, then from the config file's directory
(which `foovb run` names with :func:`config_directory`), then from ``sys.path`` (the installed packages). Those
directories lead ``sys.path`` only while the factory is imported and called. Anything wrong with a factory (its
module not found, no such function, the call raising, the wrong thing returned) is a `ConfigError` naming it: the
CLI prints it as one ``foovb: error: ...`` line.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .config import ConfigError, ModelConfig, ScenarioConfig
from .scenarios.in_memory import InMemoryTasks

__all__ = ["config_directory", "custom_model", "custom_tasks", "model_record"]

_CONFIG_DIRECTORY: contextvars.ContextVar[Path | None] = contextvars.ContextVar("config_directory", default=None)
"""The directory of the config file being run (set by `config_directory`), where factories are also looked for."""

_PROBE_ROWS = 2
"""The batch of zeros a custom model is tried on, to check the shape of its output before training."""


@contextlib.contextmanager
def config_directory(config_file: str | Path) -> Iterator[None]:
    """Within the block, factories' modules are also looked for in the directory of ``config_file`` (after the
    working directory)."""
    token = _CONFIG_DIRECTORY.set(Path(config_file).resolve().parent)
    try:
        yield
    finally:
        _CONFIG_DIRECTORY.reset(token)


def _search_directories() -> list[Path]:
    """Where a factory's module is looked for before ``sys.path``: the working directory, then the config file's
    directory (when a config file is being run)."""
    directories = [Path.cwd()]
    config_dir = _CONFIG_DIRECTORY.get()
    if config_dir is not None and config_dir != directories[0]:
        directories.append(config_dir)
    return directories


def _how_modules_are_found(module_name: str) -> str:
    """How the module `module_name` of a factory is found, in one phrase, for the errors of a factory that cannot
    be imported."""
    working, *config_dir = _search_directories()
    places = [f"the working directory {working}", *(f"the config file's directory {path}" for path in config_dir)]
    return (f"'module:function' imports the module from {', then '.join(places)}, then sys.path (the installed "
            f"packages): put {module_name.replace('.', '/')}.py there")


@contextlib.contextmanager
def _importable() -> Iterator[None]:
    """``sys.path`` led by `_search_directories` within the block: the factory's import and its call, in which
    its module may import its neighbours."""
    added = [str(path) for path in _search_directories()]
    sys.path[:0] = added
    importlib.invalidate_caches()  # the path finders cache directory listings: a module written since is seen
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)


def _library_file(filename: str) -> bool:
    """Whether `filename` is Python's, an installed package's (torch, gzip, ...) or foovb's, not the user's."""
    libraries = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    here = Path(__file__).parent  # foovb_suite, beside foovb
    libraries |= {str(here), str(here.parent / "foovb"), str(Path(torch.__file__).parent.parent)}
    return any(filename.startswith(library + os.sep) for library in libraries if library)


def _failure(error: BaseException) -> str:
    """An exception raised by the user's code, in one line: its type, message and where it was raised: the last
    line of the user's own files in the traceback, and the library's line that raised it, if another."""
    message = " ".join(str(error).split()) or (f"exit status {error.code}" if isinstance(error, SystemExit) else "")
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<")]
    if frames and not isinstance(error, SyntaxError):  # a SyntaxError's message has its file and line
        own = [frame for frame in frames if not _library_file(frame.filename)]
        where = own[-1] if own else frames[-1]
        text += f" (at {where.filename}:{where.lineno}"
        text += f", raised in {frames[-1].filename}:{frames[-1].lineno})" if where is not frames[-1] else ")"
    return text


def _import_factory(section: str, factory: str) -> Callable[..., Any]:
    """The function that ``factory`` ("module:function", key `section`.factory) names; call within `_importable`."""
    name = f"{section}.factory {factory!r}"
    module_name, _, attribute_path = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's module: any failure is reported as it is
        missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and (module_name + ".").startswith(missing + "."):  # the module, not an import of it
            raise ConfigError(f"{name}: no module named {missing!r}; {_how_modules_are_found(module_name)}") \
                from error
        raise ConfigError(f"{name}: importing {module_name} raised {_failure(error)}") from error
    function: Any = module
    for attribute in attribute_path.split("."):
        if not hasattr(function, attribute):
            close = difflib.get_close_matches(attribute, [n for n in dir(function) if not n.startswith("_")], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{name}: module {module_name!r} ({getattr(module, '__file__', 'built in')}) has no "
                              f"attribute {attribute_path!r}{hint}; if that is not your module: "
                              f"{_how_modules_are_found(module_name)}")
        function = getattr(function, attribute)
    if not callable(function):
        raise ConfigError(f"{name}: {attribute_path} is a {type(function).__name__}, not a function")
    return function


def _call_factory(section: str, factory: str, args: dict[str, Any], offered: dict[str, Any] | None = None) -> Any:
    """What the function that ``factory`` names returns, called with the keyword arguments ``args`` and those of
    ``offered`` that it takes (by name, or all with ``**kwargs``). Errors name the key: `section`.factory or
    `section`.args."""
    with _importable():
        function = _import_factory(section, factory)
        try:
            signature: inspect.Signature | None = inspect.signature(function)
        except (TypeError, ValueError):  # no signature to read (some built-ins): the call says what is wrong
            signature = None
        parameters = {} if signature is None else signature.parameters
        takes_any = any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values())
        given = {key: value for key, value in (offered or {}).items() if takes_any or key in parameters}
        clash = next((key for key in given if key in args), None)
        if clash is not None:
            raise ConfigError(f"{section}.args.{clash}: set by the runner ({given[clash]!r}, from the stream); "
                              "leave it out")
        if signature is not None:
            try:
                signature.bind(**given, **args)
            except TypeError as error:
                raise ConfigError(f"{section}.args: {factory} cannot be called with them ({error})") from None
        try:
            return function(**given, **args)
        except (Exception, SystemExit) as error:  # noqa: BLE001 - the user's code (a script's sys.exit too): any
            raise ConfigError(f"{section}.factory {factory!r} raised {_failure(error)}") from error  # failure, as it is


def custom_tasks(scenario: ScenarioConfig) -> InMemoryTasks:
    """The first ``scenario.num_tasks`` tasks that ``scenario.factory`` returns, read into memory (the first
    ``scenario.train_subset`` training examples of each, when given)."""
    tasks = _call_factory("scenario", scenario.factory, scenario.args)
    if isinstance(tasks, list | tuple):  # before the num_tasks error, which would advise their count
        if not tasks:
            raise ConfigError(f"scenario.factory {scenario.factory!r} returned no tasks (an empty "
                              f"{type(tasks).__name__}): return one (train, test) pair per task")
        if all(isinstance(part, Dataset) for part in tasks):
            raise ConfigError(f"scenario.factory {scenario.factory!r} returned a {type(tasks).__name__} of "
                              f"{len(tasks)} Datasets, not a list of tasks: return one (train, test) pair per task, "
                              "[(train_0, test_0), (train_1, test_1), ...]")
        if len(tasks) < scenario.num_tasks:
            raise ConfigError(f"scenario.num_tasks: {scenario.num_tasks}, but scenario.factory {scenario.factory!r} "
                              f"returned {len(tasks)} task(s); set scenario.num_tasks: {len(tasks)} (or fewer: the "
                              "first tasks)")
        tasks = tasks[: scenario.num_tasks]
    try:
        in_memory = InMemoryTasks.from_datasets(tasks, train_subset=scenario.train_subset)
    except ValueError as error:
        raise ConfigError(f"scenario.factory {scenario.factory!r}: {error}") from error
    if scenario.num_classes is None:
        _refuse_classes_only_tested(in_memory, scenario)
        return in_memory
    if scenario.num_classes < in_memory.num_classes:
        raise ConfigError(f"scenario.num_classes: {scenario.num_classes}, but the labels of scenario.factory "
                          f"{scenario.factory!r} go up to {in_memory.num_classes - 1}")
    return InMemoryTasks(in_memory.train, in_memory.test, scenario.num_classes)


def _refuse_classes_only_tested(tasks: InMemoryTasks, scenario: ScenarioConfig) -> None:
    """The model's outputs are the largest label + 1 when scenario.num_classes is not set: a test label that no
    training set holds (a label out of range?) would silently add outputs that no example trains. Set
    scenario.num_classes to say the classes are meant."""
    trained = set().union(*(labels.unique().tolist() for _, labels in tasks.train))
    for task, (_, labels) in enumerate(tasks.test):
        untrained = sorted(set(labels.unique().tolist()) - trained)
        if untrained:
            read = (f" (of the first {scenario.train_subset} examples of each, scenario.train_subset: a dataset "
                    "ordered by class?)" if scenario.train_subset is not None else "")
            raise ConfigError(
                f"scenario.factory {scenario.factory!r}: task {task}'s test set has label(s) {untrained[:5]} that no "
                f"training set holds{read}, and the model's outputs are the largest label + 1 ({tasks.num_classes}): "
                "a label out of range? If those classes are meant, set scenario.num_classes")


def model_record(model: ModelConfig, module: nn.Module) -> dict[str, Any] | None:
    """What a run records of its custom model, for --resume (`resume.run_identity`): the SHA-256 of its modules as
    printed (`repr`: layers, sizes, activation modules), of the source file that holds model.factory ("source") and of
    each other file of the user's that defines a class of its modules or their bases ("classes", by module name:
    paths differ between checkouts; since session 56), as a forward may compute what the printout does not show
    (e.g. F.relu); and the factory's file (None where it cannot be read). None for a built-in model, which the
    config determines."""
    if model.kind != "custom":
        return None
    with _importable():
        function = _import_factory("model", model.factory)
    try:
        source = inspect.getsourcefile(inspect.unwrap(function))
    except TypeError:  # a built-in: the modules are still compared
        source = None
    return {"modules": hashlib.sha256(repr(module).encode()).hexdigest(),
            "file": source if source and Path(source).is_file() else None,
            "source": hashlib.sha256(_read(source) if source else b"").hexdigest(),
            "classes": {name: hashlib.sha256(_read(path)).hexdigest()
                        for name, path in sorted(_class_files(module, source).items())}}


def _class_files(module: nn.Module, factory_file: str | None) -> dict[str, str]:
    """The user's source files (not Python's, an installed package's or foovb's) other than the factory's that define
    the classes of `module`'s submodules and their base classes, by module name."""
    files = {}
    for cls in {type(submodule) for submodule in module.modules()}:
        for base in inspect.getmro(cls):
            try:
                path = inspect.getsourcefile(base)
            except TypeError:  # a built-in class
                continue
            if path and path != factory_file and not _library_file(path):
                files[base.__module__] = path
    return files


def _read(path: str) -> bytes:
    """The bytes of a source file, b"" where it cannot be read (deleted since the import)."""
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def custom_model(model: ModelConfig, input_shape: Sequence[int], num_outputs: int, device: torch.device) -> nn.Module:
    """The ``torch.nn.Module`` that ``model.factory`` returns, on ``device``; the factory is given
    ``input_shape`` (one example's) and ``num_classes`` (``num_outputs``, the logits the model must output) if it
    takes them. The model is tried on a batch of zeros: it must map it to ``num_outputs`` logits per row."""
    module = _call_factory("model", model.factory, model.args,
                           {"input_shape": tuple(input_shape), "num_classes": num_outputs})
    name = f"model.factory {model.factory!r}"
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{name}: expected a torch.nn.Module, got {type(module).__name__}")
    if not any(parameter.requires_grad for parameter in module.parameters()):
        raise ConfigError(f"{name}: its model has no trainable parameters")
    module = module.to(device)
    probe = torch.zeros(_PROBE_ROWS, *input_shape, device=device)
    was_training = module.training
    try:
        with torch.no_grad():
            outputs = module.eval()(probe)
    except Exception as error:  # noqa: BLE001 - the user's model: any failure is reported as it is
        raise ConfigError(f"{name}: its model fails on inputs of shape {tuple(probe.shape)}: {_failure(error)}") \
            from error
    finally:
        module.train(was_training)
    if not isinstance(outputs, Tensor) or tuple(outputs.shape) != (_PROBE_ROWS, num_outputs):
        got = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
        raise ConfigError(f"{name}: its model maps inputs of shape {tuple(probe.shape)} to {got}, expected logits "
                          f"of shape {(_PROBE_ROWS, num_outputs)} ({num_outputs} classes)")
    return module
