"""A module built from the observed model after inject_observer, which calls its layers unobserved.

accelerate's `compile_regions(model)` returns a new module of the model's class whose `__dict__`
is a shallow copy of the model's, with `forward` rebound to the class's own and the children
the model's blocks wrapped by torch.compile. Called in place of the model, it runs the model's
layers without ever reaching the root proxy, so nothing is sampled, and a run that only said
"the model was never called" would send the user looking for a loop bug that is not there.
Telling such calls apart as they happen would cost a check on every layer call (the layers carry
no proxy between sampled forwards, capture.py); finding the copy costs one look at what refers
to the model's parameter dict, which the copy shares. It is done once, at a removal that saw no
root forward, so a run that was observed pays nothing. A `copy.copy` of the model shares the
root proxy (its calls are counted) and is not such a module.
"""

from __future__ import annotations

import gc

from torch import nn

__all__ = ["BY_COMPILE_REGIONS", "BY_SHALLOW_COPY", "bypassing_copy"]

BY_COMPILE_REGIONS = "the module accelerate's compile_regions built from it"
BY_SHALLOW_COPY = "a module built from a shallow copy of its __dict__"


def bypassing_copy(model: nn.Module) -> str | None:
    """What built a module sharing `model`'s state with a forward of its own (`BY_*`), or None.

    Its `__dict__` holds the model's very `_parameters` dict and not the model's root proxy.
    Looking never fails a removal: where it fails, None."""
    try:
        return _find(model)
    except Exception:
        return None


def _find(model: nn.Module) -> str | None:
    """`bypassing_copy` without its guard."""
    own = model.__dict__
    params = own.get("_parameters")
    if not isinstance(params, dict):
        return None
    found = None
    for referrer in gc.get_referrers(params):
        state = referrer.__dict__ if isinstance(referrer, nn.Module) else referrer
        if (
            not isinstance(state, dict)
            or state is own
            or state.get("_parameters") is not params
            or ("forward" in own and state.get("forward") is own["forward"])
        ):
            continue
        if state.get("_orig_mod") is model:
            return BY_COMPILE_REGIONS
        found = BY_SHALLOW_COPY
    return found
