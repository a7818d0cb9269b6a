"""The run directory: layout, lock, live writer, merge, result.json, state file, index.md, end.

Nothing in this package imports torch, so `torchinstruments finalize` runs without it.
"""

__all__: list[str] = []
