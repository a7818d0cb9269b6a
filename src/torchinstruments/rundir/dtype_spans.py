"""A tensor's dtypes over the run: a model cast mid-run, or autocast on some steps only.

Every history row carries the dtype its tensor had when it was measured, but a summary has one
entry per tensor (`rundir.summary`), whose `dtype` is the latest seen: after `model.half()` at
sample 100, that alone would describe a run of float32 and float16 samples as float16 all along.
So the summary's pass over history also takes, per tensor and dtype, the first and last sample
holding it (plain min / max aggregates, combined across chunks like the summary's own, in memory
proportional to tensors x dtypes); result.json lists them as the tensor's `dtypes` where there
is more than one, and index.md names each such layer with each dtype's samples
(`DtypeChanges`, kept in the run state so `finalize` renders the same page).

The cost is paid only by a history of more than one dtype: while every chunk holds the one
dtype of the chunks before it (most runs), no tensor can have changed and `DtypeSpans` keeps
nothing; at the first chunk that brings a second dtype, the earlier chunks' spans are taken
from the summary's own aggregates so far (each tensor's first and latest sample), not read again.

Why first and last sample, not every sample: they are bounded whatever the run's length, and a
cast shows as ranges one after the other while alternating (autocast on some steps) shows as
ranges that overlap; history holds each row's dtype for anything finer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from torchinstruments.rundir.shell import layer_span, literal_if_unclear
from torchinstruments.rundir.windows import TENSOR_KEY

__all__ = ["DtypeChanges", "DtypeSpans", "changed_dtypes", "dtype_changes"]

_SHOWN = 20  # layers named in index.md (it stays bounded on any model)
_SPAN = ("first_sample_id", "last_sample_id")


@dataclass(frozen=True)
class DtypeChanges:
    """The layers whose tensors had more than one dtype over the run, for index.md.

    Attributes:
        layers: the first `_SHOWN` of them, one description each (`'fc' (Linear): float32
            samples 0-99, float16 samples 100-140`), in layer order.
        total: how many layers there are.
    """

    layers: tuple[str, ...] = ()
    total: int = 0


class DtypeSpans:
    """Per tensor and dtype, its first and last sample_id, over consecutive chunks of history
    (marks left out); nothing while every row has one dtype."""

    def __init__(self) -> None:
        self._single: str | None = None  # the one dtype of every chunk so far
        self._spans: pl.DataFrame | None = None

    def add(self, rows: pl.DataFrame, before: Sequence[pl.DataFrame]) -> None:
        """Take a chunk's `rows`; `before`: the summary's `_chunk_stats` of the earlier chunks
        (their series' first and latest sample_id), read only at the first second dtype."""
        kinds = rows.get_column("dtype").unique()
        if self._spans is None and (kinds.len() == 0 or kinds.to_list() == [self._single]):
            return
        if self._spans is None and kinds.len() == 1 and self._single is None:
            self._single = kinds.item()
            return
        sample = pl.col("sample_id")
        frames = [rows.group_by(*TENSOR_KEY, "dtype").agg(first=sample.min(), last=sample.max())]
        if self._spans is None and self._single is not None:  # the earlier chunks: one dtype
            earlier = pl.concat(before).select(
                *TENSOR_KEY,
                dtype=pl.lit(pl.Series([self._single], dtype=rows.schema["dtype"])).first(),
                first=pl.col("first_sample_id"),
                last=pl.col("latest_sample_id"),
            )
            frames.append(earlier)
        if self._spans is not None:
            frames.append(self._spans)
        self._spans = (
            pl.concat(frames)
            .group_by(*TENSOR_KEY, "dtype")
            .agg(pl.col("first").min(), pl.col("last").max())
        )

    def spans(self) -> pl.DataFrame | None:
        """`TENSOR_KEY`, dtype, first_sample_id, last_sample_id; None: one dtype throughout."""
        if self._spans is None:
            return None
        return self._spans.rename({"first": "first_sample_id", "last": "last_sample_id"})


def changed_dtypes(spans: pl.DataFrame | None) -> pl.DataFrame | None:
    """The tensors of more than one dtype: `TENSOR_KEY`, then `dtypes`, result.json's list as
    JSON text (`[{"dtype", "first_sample_id", "last_sample_id"}, ...]`, by first sample);
    None for a history of one dtype."""
    if spans is None:
        return None
    entry = pl.struct(pl.col("dtype").cast(pl.String), *_SPAN)
    return (
        spans.filter(pl.len().over(TENSOR_KEY) > 1)
        .sort(*TENSOR_KEY, *_SPAN, "dtype", nulls_last=True)
        .group_by(TENSOR_KEY, maintain_order=True)
        .agg(dtypes=entry)
        .with_columns(pl.col("dtypes").list.eval(pl.element().struct.json_encode()))
        .with_columns(dtypes="[" + pl.col("dtypes").list.join(",") + "]")
        .with_columns(pl.col(c).cast(pl.String) for c in TENSOR_KEY if c != "call_index")
    )


def dtype_changes(spans: pl.DataFrame | None, order: pl.DataFrame) -> DtypeChanges:
    """index.md's `DtypeChanges`: per layer with a tensor of more than one dtype, each dtype's
    samples over those tensors (first to last), earliest first.

    Args:
        spans: `DtypeSpans.spans()`.
        order: `layer` (String), `_order` and `module_type`: the layers in result.json's order.
    """
    if spans is None:
        return DtypeChanges()
    changed = (
        spans.filter(pl.len().over(TENSOR_KEY) > 1)
        .with_columns(pl.col("layer", "dtype").cast(pl.String))
        .group_by("layer", "dtype")
        .agg(pl.col("first_sample_id").min(), pl.col("last_sample_id").max())
        .join(order, on="layer", how="left")
        .sort("_order", *_SPAN, "dtype", nulls_last=True)
    )
    lines: list[str] = []
    layers = changed.group_by("layer", "module_type", maintain_order=True).agg(
        pl.col("dtype", *_SPAN)
    )
    for layer, module_type, dtypes, firsts, lasts in layers.head(_SHOWN).iter_rows():
        each = ", ".join(
            f"{d} {_samples(f, la)}" for d, f, la in zip(dtypes, firsts, lasts, strict=True)
        )
        lines.append(f"{layer_span(layer)} ({literal_if_unclear(module_type)}): {each}")
    return DtypeChanges(tuple(lines), layers.height)


def _samples(first: int, last: int) -> str:
    """`sample 3` or `samples 0-2`."""
    return f"sample {first}" if first == last else f"samples {first}-{last}"
