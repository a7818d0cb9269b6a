"""The user's ambient torch state, set aside while the library reads a sampled tensor.

Design decision: what the library measures must not depend on the state the user's step runs
in, nor be seen by it. Under `torch.autocast` a custom reducer's matmul or norm ran in lower
precision (the default profile reduces in float64, which autocast never casts, so only custom
reducers read differently); a user's torch function or dispatch mode (one that counts FLOPs,
logs ops or refuses some) saw every op of the measurement, or made it fail. So each of the
library's tensor sections in a sampled step (a layer's outputs hooked and launched, the
sample's host transfer, a gradient launched and flushed, the loss scale read) runs inside
`apart()`: autocast off for the CPU and this machine's accelerator, and the user's modes taken
off their stacks (`_torch_internals.UserModesSuspended`; infra modes stay). The cost: three
flag reads per section where nothing is on, a context where something is. torch.func's
transforms are set aside where a tensor is measured (`measurement.transfer`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from torchinstruments._torch_internals import UserModesSuspended, ambient_state_on

__all__ = ["apart"]


@functools.cache
def _device_types() -> tuple[str, ...]:
    """The device types autocast could be on for: the CPU and this machine's accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    return ("cpu",) if accelerator is None else ("cpu", accelerator.type)


_NOTHING = contextlib.nullcontext()


def apart() -> contextlib.AbstractContextManager[object]:
    """A context in which torch ops run as outside the user's autocast and modes (see the
    module docstring); nothing at all where neither is on."""
    if not ambient_state_on():
        return _NOTHING
    try:
        return _set_aside([kind for kind in _device_types() if torch.is_autocast_enabled(kind)])
    except Exception:  # a torch that cannot tell: measured as before, never a broken step
        return _NOTHING


@contextlib.contextmanager
def _set_aside(autocast: list[str]) -> Iterator[None]:
    """The user's modes off their stacks, then autocast off for `autocast`'s device types
    (in this order: entering autocast calls the active torch function modes)."""
    with UserModesSuspended(), contextlib.ExitStack() as stack:
        for kind in autocast:
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield
