"""The run directory: file layout, lock, live writer, merge, result.json, index.md, end of run.

Nothing in this package imports torch, so `torchinstruments finalize` runs without it.
"""
