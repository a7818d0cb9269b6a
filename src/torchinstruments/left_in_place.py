"""Forwards replaced or wrapped after injection: what removal's warning and index.md say.

A forward the user (or a library) replaced or wrapped after `inject_observer` may still call the
observer's proxy; removal leaves such a replacement in place (capture.Proxies.restore) and the
run names each one, because calls that went around the proxy were not observed.
"""

from __future__ import annotations

from collections.abc import Callable

from torchinstruments.rundir.shell import layer_span

__all__ = ["Forward", "forwards_said", "left_in_place_note"]

# A forward left in place: ("layer", its name), ("root", its class) or ("", a module's class).
Forward = tuple[str, str]


def forwards_said(forwards: tuple[Forward, ...], named: Callable[[str], str] = repr) -> str:
    """`forwards` for the removal's warning (a layer `named` by `repr`) or index.md's note
    (`layer_span`: a name holding `*` or `<x>` rendered as Markdown outside code)."""
    return ", ".join(
        f"layer {named(text)}" if kind == "layer" else f"the root ({text})" if kind else text
        for kind, text in forwards
    )


def left_in_place_note(forwards: tuple[Forward, ...]) -> str:
    """index.md's note on forwards replaced or wrapped after injection (`Proxies.restore`)."""
    return (
        "replaced or wrapped after inject_observer, the forward of: "
        f"{forwards_said(forwards, layer_span)}. "
        "Removal left each replacement in place (an observer proxy it still calls is inert now). "
        "Calls that went through a replacement without reaching that proxy were not observed: a "
        "root forward made so was neither counted nor sampled, and a layer call made so has no rows"
    )
