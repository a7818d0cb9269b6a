"""Ctrl-C inside the library's own bookkeeping: what a thread's next root forward heals.

A SIGINT becomes a KeyboardInterrupt at an arbitrary bytecode of the main thread (at a function's
entry, after a C call returns, at a loop's back edge), the library's own code included. A loop
that catches KeyboardInterrupt and goes on (a notebook cell run again) then lives with whatever
that bytecode left half done: layer proxies still installed, a sample never ended. observer.py
keeps a thread's root depth above 0 until a sampled forward's end is complete, so the thread's
next root forward, which reads the depth anyway, finds a cut end there; `running` tells that
apart from a real call of the root inside its own forward, and the observer heals the rest.
"""

from __future__ import annotations

import sys
from types import CodeType

__all__ = ["running"]


def running(code: CodeType, owner: object) -> bool:
    """Whether this thread's stack holds a frame running `code` with `self` being `owner`,
    beyond the caller's caller (the frame asking, and the call it serves, are left out)."""
    frame = sys._getframe(3)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is owner:
            return True
        frame = frame.f_back
    return False
