"""foovb_suite: the task-agnostic continual-learning suite around the foovb optimizer library — data streams
(scenarios), learners and baselines, metrics, plots, the config-driven runner and the `foovb` command.

The library (`foovb`) never imports this package; this package imports the library."""

from foovb import __version__

__all__ = ["__version__"]
