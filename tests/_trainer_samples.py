"""What a trainer test checks of its samples: each is the call its forward_index names."""

from __future__ import annotations

import polars as pl

__all__ = ["check_samples", "per_sample"]


def per_sample(history: pl.DataFrame) -> pl.DataFrame:
    """One row per sample: its forward_index, steps and modes (as sets: one each, checked)."""
    return (
        history.group_by("sample_id")
        .agg(
            forward_index=pl.col("forward_index").unique(),
            step=pl.col("step").unique(),
            mode=pl.col("mode").unique(),
        )
        .sort("sample_id")
    )


def check_samples(history: pl.DataFrame, calls: list[tuple[str, int]]) -> None:
    """Every sample is the call its forward_index names: its phase is its mode, its step the
    trainer's global step at that call, and every call the observer counted was sampled."""
    samples = per_sample(history)
    assert samples["sample_id"].to_list() == list(range(len(calls)))
    for row in samples.iter_rows(named=True):
        [forward_index], [step], [mode] = row["forward_index"], row["step"], row["mode"]
        assert (mode, step) == calls[forward_index], row
