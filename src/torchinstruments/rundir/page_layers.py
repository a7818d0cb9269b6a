"""index.md's lists of layers, bounded whatever the model size.

Design decision: up to LISTED_LAYERS selected layers, index.md names every one (in the Run
section, and in the Layers table with the sampled forwards each ran in), unless their names are
so long that the page would pass PAGE_BYTES (200 names of 80 characters: 87 KB), which groups
them as below. Beyond, a 3,000-layer
model would make a 300 KB page that no reader takes in, so the page groups: the Run section
counts the layers per module type, the Layers table has one row per module type (layers,
fewest and most sampled forwards, first and last layer), and the layers that never ran are
still listed, as runs of consecutive layers in traversal order, up to NEVER_RAN_CHARS
characters, or fewer where the rest of the page leaves less of `PAGE_BYTES` (index.md's bound,
whatever the catalog: `index_page.render_index`). Every layer by name stays in `.state.json` (`run.layers`, `counts.layer_samples`)
and result.json (`sampled_forwards`), and the page says so where it groups. The cost: beyond
LISTED_LAYERS a single layer's count is one query away instead of on the page.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchinstruments.records import LayerInfo, RunInfo
from torchinstruments.rundir.layout import RESULT_FILE, STATE_FILE
from torchinstruments.rundir.ranges import bound_count
from torchinstruments.rundir.shell import layer_span, literal_if_unclear, table_cell, unlinked
from torchinstruments.rundir.state import RunState

LISTED_LAYERS = 200
LISTED_TYPES = 40
LISTED_FOCUS = 40
NEVER_RAN_CHARS = 16_000
PAGE_BYTES = 64 * 1024  # index.md at most, for any catalog
WHERE_EVERY_LAYER = (
    f"every layer by name: `{STATE_FILE}` (`run.layers`, and `counts.layer_samples`, where a "
    f"layer that never ran is 0 or absent, but after a kill absent is unknown) and "
    f"{RESULT_FILE} (`sampled_forwards`, null where unknown)"
)

_FUSED_SHOWN = 8  # encoder layers named; the rest counted (index.md stays bounded)


def _fused_paths(names: tuple[str, ...]) -> str:
    """The Layers section's sentence on fused fast paths, for a run with one (else nothing)."""
    if not names:
        return ""
    if names == ("",):
        which = "(the observed model itself)"
    else:
        shown = ", ".join(_name(n) if n else "the observed model" for n in names[:_FUSED_SHOWN])
        more = len(names) - _FUSED_SHOWN
        which = f"({shown}{f' and {more} more' if more > 0 else ''})"
    return (
        " In eval without gradients (no_grad, inference_mode, frozen weights), each "
        f"`nn.TransformerEncoderLayer` holding selected layers {which} runs layer by layer in "
        "sampled forwards (as it does when a hook is attached) instead of as one fused kernel "
        "that would skip them; unsampled forwards keep the fused kernel."
    )


def _name(layer: LayerInfo | str) -> str:
    """A layer's name as index.md writes it: a code span of `literal_if_unclear` (`<root>`)."""
    name = layer.name if isinstance(layer, LayerInfo) else layer
    return layer_span(name)


def _type_said(module_type: str) -> str:
    """A module type in a line of the page (`literal_if_unclear`), leaving GitHub no bare link
    to make of it (`unlinked`: a class can be named anything, `a@b.co` too)."""
    return unlinked(literal_if_unclear(module_type))


def _cell(layer: LayerInfo) -> str:
    """`_name` for a table cell: a `|` in the name escaped, since GitHub's Markdown splits a
    table row at every unescaped `|`, inside a code span too (and shows `\\|` there as `|`)."""
    return _name(layer).replace("|", "\\|")


# Said in the Layers section of a run with a name `literal_if_unclear` changes or holding `|`.
_WRITTEN_AS_LITERALS = (
    " A layer name or module type that holds a line break or another character that is not "
    "printable, or begins with a quote, is written on this page as its Python string literal "
    "(`'a\\nb'`); in a table, each `|` of a name is written `\\|`."
)


def _written_as_literals(run: RunInfo) -> str:
    """`_WRITTEN_AS_LITERALS` where some layer's name or module type is so written, else ""."""
    texts = (text for li in run.layers for text in (li.name, li.module_type))
    unclear = any(literal_if_unclear(t) != t or "|" in t for t in texts)
    return _WRITTEN_AS_LITERALS if unclear else ""


def _by_type(layers: Sequence[LayerInfo]) -> dict[str, list[LayerInfo]]:
    """Layers per module type, types in order of first appearance."""
    groups: dict[str, list[LayerInfo]] = {}
    for layer in layers:
        groups.setdefault(layer.module_type, []).append(layer)
    return groups


def grouped(run: RunInfo, too_long: bool) -> bool:
    """Whether the page groups the layers by module type: beyond LISTED_LAYERS, or where
    every name would take the page past PAGE_BYTES (`too_long`: long names)."""
    return too_long or len(run.layers) > LISTED_LAYERS


def _why_grouped(run: RunInfo) -> str:
    """Why the Layers table has a row per module type, not per layer."""
    if len(run.layers) > LISTED_LAYERS:
        return f"more than {LISTED_LAYERS} layers"
    return f"every layer by name would take this page past {PAGE_BYTES // 1024} KiB"


def layers_line(run: RunInfo, too_long: bool = False) -> str:
    """The Run section's "selected layers" item: every name, or counts per module type
    (`grouped`)."""
    n = len(run.layers)
    if not grouped(run, too_long):
        names = ", ".join(f"{_name(li)} ({_type_said(li.module_type)})" for li in run.layers)
        return f"selected layers ({n}, traversal order): {names or 'none'}"
    groups = list(_by_type(run.layers).items())
    types = ", ".join(f"{_type_said(t)} {len(ls)}" for t, ls in groups[:LISTED_TYPES])
    if len(groups) > LISTED_TYPES:
        types += f", and {len(groups) - LISTED_TYPES} more module types"
    return (
        f"selected layers ({n}, traversal order, from {_name(run.layers[0])} to "
        f"{_name(run.layers[-1])}), by module type: {types}; {WHERE_EVERY_LAYER}"
    )


def focus_line(run: RunInfo) -> str:
    """The Run section's focus layers item."""
    names = [_name(name) for name in run.focus_layers[:LISTED_FOCUS]]
    more = len(run.focus_layers) - LISTED_FOCUS
    text = ", ".join(names) or "none"
    if more > 0:
        text += f", and {more} more (`run.focus_layers` in `{STATE_FILE}`)"
    return f"focus layers (TensorBoard histograms): {text}"


def never_ran_runs(layers: Sequence[LayerInfo], never: set[str], budget: int) -> str:
    """The layers in `never`, consecutive ones (traversal order) as `first` .. `last` (n layers).

    At most about `budget` characters; what does not fit is counted, never dropped silently.
    """
    runs: list[list[LayerInfo]] = []
    previous_never = False
    for layer in layers:
        is_never = layer.name in never
        if is_never and previous_never:
            runs[-1].append(layer)
        elif is_never:
            runs.append([layer])
        previous_never = is_never
    pieces: list[str] = []
    used = listed = 0
    for run in runs:
        piece = (
            _name(run[0])
            if len(run) == 1
            else f"{_name(run[0])} .. {_name(run[-1])} ({len(run)} layers)"
        )
        if used + len(piece) > budget:
            break
        pieces.append(piece)
        used += len(piece) + 2
        listed += len(run)
    text = ", ".join(pieces)
    left = sum(len(run) for run in runs) - listed
    if left:
        text += f", and {left} more ({WHERE_EVERY_LAYER})"
    return text


_ZERO = (
    "A layer with 0 never ran in a sampled forward: it has no rows (a branch not taken, a "
    "module its parent never calls, a `forward` replaced or a module taken out of the model "
    "after injection: the notes name those)."
)
# Counts rebuilt after a crash only know what reached the disk: a layer may have run in the
# samples whose rows died in memory, so 0 is no proof that it never ran.
_ZERO_RECOVERED = (
    "Each count is what reached the disk (at least N), as the run's counts are; a layer "
    "counted unknown has no output row on disk (result.json's `sampled_forwards` is null, "
    "never 0): it ran in no sampled forward whose rows reached the disk (a branch not taken, a module its parent never calls, a `forward` replaced or a "
    "module taken out of the model after injection, or only in samples the end of the process "
    "lost)."
)


def section_layers(
    state: RunState, never_ran_chars: int = NEVER_RAN_CHARS, too_long: bool = False
) -> list[str]:
    """Per selected layer (or module type: `grouped`), in how many sampled forwards it ran;
    those that never did, named in at most `never_ran_chars` characters (the rest counted)."""
    run, counts = state.run, state.counts
    if counts is None:
        return []
    if state.layer_counts_unknown:
        lines = [
            "## Layers",
            "",
            "Sampled forwards in which each selected layer was called and returned: unknown. "
            "No layer's output row reached the disk before the process ended, so whether and "
            "how often each layer ran is unknown (result.json's `sampled_forwards` is null), "
            f"never 0.{_written_as_literals(run)}",
            "",
        ]
        if not grouped(run, too_long):
            lines += ["| layer | module_type | sampled forwards |", "| --- | --- | --- |"]
            lines += [
                f"| {_cell(li)} | {table_cell(li.module_type)} | unknown |" for li in run.layers
            ]
        return [*lines, ""]
    bound = " (lower bounds, rebuilt from history)" if state.counts_recovered else ""
    zero = _ZERO_RECOVERED if state.counts_recovered else _ZERO
    ran = counts.layer_samples
    said = bound_count if state.counts_recovered else str  # a count nobody wrote: unknown
    lines = [
        "## Layers",
        "",
        f"Sampled forwards in which each selected layer was called and returned{bound}, out "
        f"of {said(counts.samples)} (a call that raised is not counted; such samples are listed near the top of this page). "
        f"{zero}{_fused_paths(run.fused_paths)}{_written_as_literals(run)}",
        "",
    ]
    if not grouped(run, too_long):
        lines += ["| layer | module_type | sampled forwards |", "| --- | --- | --- |"]
        lines += [
            f"| {_cell(li)} | {table_cell(li.module_type)} | {said(ran.get(li.name, 0))} |"
            for li in run.layers
        ]
    else:
        lines += [
            f"{len(run.layers)} layers, one row per module type ({_why_grouped(run)}); "
            f"{WHERE_EVERY_LAYER}.",
            "",
            "| module_type | layers | sampled forwards (fewest .. most) | first layer | last layer |",
            "| --- | --- | --- | --- | --- |",
        ]
        groups = list(_by_type(run.layers).items())
        for module_type, layers in groups[:LISTED_TYPES]:
            numbers = [ran.get(li.name, 0) for li in layers]
            lines.append(
                f"| {table_cell(module_type)} | {len(layers)} | {said(min(numbers))} .. {said(max(numbers))} | "
                f"{_cell(layers[0])} | {_cell(layers[-1])} |"
            )
        if len(groups) > LISTED_TYPES:
            rest = sum(len(ls) for _, ls in groups[LISTED_TYPES:])
            lines.append(f"| ({len(groups) - LISTED_TYPES} more types) | {rest} | | | |")
    never = {li.name for li in run.layers if not ran.get(li.name)}
    if never and counts.samples:
        title = "No row on disk" if state.counts_recovered else "Never ran in a sampled forward"
        lines += [
            "",
            f"{title} ({len(never)}): " + never_ran_runs(run.layers, never, never_ran_chars),
        ]
    return [*lines, ""]


__all__ = [
    "LISTED_LAYERS",
    "NEVER_RAN_CHARS",
    "PAGE_BYTES",
    "focus_line",
    "grouped",
    "layers_line",
    "never_ran_runs",
    "section_layers",
]
