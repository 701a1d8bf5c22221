"""Type checks shared by the argument validation of the optimizer, the learners and the baselines.

numpy scalars count (np.float32 is a `numbers.Real`); booleans do not, although Python makes them integers.
"""

from __future__ import annotations

import numbers

__all__ = ["is_boolean", "is_integer", "is_real"]


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_boolean(value: object) -> bool:
    """True or False (Python's, or numpy's): not the strings "false"/"true", not 0/1."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
