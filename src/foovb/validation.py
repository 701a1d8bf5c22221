"""Type checks shared by the argument validation of the optimizer, the learners and the baselines.

numpy scalars count (np.float32 is a `numbers.Real`); booleans do not, although Python makes them integers.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["inspection_seed", "is_boolean", "is_integer", "is_real"]


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_boolean(value: object) -> bool:
    """True or False (Python's, or numpy's): not the strings "false"/"true", not 0/1."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def inspection_seed(seed: object) -> int:
    """The seed of draws made to inspect or evaluate the posterior (not the training noise): an int (numpy's
    too), or None for a fresh one from torch's global generator; TypeError otherwise."""
    if seed is None:
        return int(torch.randint(2**62, (1,)).item())
    if not is_integer(seed):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    return int(seed)
