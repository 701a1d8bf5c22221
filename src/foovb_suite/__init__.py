"""foovb_suite: the task-agnostic continual-learning suite around the foovb optimizer library — data streams
(scenarios), learners and baselines, metrics, plots, the config-driven runner and the `foovb` command.

The library (`foovb`) never imports this package; this package imports the library."""

from foovb import __version__

__all__ = ["__version__", "load_learner", "load_model"]


def __getattr__(name: str) -> object:
    """`load_model` / `load_learner` of `foovb_suite.loading`, imported on first use (with the learners and streams)."""
    if name in ("load_learner", "load_model"):
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'foovb_suite' has no attribute {name!r}")
