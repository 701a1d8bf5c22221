"""foovb: FOO-VB, the Fixed-point Operator for Online Variational Bayes, and a task-agnostic continual-learning
toolkit around it (paper: Zeno, Golan, Hoffer, Soudry, "Task-agnostic continual learning using online
variational Bayes with fixed-point updates")."""

from .anchor import output_anchor, output_reference
from .linalg import solve_fixed_point
from .optimizer import FOOVB

__all__ = ["FOOVB", "output_anchor", "output_reference", "solve_fixed_point"]
__version__ = "0.1.0"
