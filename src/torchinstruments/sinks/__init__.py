"""Where records go: the run directory, the caller's TensorBoard logger, or any custom sink.

A sink receives plain records (`records.SampleRecord`), never tensors, in four lifecycle calls.
The run directory is itself a sink (`DirectorySink`), always first, so custom sinks see exactly
what the directory writes. A sink that raises is reported once and detached: telemetry must never
break the training step, and one broken sink must not silence the others.

One idea a module: `protocol` (the `Sink` protocol and its check), `directory` (`DirectorySink`),
`tensorboard` (`TensorBoardSink`, histograms into a caller's writer), `dispatch` (`SinkGroup`).
The public names are re-exported flat from `torchinstruments`.
"""

__all__: list[str] = []
