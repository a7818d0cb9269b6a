"""index.md's "Loss scale" section: a run with a `grad_scaler`, its scales, and how to unscale.

Design decision: the output_gradient rows of a run whose loop scales its loss are what plain
hooks see, the gradient times the loss scale (`loss_scale.py`); the run keeps the scale of each
sample as spans in `.state.json` (`counts.loss_scales`; while the run lives, and so after a
kill, `loss_scales` as last saved: `rundir.live_scales`). This section says so where a reader of
gradient rows looks, lists the spans (bounded: the first `SHOWN_SPANS`, then a count), and prints
a query that divides the statistics which scale with the gradient (mean, std, min, max,
quantiles, and the built-in `abs_max` and `l2_norm`) by their sample's scale. Fractions
(zero_fraction, nonfinite_fraction) do not scale, nor, in general, a custom reducer's metric.
"""

from __future__ import annotations

from torchinstruments.records import RunInfo, ScaleSpan
from torchinstruments.rundir.layout import STATE_FILE
from torchinstruments.rundir.page_sections import quoted as _q
from torchinstruments.rundir.state import RunState

__all__ = ["SCALED_METRICS", "SHOWN_SPANS", "loss_scale_query", "section_loss_scale"]

SHOWN_SPANS = 20
# The metrics that are the gradient's statistic times the scale (a positive factor).
SCALED_METRICS = ("mean", "std", "min", "max", "p25", "p50", "p75", "abs_max", "l2_norm")


def _span_text(span: ScaleSpan, next_first: int | None) -> str:
    """`samples 0-11: 65536`, `sample 12: 32768`, `samples 13 on: 65536` (the last span)."""
    first = span.first_sample_id
    if next_first is None:
        where = f"samples {first} on"
    elif next_first - 1 == first:
        where = f"sample {first}"
    else:
        where = f"samples {first}-{next_first - 1}"
    return f"{where}: {'not recorded' if span.scale is None else f'{span.scale:.17g}'}"


def _spans_line(state: RunState) -> str:
    """The scales, or why none are known."""
    counts = state.counts
    spans = list(state.loss_scales if counts is None else counts.loss_scales)
    if counts is None and not spans:
        return (
            f"The scale of each sample is saved in {STATE_FILE} (`loss_scales`) as the run's "
            "rows are, and in `counts.loss_scales` when the run ends; none is saved yet."
        )
    # the closing span, where no sample follows it (a killed run's rows may outlast its save)
    if spans and spans[-1].scale is None and counts and spans[-1].first_sample_id >= counts.samples:
        spans.pop()
    if not spans:
        why = (
            "the process ended before the run saved any"
            if state.counts_recovered or state.interrupted
            else "no sample was recorded"
        )
        return f"No loss scale is recorded: {why}."
    if spans and spans[0].first_sample_id > 0:  # an earlier attempt's, killed: none known
        spans.insert(0, ScaleSpan(0, None))
    firsts = [span.first_sample_id for span in spans[1:]] + [None]
    texts = [_span_text(span, first) for span, first in zip(spans, firsts, strict=True)]
    more = len(texts) - SHOWN_SPANS
    shown = "; ".join(texts[:SHOWN_SPANS])
    if more > 0:
        shown += f"; ... ({more} more in {STATE_FILE})"
    so_far = " (so far: the run goes on)" if counts is None else ""
    return f"Loss scale by sample{so_far} ({len(texts)} span(s), one per change): {shown}."


def section_loss_scale(state: RunState) -> list[str]:
    """The section, or nothing for a run without a `grad_scaler`."""
    run = state.run
    if run.grad_scaler is None:
        return []
    return [
        "## Loss scale",
        "",
        f"**Gradient rows are scaled:** the loop scaled its loss with {run.grad_scaler}, so "
        "every output_gradient row (and gradient histogram) is the model's gradient times its "
        "sample's loss scale, as plain hooks see it. Divide by the scale to compare gradients "
        "across samples; a sample whose gradients hold inf/NaN (nonfinite_fraction > 0) "
        "overflowed, and the scaler skipped its optimizer step and lowered the scale. A ready "
        "query under 'Ready Polars queries' divides the rows by their sample's scale.",
        "",
        _spans_line(state),
        "",
    ]


def loss_scale_query(run: RunInfo) -> list[str]:
    """The query that unscales gradient statistics, for the queries section (none without a
    `grad_scaler`)."""
    if run.grad_scaler is None:
        return []
    scaled = [metric for metric in SCALED_METRICS if metric in run.metrics]
    return [
        "Unscaled gradient statistics (grad_scaler; after setup): "
        f"{', '.join(scaled)} divided by their sample's scale (a fraction does not scale, nor in general a custom metric: add its name if it "
        "does); `unscaled` is null where the scale is not recorded:",
        "",
        "```python",
        f"""SCALED = {scaled!r}
KEY = ["sample_id", "step", "layer", "call_index", "tensor_path", "mode", "metric"]
state = json.loads((run / {_q(STATE_FILE)}).read_text(encoding="utf-8"))
spans = (state["counts"] or state).get("loss_scales", [])  # in progress: those saved so far
scales = pl.LazyFrame(spans, schema={{"first_sample_id": pl.Int64, "scale": pl.Float64}})
unscaled = (
    history.filter(pl.col("signal") == "output_gradient", pl.col("metric").is_in(SCALED))
    .sort("sample_id", maintain_order=True)
    .join_asof(scales.sort("first_sample_id"), left_on="sample_id", right_on="first_sample_id")
    .with_columns(unscaled=pl.col("value") / pl.col("scale"))
    .select(*KEY, "value", "scale", "unscaled")
    .collect()
)
show(unscaled, most=50)""",
        "```",
        "",
    ]
