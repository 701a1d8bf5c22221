"""foovb_suite: the task-agnostic continual-learning suite around the foovb optimizer library — data streams
(scenarios), learners and baselines, metrics, plots, the config-driven runner and the `foovb` command.

The library (`foovb`) never imports this package; this package imports the library."""

__all__ = ["__version__", "load_learner", "load_model"]


def __getattr__(name: str) -> object:
    """`load_model` / `load_learner` of `foovb_suite.loading`, imported on first use (with the learners and streams),
    and the library's `__version__` (imported on first use too: the `foovb` command's entry point imports this
    package, and torch must load inside it, where a Ctrl-C is one line)."""
    if name in ("load_learner", "load_model"):
        from . import loading

        return getattr(loading, name)
    if name == "__version__":
        from foovb import __version__

        return __version__
    raise AttributeError(f"module 'foovb_suite' has no attribute {name!r}")
