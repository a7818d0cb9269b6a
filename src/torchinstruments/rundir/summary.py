"""result.json: the layer catalog at injection, per-tensor summaries at removal.

Design decision: the summary is computed from the merged history.parquet with Polars lazy
queries on the streaming engine, never from state kept during training, so result.json is a pure
function of history.parquet and `finalize` can rebuild it after a crash. The one exception is each
layer's `sampled_forwards` (in how many sampled forwards it was called), which at removal comes
from the observer's `RunCounts`: a call whose output holds no tensor leaves no history row. After
a crash it is rebuilt from history (sampled forwards with an output row), a lower bound; a layer
with no output row on disk is null then (unknown: it may have run in samples the crash lost),
never 0. At injection it is null too (the catalog, before anything ran).

Design decision: one pass in chunks (`rundir.series_stats`: one row per series, with its
windows), then the text in Polars (`rundir.result_text`), written one layer at a time; Python
handles one string per layer. This module decides what result.json lists: every selected layer
in traversal order, then any layer history holds beyond them, each with its `sampled_forwards`.

Definitions (also in index.md):

- A tensor entry is one (call_index, signal, tensor_path, mode): a train sample and an eval
  sample of one tensor are never one series, so each mode has its own entry.
- One *observation* is one history row of a tensor-metric; `observations` counts them and `valid`
  counts those with a non-null value.
- `first` / `latest`: the value (possibly null) of the earliest / latest observation in history
  order (sample_id, then write order), at the tensor's `first_sample_id` / `latest_sample_id`.
- `min` / `max`: over finite values; `sample_id` is the earliest sample holding that value.
- Windows are over the tensor-metric's own samples (distinct sample_ids in which it was observed),
  newest first: `recent` holds the latest `window` of them, `previous` the `window` before.
  `actual` = samples in the window (< window early in a run), `first_sample_id` /
  `last_sample_id` = its sample range (both per tensor); per metric, `valid` = non-null values in
  it and `mean` = mean of its finite values (null when there are none). A window mean averages
  per-sample statistics; it is not a statistic of the pooled elements.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from torchinstruments.records import LayerInfo
from torchinstruments.rundir.dtype_spans import DtypeChanges, changed_dtypes, dtype_changes
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    RESULT_FILE,
    replace_atomically,
    scan_history,
)
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.result_text import encode, layer_texts, with_tensor_facts
from torchinstruments.rundir.series_stats import series_summary
from torchinstruments.rundir.shell import tool_command
from torchinstruments.rundir.windows import check_window


def _dump(directory: Path, lines: Iterable[str]) -> None:
    """Write result.json atomically, one layer record (JSON text) per line, as they come."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            separator = "[\n"
            for line in lines:
                f.write(separator + line)
                separator = ",\n"
            f.write("[]\n" if separator == "[\n" else "\n]\n")

    replace_atomically(directory / RESULT_FILE, write)


def write_catalog(directory: Path, layers: Sequence[LayerInfo]) -> None:
    """Write result.json as the catalog of selected layers, each with no tensors yet.

    Args:
        directory: the run's output directory.
        layers: the selected layers in traversal order.
    """
    _dump(
        directory,
        (
            encode(
                {
                    "layer": li.name,
                    "module_type": li.module_type,
                    "sampled_forwards": None,
                    "tensors": [],
                }
            )
            for li in layers
        ),
    )


def layer_lines(
    history: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
    *,
    lower_bounds: bool = False,
) -> tuple[Iterator[str], DtypeChanges]:
    """The records of result.json computed from a history.parquet, as JSON text, one layer at a
    time, and the layers whose dtype changed during the run (for index.md).

    Every layer of `layers` is listed in that order (executed or not); layers present in history
    but not in `layers` follow, sorted by name, so no data is hidden.

    Args:
        history: path of history.parquet.
        layers: the selected layers in traversal order.
        window: samples per window.
        layer_samples: sampled forwards in which each layer was called (`RunCounts`); a layer
            not in it gets 0. None counts, from history, the sampled forwards with an output row.
        lower_bounds: the counts were rebuilt after a crash: a layer counted 0 (no output row
            on disk) has `sampled_forwards` null, unknown, never 0.

    Returns:
        One compact JSON object per layer, as they are iterated; the `DtypeChanges`.
    """
    check_window(window)
    stats, spans = series_summary(history, window)
    samples = layer_samples if layer_samples is not None else _output_samples(history)
    module_types = {li.name: li.module_type for li in layers}
    names = list(dict.fromkeys(li.name for li in layers))
    seen = stats.group_by("layer").agg(pl.col("module_type").last())
    for name, module_type in seen.iter_rows():  # the class when measured (a lazy module's)
        module_types[name] = module_type
    names += sorted(set(module_types) - set(names))
    order = pl.DataFrame(
        {"layer": names, "_order": range(len(names)), "module_type": map(module_types.get, names)},
        schema={"layer": pl.String, "_order": pl.Int64, "module_type": pl.String},
    )
    frame = (
        with_tensor_facts(stats)
        .join(order.drop("module_type"), on="layer", how="left")
        .sort(
            *("_order", "call_index", "signal", "tensor_path", "mode", "metric"),
            descending=[False, False, False, False, True, False],  # train before eval
        )
    )
    del stats
    texts = layer_texts(frame, changed_dtypes(spans))
    del frame

    def lines() -> Iterator[str]:
        for name in names:
            head = {
                "layer": name,
                "module_type": module_types[name],
                "sampled_forwards": None
                if lower_bounds and not samples.get(name)
                else int(samples.get(name, 0)),
            }
            yield encode(head)[:-1] + ',"tensors":[' + texts.pop(name, "") + "]}"

    return lines(), dtype_changes(spans, order)


def summarize(
    history: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """The whole result.json payload as Python objects (see `layer_lines`, which streams it)."""
    lines, _ = layer_lines(history, layers, window, layer_samples)
    return [json.loads(line) for line in lines]


def _output_samples(history: Path) -> dict[str, int]:
    """Per layer, the distinct sample_ids with an output row."""
    frame = (
        scan_history(history)
        .filter(pl.col("signal") == "output", ~is_mark())
        .group_by("layer")
        .agg(samples=pl.col("sample_id").n_unique())
        .collect(engine="streaming")
    )
    return {r["layer"]: int(r["samples"]) for r in frame.iter_rows(named=True)}


def write_result(
    directory: Path,
    layers: Sequence[LayerInfo],
    window: int,
    layer_samples: Mapping[str, int] | None = None,
    *,
    lower_bounds: bool = False,
) -> DtypeChanges:
    """Write result.json with per-tensor summaries computed from `directory/history.parquet`;
    return the layers whose dtype changed during the run (index.md names them).

    Args:
        directory: the run's output directory (history.parquet must already be merged).
        layers: the selected layers in traversal order.
        window: samples in each of the `previous` and `recent` windows.
        layer_samples: per layer, the sampled forwards in which it was called (see `summarize`).

    Raises:
        FileNotFoundError: if history.parquet does not exist (run `torchinstruments finalize`).
    """
    history = directory / HISTORY_FILE
    if not history.exists():
        raise FileNotFoundError(
            f"{history} does not exist, so result.json cannot be summarised; run "
            f"`{tool_command('finalize', directory)}` to "
            "merge history.parts/ first"
        )
    lines, changes = layer_lines(history, layers, window, layer_samples, lower_bounds=lower_bounds)
    _dump(directory, lines)
    return changes


__all__ = ["layer_lines", "summarize", "write_catalog", "write_result"]
