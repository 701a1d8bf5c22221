"""foovb: FOO-VB, the Fixed-point Operator for Online Variational Bayes, and a task-agnostic continual-learning
toolkit around it (paper: Zeno, Golan, Hoffer, Soudry, "Task-agnostic continual learning using online
variational Bayes with fixed-point updates")."""

from .linalg import solve_fixed_point
from .optimizer import FOOVB

__all__ = ["FOOVB", "solve_fixed_point"]
__version__ = "0.1.0"
