"""The posterior's own arithmetic in the state's precision: autocast turned off around it, and autocast's cache of
low-precision weights dropped after the parameters are overwritten in place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["full_precision", "drop_autocast_cache"]

AUTOCAST_DEVICES = ("cpu", "cuda")


def full_precision() -> contextlib.AbstractContextManager:
    """Autocast off inside: the posterior's own arithmetic (sampling, statistics, update) runs in the state's
    dtype even when the caller runs a step or a prediction inside `torch.autocast`, which should change the
    model's forward and backward only. (Outside autocast: a no-op context, entered many times per step.)"""
    enabled = [device_type for device_type in AUTOCAST_DEVICES if torch.is_autocast_enabled(device_type)]
    return _autocast_off(enabled) if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _autocast_off(device_types: list[str]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type in device_types:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def drop_autocast_cache() -> None:
    """Call after overwriting parameters in place: an enclosing autocast region (even a disabled one around an
    enabled one, which then keeps its cache until the outermost exits) caches the low-precision copy of each
    weight and would otherwise keep using the copy made from the previous values. Clearing is cheap."""
    torch.clear_autocast_cache()
