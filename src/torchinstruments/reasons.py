"""Why a value is null: every `unavailable_reason` the library can write, in one table.

Design decision: the code that measures never writes a reason as a literal; it calls the builders
below, and `REASONS` lists the template and meaning of each. index.md renders `REASONS`, and a test
builds every reason here and matches it against a template, so the page explains every reason the
code can emit. Like `records`, this module sits at the bottom of the package (it imports nothing
of it, and no torch), so the measurement code that emits reasons and the run directory that
explains them both import it downwards, and `finalize` renders index.md without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "BACKWARD_RAISED",
    "CUT_IN_BOOKKEEPING",
    "EMPTY",
    "FAKE_TENSOR",
    "MESSAGE_BOUND",
    "MESSAGE_KEPT",
    "META_DEVICE",
    "MODIFIED_INPUT_END",
    "NON_FINITE_RESULT",
    "NO_FINITE",
    "NO_VALUE",
    "REASONS",
    "RECORD_NO_VALUE",
    "REMOVED_IN_FLIGHT",
    "Reason",
    "cut_message",
    "dropped_at_cap",
    "error",
    "error_message",
    "explain",
    "global_stopped",
    "host_values_mismatch",
    "interrupted",
    "not_on_all_ranks",
    "partial_placement",
    "partly_written",
    "record_value",
    "reducer_left_out",
    "reducer_modified_input",
    "reducer_returned",
    "reducer_tensor_dtype",
    "reducer_tensor_layout",
    "reducer_tensor_shape",
    "reducer_value",
    "removed_during",
    "shared_output",
    "unsupported_dtype",
    "unsupported_layout",
    "unwritten_at_removal",
    "utf8_text",
    "without_values",
]


@dataclass(frozen=True, slots=True)
class Reason:
    """One kind of unavailable value: its text (with `<placeholders>`) and what it means."""

    template: str
    meaning: str

    def matches(self, reason: str) -> bool:
        """Whether `reason` is an instance of this template."""
        parts = re.split(r"<[^<>]+>", self.template)
        pattern = ".+".join(re.escape(part) for part in parts)
        return re.fullmatch(pattern, reason, re.DOTALL) is not None


EMPTY = "empty tensor"
NO_FINITE = "no finite entries"
NON_FINITE_RESULT = "non-finite result"
NO_VALUE = "reducer returned no value"
# A tensor on the meta device has a shape and a dtype but no values to read.
META_DEVICE = "unsupported device meta"
FAKE_TENSOR = "fake tensor: a shape and a dtype, no values (torch's FakeTensorMode)"
RECORD_NO_VALUE = "record error: value missing"
EMPTY_GLOBAL = "empty tensor over every rank"
NOT_GLOBAL_CUSTOM = (
    "custom reducers are computed on this rank's tensor only; with global_statistics this "
    "tensor's rows describe the whole tensor over its ranks, so this metric is not recorded"
)

# Marker rows of samples cut outside their root forward's own code (samples.py).
CUT_IN_BOOKKEEPING = (
    "interrupted: a KeyboardInterrupt cut the end of this sampled forward inside the library's "
    "own bookkeeping; the layers that returned before it have rows"
)
BACKWARD_RAISED = (
    "interrupted: a backward pass through this sample raised before it ended; the gradients "
    "that arrived before it have rows, the others have none"
)

# Dtypes that hold several values in each element, which torch cannot convert to any other dtype
# (only view as bytes): what each holds, for its reason.
PACKED_DTYPES = {
    "float4_e2m1fn_x2": (
        "each byte holds two 4-bit floats (e2m1, the elements of a block-scaled format such as "
        "MX or NVFP4, without their scales), which torch cannot convert to any other dtype"
    ),
}

REASONS: tuple[Reason, ...] = (
    Reason(EMPTY, "the tensor has no elements"),
    Reason(NO_FINITE, "every element is NaN or +-inf (nonfinite_fraction is still given)"),
    Reason(
        "unsupported dtype <dtype>",
        "e.g. complex tensors (no order for min, max and percentiles; no part of them, real or "
        "magnitude, stands for them)",
    ),
    Reason(
        "packed dtype <dtype>: <what it holds>",
        "a tensor of a dtype with several values in each element (float4_e2m1fn_x2: two 4-bit "
        "floats in each byte); torch cannot convert it to read its values, so it is not measured",
    ),
    Reason(
        "unsupported layout <layout>",
        "a sparse or other non-strided tensor too large to densify (over 2**26 entries; "
        "smaller ones are measured as the dense tensor they stand for)",
    ),
    Reason(
        META_DEVICE,
        "a tensor on the meta device (a model built or run under torch.device('meta')) has a "
        "shape and a dtype but no values; the other tensors of its sample are measured",
    ),
    Reason(
        FAKE_TENSOR,
        "a FakeTensor (made under FakeTensorMode, as torch's tracing and memory estimates "
        "do) has a shape, a dtype and a device but no values; the other tensors of its sample are "
        "measured",
    ),
    Reason(
        "partial sums (DTensor placement <placement>): not the layer's output",
        "a DTensor with a Partial placement holds this rank's partial sums, which add up to the "
        "output across ranks; measuring them would need a collective, which the library never adds",
    ),
    Reason(
        NON_FINITE_RESULT,
        "the statistic is beyond float64 (e.g. the L2 norm of entries near float64 max), or a "
        "custom reducer returned NaN or +-inf (e.g. AbsMax or L2Norm of a tensor without finite "
        "entries)",
    ),
    Reason("reducer error: <Type>: <message>", "a custom reducer raised; training went on"),
    Reason(
        NO_VALUE,
        "AbsMax or L2Norm of an empty tensor (the library's reducers give no value there)",
    ),
    Reason(
        "reducer left out <metric>, which its metrics name: its mapping had no entry for it",
        "a custom reducer's mapping had no entry for a metric its `metrics` names (warned once "
        "per layer and named in index.md, as a reducer that raised)",
    ),
    Reason(
        "reducer returned <type>, expected a mapping of metric names to scalars",
        "a custom reducer returned something other than a mapping",
    ),
    Reason(
        "reducer returned <type> for <metric>, expected a scalar tensor or a real number",
        "a custom reducer's value for this metric was neither a tensor nor a number",
    ),
    Reason(
        "reducer returned a tensor with unsupported layout <layout>",
        "a custom reducer returned a sparse or other non-strided tensor",
    ),
    Reason(
        "reducer returned a tensor of unsupported dtype <dtype>",
        "a custom reducer returned a complex or otherwise unmeasurable tensor",
    ),
    Reason(
        "reducer returned a tensor of shape <shape>, expected a scalar",
        "a custom reducer returned a tensor with more than one element",
    ),
    Reason("statistics error: <Type>: <message>", "computing the default statistics failed"),
    Reason(EMPTY_GLOBAL, "global_statistics: the tensor has no elements on any rank"),
    Reason(NOT_GLOBAL_CUSTOM, "global_statistics: custom reducers are not computed globally"),
    Reason(
        "not run on every rank of its group (ran on rank <ranks> of <group>): no global "
        "statistics for this tensor in this sample; the tensors every rank ran are measured",
        "global_statistics: the layer ran on some ranks only in this sample (a branch taken on "
        "one rank, a Mixture-of-Experts expert not routed to on every rank), so there is no "
        "whole tensor to measure; the sample's other tensors keep their global rows",
    ),
    Reason(
        "the ranks sampled different root forwards (<field> by rank: <values>): every rank "
        "stopped global statistics here, together (from here on a sample is another root "
        "forward on some rank, and a rank ahead would wait for one no other rank takes)",
        "global_statistics, after `RanksApartError:` in the stop's reason: the ranks' samples "
        "were not the same root forward (a rank ran a forward the others did not, set another "
        "step, or ran another kind of forward, by mode or grad mode: a validation batch one "
        "rank ran alone), so every rank stopped global statistics there together, never "
        "combining two populations nor waiting again",
    ),
    Reason(
        "the root forward raised on rank <ranks>, which did not run this tensor (it ran on rank "
        "<ranks> of <group>): no global statistics for this tensor in this sample; the tensors "
        "every rank ran are measured",
        "global_statistics: a rank's sampled forward raised before it produced this tensor, so "
        "there is no whole tensor to measure; the tensors every rank produced before the raise "
        "keep their global rows (the raising rank's sample is marked interrupted)",
    ),
    Reason(
        "global statistics stopped at <when>, for the rest of the run: <Type>: <message>",
        "global_statistics: a collective of the library failed or no other rank came within its "
        "wait (a rank whose data ran out, or that met the user's own barrier or collective, while "
        "another took a sample, or a sampled forward ran on some ranks only, an evaluation batch "
        "one rank ran alone: RanksApartError names the sample and forward_index); the ranks are "
        "no longer known to be in step, so from then on no rank takes the library's collectives "
        "and every globally measured tensor is null",
    ),
    Reason(
        "statistics error: expected <n> host values, got <m>",
        "the values transferred from the device did not match what was launched (a bug: please "
        "report it)",
    ),
    Reason(
        "measurement error: <Type>: <message>", "measuring this tensor failed; training went on"
    ),
    Reason(
        "reducer <name> modified its argument in place (it was given a copy: training is "
        "unaffected)",
        "a custom reducer changed the tensor it was given (its version counter moved); its "
        "values are discarded, and the next reducer gets a fresh copy",
    ),
    Reason(
        "shared output: the same tensor was returned by <n> sampled calls of this layer, so its "
        "gradient is the sum over all of them and belongs to no single call",
        "a layer returned one tensor as is in several sampled calls (a Parameter a shared module "
        "returns, an Identity applied twice, a leaf input in two forwards before one backward); "
        "that tensor receives one gradient per backward: the sum over every use",
    ),
    Reason(
        "record error: value of type <type> is not a number",
        "a record reached the history writer with a value it cannot store (a bug: please report "
        "it); the cell is null, the rows around it are kept",
    ),
    Reason(
        "interrupted: the root forward raised <Type>: <message> in layer <layer> (call <n>)",
        "a marker row (metric `interrupted`): this sampled forward ended with an exception "
        "raised by this layer's forward (or inside it); the layers that returned before it have "
        "their rows, the others have none",
    ),
    Reason(
        "interrupted: the root forward raised <Type>: <message> outside the selected layers",
        "a marker row (metric `interrupted`): this sampled forward ended with an exception raised "
        "between layers (in the model's own code); the layers that returned before it have rows",
    ),
    Reason(
        "interrupted: remove_observer was called during this sample's forward; the layers that "
        "returned before it have rows, the others have none",
        "a marker row (metric `interrupted`): the run was removed from inside this sampled "
        "forward (or from another thread while it ran); the forward went on unobserved",
    ),
    Reason(
        "interrupted: remove_observer was called during this sample's backward; the gradients "
        "that arrived before it have rows, the others have none",
        "a marker row (metric `interrupted`, signal output_gradient): the run was removed from "
        "inside a backward pass through this sample (a tensor hook); the pass went on unobserved",
    ),
    Reason(
        CUT_IN_BOOKKEEPING,
        "a marker row (metric `interrupted`): a Ctrl-C landed while the library was ending this "
        "sampled forward (restoring the layers' forwards, handing rows to the sinks) and the "
        "loop caught it and went on; the thread's next root forward finished that end. What the "
        "sample measured was kept",
    ),
    Reason(
        BACKWARD_RAISED,
        "a marker row (metric `interrupted`, signal output_gradient): the backward pass raised "
        "(a Ctrl-C, an exception in a hook or an autograd Function) after it reached this "
        "sample's outputs; the gradients that arrived are written when the next sampled forward "
        "starts (or at removal). A pass that raised before it reached any of them leaves the "
        "sample unmarked, with no gradient rows, as a sample without a backward",
    ),
    Reason(
        "interrupted: rows of this sample were dropped at the memory cap (max_buffered_rows=<n>) "
        "while history parts could not be written; its rows in history are real measurements, "
        "the loss ledger counts the dropped ones",
        "a marker row (metric `interrupted`, the signal of the first rows dropped): part of this "
        "sample's rows were kept and part dropped because the rows waiting for a failing part "
        "write had reached `max_buffered_rows`, so the sample is partial",
    ),
    Reason(
        "interrupted: history parts could not be written at removal after part of this "
        "sample's rows; <k> of its <n> <signal> rows are in history",
        "a marker row: at removal, the last history part that could be written ended inside "
        "this sample's rows of that signal (a full disk), so its values for that signal are "
        "partial; the loss ledger counts the rows not written",
    ),
    Reason(
        "interrupted: the process ended before this sample's rows were all written; <k> of its "
        "<n> <signal> rows are in history",
        "a marker row written by `finalize`: the process died (SIGKILL, a crash) while part of "
        "this sample's rows were still in memory, so its values for that signal are partial",
    ),
    Reason(
        RECORD_NO_VALUE,
        "a record reached the history writer with neither a value nor a reason (a bug: please "
        "report it)",
    ),
)


def unsupported_dtype(dtype: str) -> str:
    """The tensor's dtype cannot be measured; a packed one's reason says what it holds."""
    if dtype in PACKED_DTYPES:
        return f"packed dtype {dtype}: {PACKED_DTYPES[dtype]}"
    return f"unsupported dtype {dtype}"


def partial_placement(placement: str) -> str:
    """A DTensor whose placement is Partial holds partial sums, not the layer's output."""
    return f"partial sums (DTensor placement {placement}): not the layer's output"


def unsupported_layout(layout: object) -> str:
    """The tensor's layout cannot be measured."""
    return f"unsupported layout {layout}"


def without_values(meta: bool, fake: bool) -> str | None:
    """Why a tensor has no values to measure (on the meta device, or fake), or None if it has."""
    return META_DEVICE if meta else FAKE_TENSOR if fake else None


def utf8_text(text: str) -> str:
    """`text` with its lone surrogates written as `\\udcff` escapes, so UTF-8 files hold it.

    Why: an error's message may carry lone surrogates (bytes that were not UTF-8, decoded with
    `surrogateescape`: a file name, a subprocess's output), which Polars and UTF-8 text files
    refuse; a reason or note holding one failed the run directory's write, which detached it
    and left the run in progress with none of its rows."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# An error's message in a reason: its first MESSAGE_KEPT characters. A reason is copied into
# every row it explains (each metric of each tensor the failure touched), so a reducer raising
# with a 10 MB message (a tensor's repr, a dump) put 10 MB in every one of those rows.
MESSAGE_KEPT = 1000
_MESSAGE_CHARS = 200  # in an `interrupted` marker, which is one row per sample
MESSAGE_BOUND = (
    f"A `<message>` is the exception's message, at most its first {MESSAGE_KEPT:,} characters "
    "(a longer one ends `... (<n> more characters cut)`; in an `interrupted` marker, its first "
    f"{_MESSAGE_CHARS} with whitespace collapsed, ending `...` where cut), with lone surrogates written "
    "as `\\udcff` escapes."
)


def cut_message(text: str, kept: int = MESSAGE_KEPT) -> str:
    """`text`'s first `kept` characters, saying how many more were cut, if any: an error's
    message as a reason or a note quotes it (a note is a paragraph of index.md, which stays
    within 64 KiB)."""
    if len(text) <= kept:
        return text
    cut = len(text) - kept
    return f"{text[:kept]} ... ({cut:,} more character{'s' if cut > 1 else ''} cut)"


def error_message(exc: BaseException) -> str:
    """`str(exc)` as text every file of the run can hold (`MESSAGE_BOUND`), or a stand-in
    where it raises: a user's error (a sink's, a reducer's) quoted in the user's step must not
    raise there itself."""
    try:
        return utf8_text(cut_message(str(exc)))
    except Exception:  # an error whose own message raises (one a tensor subclass raised)
        return "(its message could not be read)"


def error(source: str, exc: BaseException) -> str:
    """`<source> error: <Type>: <message>`; source is reducer, statistics or measurement (a
    failure of global statistics stops them: `global_stopped`)."""
    if source not in ("reducer", "statistics", "measurement"):
        raise ValueError(f"source must be reducer, statistics or measurement, got {source!r}")
    return f"{source} error: {type(exc).__name__}: {error_message(exc)}"


def reducer_returned(kind: str) -> str:
    """A custom reducer returned something other than a mapping."""
    return f"reducer returned {kind}, expected a mapping of metric names to scalars"


def reducer_value(kind: str, metric: str) -> str:
    """A custom reducer's value is neither a tensor nor a real number."""
    return f"reducer returned {kind} for {metric!r}, expected a scalar tensor or a real number"


def reducer_left_out(metric: str) -> str:
    """A custom reducer's mapping had no entry for `metric`, which its `metrics` names: its
    failure, not the tensor's (the library's own reducers give `NO_VALUE` for an empty tensor)."""
    return f"reducer left out {metric!r}, which its metrics name: its mapping had no entry for it"


def reducer_tensor_layout(layout: object) -> str:
    """A custom reducer returned a non-strided tensor."""
    return f"reducer returned a tensor with unsupported layout {layout}"


def reducer_tensor_dtype(dtype: str) -> str:
    """A custom reducer returned a tensor of a dtype that is not a real number."""
    return f"reducer returned a tensor of unsupported dtype {dtype}"


def reducer_tensor_shape(shape: tuple[int, ...]) -> str:
    """A custom reducer returned a tensor of more than one element."""
    return f"reducer returned a tensor of shape {shape}, expected a scalar"


# How `reducer_modified_input` ends, after the reducer's name: how failed_measurements knows it.
MODIFIED_INPUT_END = " modified its argument in place (it was given a copy: training is unaffected)"


def reducer_modified_input(name: str) -> str:
    """A custom reducer modified the tensor it was given (`name`, the reducer's own, as text
    UTF-8 files hold)."""
    return f"reducer {utf8_text(name)}{MODIFIED_INPUT_END}"


def shared_output(calls: int) -> str:
    """One layer returned the same tensor in several sampled calls: its gradient belongs to none."""
    return (
        f"shared output: the same tensor was returned by {calls} sampled calls of this layer, so "
        "its gradient is the sum over all of them and belongs to no single call"
    )


def record_value(kind: str) -> str:
    """The history writer received a value that is not a number."""
    return f"record error: value of type {kind} is not a number"


def host_values_mismatch(expected: int, got: int) -> str:
    """The host transfer did not return the launched number of values."""
    return f"statistics error: expected {expected} host values, got {got}"


def interrupted(error: BaseException, layer: str | None, call_index: int) -> str:
    """A sampled root forward raised `error`, in `layer` (None: outside the selected layers)."""
    message = " ".join(error_message(error).split()) or "(no message)"
    if len(message) > _MESSAGE_CHARS:
        message = message[: _MESSAGE_CHARS - 3] + "..."
    where = (
        "outside the selected layers"
        if layer is None
        else f"in layer {layer or '<root>'!r} (call {call_index})"
    )
    return f"interrupted: the root forward raised {type(error).__name__}: {message} {where}"


# In the note index.md states when the run was removed while a sampled forward or backward was
# in flight (its state line is decided by `RunState.removed_in_flight`, never by this text).
REMOVED_IN_FLIGHT = "remove_observer was called while a sample was in flight"


def removed_during(phase: str) -> str:
    """The run was removed during a sample's `phase` ("forward" or "backward")."""
    arrived = "layers that returned" if phase == "forward" else "gradients that arrived"
    return (
        f"interrupted: remove_observer was called during this sample's {phase}; the {arrived} "
        "before it have rows, the others have none"
    )


def different_forwards(field: str, values: list[str]) -> str:
    """The ranks' k-th samples are different root forwards: `field` has `values` by rank."""
    return (
        f"the ranks sampled different root forwards ({field} by rank: {', '.join(values)}): "
        "every rank stopped global statistics here, together (from here on a sample is another "
        "root forward on some rank, and a rank ahead would wait for one no other rank takes)"
    )


def not_on_all_ranks(ran: list[int], group: tuple[int, ...]) -> str:
    """A tensor only some ranks of its group produced in a sample: no whole tensor to measure
    (the tensors every rank produced are measured all the same)."""
    return (
        f"not run on every rank of its group (ran on rank {', '.join(map(str, ran))} of "
        f"{', '.join(map(str, group))}): no global statistics for this tensor in this sample; "
        "the tensors every rank ran are measured"
    )


def global_stopped(sample_id: int | None, exc: BaseException) -> str:
    """Global statistics stopped for the rest of the run at `sample_id` (None: at inject, the
    library's process groups could not be created), after `exc`."""
    when = "inject" if sample_id is None else f"sample {sample_id}"
    return (
        f"global statistics stopped at {when}, for the rest of the run: {type(exc).__name__}: "
        f"{error_message(exc)}"
    )


def raised_on_ranks(raised: list[int], ran: list[int], group: tuple[int, ...]) -> str:
    """A tensor the ranks whose sampled forward raised did not produce (the tensors every rank
    produced before the raise are measured all the same)."""
    return (
        f"the root forward raised on rank {', '.join(map(str, raised))}, which did not run this "
        f"tensor (it ran on rank {', '.join(map(str, ran))} of {', '.join(map(str, group))}): "
        "no global statistics for this tensor in this sample; the tensors every rank ran are "
        "measured"
    )


def dropped_at_cap(cap: int) -> str:
    """Part of a sample's rows were kept and part dropped at the memory cap (`rundir.writer`)."""
    return (
        f"interrupted: rows of this sample were dropped at the memory cap (max_buffered_rows={cap}) "
        "while history parts could not be written; its rows in history are real measurements, "
        "the loss ledger counts the dropped ones"
    )


def unwritten_at_removal(signal: str, on_disk: int, rows: int) -> str:
    """At removal, history parts kept failing after `on_disk` of a sample's `rows` rows."""
    return (
        "interrupted: history parts could not be written at removal after part of this "
        f"sample's rows; {on_disk} of its {rows} {signal} rows are in history"
    )


def partly_written(signal: str, on_disk: int, rows: int) -> str:
    """After a crash, only `on_disk` of a sample's `rows` rows of `signal` are in history."""
    return (
        "interrupted: the process ended before this sample's rows were all written; "
        f"{on_disk} of its {rows} {signal} rows are in history"
    )


def explain(reason: str) -> Reason | None:
    """The table entry a reason text belongs to, or None if it is not one of the library's."""
    return next((entry for entry in REASONS if entry.matches(reason)), None)
