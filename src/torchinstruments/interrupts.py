"""Ctrl-C inside the library's own bookkeeping: held while the bookkeeping runs, then delivered.

A SIGINT becomes a KeyboardInterrupt at an arbitrary bytecode of the main thread (at a function's
entry, after a C call returns, at a loop's back edge), the library's own code included. A loop
that catches KeyboardInterrupt and goes on (a notebook cell run again) then lives with whatever
that bytecode left half done: layer proxies still installed, a sample never ended, rows handed to
one sink and not the next.

Design decision: the sections that must not be cut in half (a sampled forward's start, from the
sampling decision to the call of the user's forward; its end, from the forward's return to the
last sink; the end of a backward pass) run with SIGINT's handler swapped for `hold_signal`,
which only notes the signal; `release` puts the user's handler back and, if a SIGINT arrived
meanwhile, raises it again (`signal.raise_signal`), so it reaches the user's handler (Python's
KeyboardInterrupt, Lightning's, SIG_IGN) as it would have, once, a few milliseconds late (the
length of the section: one sample's transfer and its sinks). Only the main thread receives SIGINT,
and only there can a handler be swapped; elsewhere nothing is held (`NOT_HELD`).

Why the swap is written out at each section's start instead of called here: the entry of a
Python function is itself a place where a KeyboardInterrupt lands, so a helper that swapped the
handler could be interrupted before it did. `signal.signal(SIGINT, hold_signal)` called inline
is a C call after which the first check finds `hold_signal` in place: nothing between the
section's start and the swap can be interrupted. `signal.signal` itself first runs the handler
of a SIGINT already pending, raising it before the swap; each section then swaps again, in its
`except KeyboardInterrupt`, and notes that one as held (only a second SIGINT in the few
microseconds between the two escapes).

What remains is a KeyboardInterrupt that does not come from SIGINT through Python's handler (one
raised by a handler the user installed from C, by code the user runs in a held section, or
inside the user's forward while the library measures a layer's output, which is not held: that
sample is marked as raised). observer.py keeps a thread's root depth above 0 until a sampled
forward's end is complete, so the thread's next root forward, which reads the depth anyway,
finds a cut end there; `_torch_internals.running` tells that apart from a real call of the root inside its own
forward, and the observer heals the rest.

Cost: two `signal.signal` calls (about 2.5 us each here) per held section, on sampled forwards
and backward passes only; an unsampled root forward holds nothing.
"""

from __future__ import annotations

import signal
import time
from typing import Any

__all__ = ["NOT_HELD", "SIGINT", "STUCK_S", "hold_signal", "release"]

SIGINT = signal.SIGINT
NOT_HELD = object()  # off the main thread: there is no handler to swap, and no SIGINT arrives
_held: list[float] = []  # when the SIGINTs held now arrived (`time.monotonic`), for `release`
# A section that still holds a SIGINT this many seconds after it arrived is stuck (a sink that
# hangs on a network call): a second Ctrl-C then ends it at once.
STUCK_S = 1.0


def hold_signal(signum: int, frame: Any) -> None:
    """SIGINT's handler while a section runs: note the signal, raise nothing.

    Escape hatch: a section lasts a sample's transfer and sinks, milliseconds, unless one of them
    hangs, and a Ctrl-C must always end a hung step. A SIGINT that arrives `STUCK_S` or more
    after a held one puts Python's default handler back (the user's own, if not that one, is not
    known here) and raises KeyboardInterrupt now, cutting the section; the thread's next root
    forward heals what it left (see the module docstring). A press is sometimes not seen here
    (in one run of six the third press, not the second, ended a hung sink's step: why is not
    known), so ending a hung step may take one more press."""
    now = time.monotonic()
    if _held and now - _held[0] >= STUCK_S:
        _held.clear()
        signal.signal(SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt
    _held.append(now)


def release(previous: Any) -> None:
    """End a held section: put back `previous` (what `signal.signal` returned when the section
    began) and deliver a SIGINT that arrived meanwhile. Nested sections leave it to the outer one.

    A handler installed from C (`signal.signal` returned None) cannot be put back from Python:
    Python's own `default_int_handler` takes its place.
    """
    if previous is NOT_HELD or previous is hold_signal:
        return
    signal.signal(SIGINT, signal.default_int_handler if previous is None else previous)
    if _held:
        _held.clear()
        signal.raise_signal(SIGINT)  # the user's handler runs now, after the section
