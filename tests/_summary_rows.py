"""Hand-made history rows for the result.json tests: one measurement of a layer per call."""

from __future__ import annotations

from typing import Any

from torchinstruments.records import Measurement, MetricValue

WINDOW = 3  # samples per window in these runs


def m(sample: int, layer: str, values: dict[str, float | None], **kw: Any) -> Measurement:
    """One measurement of `layer` in `sample`, a row per metric of `values` (None: null with a
    reason); `kw` sets its module_type, call, signal, path, shape, dtype and mode."""
    return Measurement(
        sample_id=sample,
        forward_index=sample * 2,
        timestamp_us=sample,
        rank=None,
        layer=layer,
        module_type=kw.get("module_type", "Linear"),
        call_index=kw.get("call", 0),
        signal=kw.get("signal", "output"),
        tensor_path=kw.get("path", ""),
        shape=kw.get("shape", (2, 3)),
        dtype=kw.get("dtype", "float32"),
        mode=kw.get("mode", "train"),
        grad_enabled=True,
        metrics=tuple(values),
        values=tuple(
            MetricValue(v) if v is not None else MetricValue(None, "no finite entries")
            for v in values.values()
        ),
    )
