"""foovb_suite: the task-agnostic continual-learning suite around the foovb optimizer library — data streams
(scenarios), learners and baselines, metrics, plots, the config-driven runner and the `foovb` command.

The library (`foovb`) never imports this package; this package imports the library."""

from foovb import __version__

__all__ = ["__version__", "load_learner", "load_model"]


def __getattr__(name: str) -> object:
    """`load_model` / `load_learner` from the runner, imported on first use (the runner imports matplotlib)."""
    if name in ("load_learner", "load_model"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'foovb_suite' has no attribute {name!r}")
