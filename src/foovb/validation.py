"""Type checks shared by the argument validation of the optimizer, the learners and the baselines.

numpy scalars count (np.float32 is a `numbers.Real`); booleans do not, although Python makes them integers.
"""

from __future__ import annotations

import numbers

__all__ = ["is_integer", "is_real"]


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
