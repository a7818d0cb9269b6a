"""What a count of samples with output gradients rebuilt from history after a kill knows.

Design decision: a count rebuilt from the rows that reached the disk is a lower bound, and 0 of
one is said "unknown" (a count nobody wrote is unknown, never 0): a backward's rows are written
after its forward's, so a sample on disk without gradient rows may have had a backward whose
rows died with the process. A sample whose every output row says `grad_enabled` false (an
evaluation forward under torch.no_grad) is the exception: no gradient can reach an output that
was computed without grad, so it has none, known. When every sample the counts hold is one of
those, a rebuilt 0 is known and said "0", never "unknown" (a count that is known is never called
unknown). The rows say it (the history's `grad_enabled` column), so the rule holds for any run
`finalize` reads, and each attempt of a continued run is counted by its own rows alike. The
cost: one more distinct count over history's output rows in the same scan as the others.
"""

from __future__ import annotations

import polars as pl

from torchinstruments.records import OUTPUT
from torchinstruments.rundir.marks import is_mark
from torchinstruments.rundir.ranges import bound_count

__all__ = ["gradient_count", "gradient_zero_known", "no_grad_samples"]


def no_grad_samples() -> pl.Expr:
    """The samples whose output rows all ran with grad disabled (a null `grad_enabled`, from a
    history another tool wrote, counts as enabled: nothing is known of it), as one expression
    over history's rows: the samples with an output row less those with one under grad."""
    output = (pl.col("signal") == OUTPUT) & ~is_mark()
    with_grad = output & pl.col("grad_enabled").fill_null(True)
    return (
        pl.col("sample_id").filter(output).n_unique()
        - pl.col("sample_id").filter(with_grad).n_unique()
    )


def gradient_zero_known(backward: int, samples: int, no_grad: int | None) -> bool:
    """Whether a rebuilt count of 0 samples with output gradients is known: each of the
    `samples` counted (at least one) ran with grad disabled (`no_grad` of them)."""
    return backward == 0 and samples > 0 and no_grad == samples


def gradient_count(backward: int, known_zero: bool, word: bool = True) -> str:
    """A rebuilt count of samples with output gradients, before "with output gradients": `at
    least N samples`, `0 samples` (each ran with grad disabled: `known_zero`), or `unknown
    samples` (no row says anything); without `word`, the number alone (a table cell)."""
    if known_zero and not backward:
        return "0 samples" if word else "0"
    return bound_count(backward, "sample" if word else "")
