"""The parts of index.md that follow from what the run is, never from how far it got.

Design decision: these sections (files, schema, meanings, result.json) depend on `RunInfo` and
the library's own tables only, so they are the same at injection, at removal and after
`finalize`; `rundir.index_page` puts them after the state-dependent sections. The cost: they must
be kept in step with the schema and the summary by hand (the tests check the tables against
`HISTORY_SCHEMA` and `reasons.REASONS`).
"""

from __future__ import annotations

import json

from torchinstruments.reasons import MESSAGE_BOUND, REASONS
from torchinstruments.records import RunInfo
from torchinstruments.rundir.layout import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    LOCK_FILE,
    PARTS_DIR,
    STATE_FILE,
)
from torchinstruments.rundir.shell import json_on_one_line, tool_span

COLUMN_NOTES = {
    "sample_id": "0-based count of sampled root forwards; the x-axis of every trend",
    "forward_index": "0-based count of all root forwards (sampled or not) when the sample was "
    "taken (under a trainer callback: the forwards it observes; see mode below)",
    "timestamp": "UTC time at which the tensor was measured",
    "rank": "torch.distributed rank; null outside torch.distributed",
    "layer": 'qualified module name from named_modules() (root = ""); a lone surrogate in it, '
    "which UTF-8 cannot encode, written as a `\\udcff` escape",
    "module_type": "class name of the module (the model's own under FSDP2's fully_shard)",
    "call_index": "n-th call (from 0) of this layer inside one sampled root forward",
    "signal": '"output" or "output_gradient"',
    "tensor_path": 'where the tensor sits in the output, in Python accessor syntax ("" = bare tensor)',
    "shape": "shape of the measured tensor (under torch.func's vmap: the vmapped sizes first, "
    "then the per-sample shape; for a DTensor: this rank's local shape; null for a nested "
    "tensor, whose components differ in shape, and for a tensor subclass that raised when asked)",
    "dtype": 'torch dtype without the "torch." prefix, e.g. float32; "unknown" for a tensor '
    "subclass that raised when asked (its rows are then null with the error as the reason)",
    "placement": "a DTensor's placements, e.g. Shard(0), Replicate or Partial(sum) (one per mesh "
    "dimension, comma-separated): the row describes this rank's local tensor; null otherwise",
    "mesh_coordinate": "this rank's coordinate in the DTensor's device mesh; null otherwise",
    "step": "the trainer's global step in the Lightning and Hugging Face callbacks (optimizer "
    "steps so far), or the value a plain loop gave with torchinstruments.set_step(model, step); "
    "null otherwise",
    "mode": '"train" or "eval": the layer\'s module.training at that call, and eval for every '
    "row of a root forward called with grad disabled (by the caller: reentrant checkpointing's "
    "no_grad is torch's); under a trainer callback the forward's "
    "phase (a training step's rows are train, an evaluation's eval, whatever a module's flag)",
    "grad_enabled": "torch.is_grad_enabled() during the forward",
    "metric": 'metric name (see Metrics); `"interrupted"` marks a sample whose root forward '
    "raised, whose forward or backward remove_observer cut, or whose rows were only partly "
    "written (value null, the reason says why)",
    "value": "the metric; null only together with unavailable_reason, never silently 0",
    "unavailable_reason": "why value is null; non-null exactly when value is null",
    "population": "which tensor the row describes: null = this rank's own tensor (for a DTensor, "
    "its local shard); `global:ranks=0,1,...` = the whole tensor over those ranks "
    "(inject_observer's global_statistics=: a DTensor's Shard or Partial output, or any output "
    "over the named process group), measured exactly, as if gathered in one place. A series "
    "(layer, call, signal, tensor path) has one population for the whole run; never average "
    "rows of different populations",
    "attempt": "the attempt that recorded the row, from 0: each inject_observer(..., "
    "resume=True) that continues the run (a restarted job, a trainer resumed from a "
    "checkpoint) counts up (see Attempts); null in rows of versions before it",
}

METRIC_NOTES = (
    ("mean", "mean of the finite entries"),
    ("std", "population standard deviation (divide by N, not N-1) of the finite entries"),
    ("min / max", "smallest / largest finite entry"),
    (
        "p25 / p50 / p75",
        "quartiles of the finite entries with linear interpolation (numpy.percentile's default)",
    ),
    ("zero_fraction", "entries equal to 0, divided by the original element count"),
    ("nonfinite_fraction", "NaN and +-inf entries, divided by the original element count"),
)


def quoted(text: str) -> str:
    """A Python string literal (double-quoted) for `text`."""
    return json_on_one_line(json.dumps(text, ensure_ascii=False))  # "\u2028": Python reads it too


def section_files(run: RunInfo) -> list[str]:
    return [
        "## Files",
        "",
        f"- `{PARTS_DIR}/`: Parquet chunks (of buffer_rows rows or fewer, but where said below), each "
        "written atomically "
        "(a temporary in the run directory, then renamed into the folder) while the run is "
        "live, when the buffer holds buffer_rows rows or its oldest row is flush_seconds / 2 "
        "old (then every buffered row at once: a part may hold more than buffer_rows rows "
        f'where chunks wait, so the time bound holds). `pl.read_parquet("{PARTS_DIR}")` works from the first part (the first sample '
        "writes it right after it is taken; before it the folder is empty and the read fails) "
        f"until removal, which merges the parts into {HISTORY_FILE} and then takes the folder "
        "away in one rename: a reader gets every part or an error, never some of them. The "
        f"setup block of the queries below reads {HISTORY_FILE} and the parts it does not hold "
        f"yet, at any moment (while a continued run's attempt runs, {HISTORY_FILE} holds the "
        "earlier attempts and the folder this attempt's rows). A crash (SIGKILL, out of memory) loses at most the rows of the last flush_seconds; "
        "SIGTERM writes them first, then ends the process as before. While part writes fail (a "
        "full disk), at most max_buffered_rows rows wait in memory, newer ones are dropped and "
        "counted in the loss ledger (listed at the top of this page), and the backlog is later written in as "
        "few parts as fit (a part may then hold more than buffer_rows rows). A part write that "
        "does not return (a file system that stopped answering) is waited for at most half a "
        "flush interval by a step (the run's first rows: at most 10 s, once), and a flush "
        "interval (at least 10 s) by removal, which then gives it up: its rows are counted the "
        "same way.",
        f"- `{HISTORY_FILE}`: the whole history, one row per scalar, ordered by sample_id, "
        "then signal (output before output_gradient), then the order the rows were written in "
        "(a forward's layers in the order they returned, a backward's gradients in the order "
        "they arrived).",
        "- `result.json`: one record per selected layer (traversal order); at injection with an "
        "empty `tensors` list, at removal with per-tensor summaries (see result.json).",
        "- `index.md`: this page. `tensorboard/`: histograms of the focus layers' finite "
        "entries (NaN and Inf left out), on step forward_index (the root forward the sample "
        "was taken at: the training step when each step is one forward); a trainer callback "
        "also writes them into the trainer's own TensorBoard logger on its global step (the "
        "`step` column: read against the trainer's scalars as it says), one per "
        "tag and step: the step's first sample (the micro-batches of gradient accumulation and "
        "an evaluation's batches share a step, and TensorBoard's default data server keeps "
        "only the last record at a step; this page's notes count the samples left out there). A "
        "focus tensor with no finite entry, or one that cannot be measured (a complex dtype: its "
        "rows are null with the reason), has no histogram at that step, and a text note "
        "`<tag> (no histogram)/text_summary` there says why (TensorBoard's text plugin adds "
        "`/text_summary` to a text note's tag). A tensor's `<tag>` is "
        "`layer/call_N/signal/tensor_path` (e.g. `fc1/call_0/output/tensor`): a bare tensor's "
        "empty path is written `tensor`, the root's empty name `<root>`, a `%` or `/` in a "
        "layer's name `%25` or `%2F`, and an eval sample's tag begins with `eval/`.",
        f"- `{LOCK_FILE}`: the PID of the process that observed the run (followed by "
        "`torchinstruments finalize` when a finalize took it last), then from byte 64 the "
        "run's id mark: the sample_id and forward_index after every sample begun, written "
        "as each sample starts (no fsync: it survives a killed process, not a power loss), "
        "so that resume=True never uses an id again. The file stays after "
        "the run ends; that process holds an OS lock on it (fcntl.flock, msvcrt.locking on "
        "Windows) only while it lives, so the "
        "file alone does not mean the run is live. `torchinstruments finalize` refuses the "
        "directory while the lock is held.",
        f"- `{STATE_FILE}`: the run's state as JSON: `status`, the run info (`run`), the counts "
        "(`counts`: root_forwards, samples, backward_samples, per layer `layer_samples`, the "
        "run's `notes`, `train_forwards` / `eval_forwards`: the forwards the training "
        "sampler and a trainer callback's record_eval sampler were asked about, and "
        "`unobserved_eval_forwards` / `unobserved_setup_forwards`: the evaluation forwards and "
        "the fit's setup forwards a trainer callback passed through unobserved; null where "
        "unknown; `bypassed_by`: with no root forward seen, what built a module that ran the "
        "model's layers past the observer (accelerate's compile_regions), null for none; with a "
        "grad_scaler, `loss_scales`: each sample's loss scale, one span per change; the "
        "top-level `loss_scales` are those saved while the run went on; after a kill, "
        "`no_grad_samples`: the samples on disk whose forward ran with grad disabled, which "
        "tell a rebuilt 0 of backward_samples known), problems, marked "
        "samples, attempts (each with its counts, its rows, its sampler and how it `ended`: "
        "removed, finished without remove_observer (at its process's exit or when its model was "
        "collected: exact counts, its note says which), killed, or killed during removal: in "
        "remove_observer's last flush; beyond 56 attempts each run of alike ones between the "
        "first 6 and the last 50 is one entry: `last_attempt` its last, its counts summed), "
        "layers whose dtype changed during the run, the loss ledger, and "
        "`removal_step`: the file remove_observer (or the run's finish without it, at the "
        "process's exit or at collection: its note says so) was writing (`history.parts/`: its "
        "last flush), set only while that finish runs (left set, it was killed during it). "
        "This page is written before the state file says the run is finished, and is "
        "rendered from it; `finalize` and the command line read it; the first query below "
        "prints its status and counts.",
        "",
        "If the process died, "
        + tool_span("finalize", run.output_dir)
        + " merges the completed parts and writes result.json "
        "and index.md; counts are then lower bounds (root forwards: at least history's max "
        "forward_index + 1, more where tensorboard/ or the id mark in `.lock` shows later "
        "samples).",
        "",
    ]


def section_schema() -> list[str]:
    lines = ["## history schema (one row per scalar)", "", "| column | type | meaning |"]
    lines.append("| --- | --- | --- |")
    for name, dtype in HISTORY_SCHEMA.items():
        lines.append(f"| {name} | {dtype} | {COLUMN_NOTES[name]} |")
    return [*lines, ""]


def section_meanings() -> list[str]:
    lines = [
        "## Signals, tensor paths, calls",
        "",
        '- signal `"output"`: a tensor returned by the layer\'s forward. '
        '`"output_gradient"`: the gradient of the loss with respect to that output tensor, '
        "recorded when the first backward pass reaches it (same sample_id as its forward). A "
        "later backward pass through the same output is not recorded: a graph kept with "
        "retain_graph=True, or a second loss through one output (a GAN's discriminator and "
        "generator losses through one generated batch, not detached), has the first pass's "
        "gradient only, where a plain tensor hook would see each pass's.",
        '- tensor_path: `""` the output is a bare tensor; `[0]` first element of a tuple or '
        "list; `['logits']` dict key; `.hidden` attribute (dataclass / named tuple / model "
        "output object; torch's own named tuples by field: `.values`, `.indices` of "
        "`torch.max(x, dim)`); `[1]['k']` nested, 16 levels deep. Values that hold no tensor "
        "(None, strings, numbers) are skipped; an object of any other kind (a Cache, a "
        "distribution, a NumPy array) is not entered, so tensors inside it have no rows: a note "
        "names each. A tensor at two paths of one output (`hidden_states[-1]` is "
        "`last_hidden_state`) has rows at the first only: a note names the second. A second "
        "tensor at a path already given (mapping keys whose repr is the same) gets `#1`.",
        "- call_index: the n-th invocation (from 0) of a shared layer inside one sampled root "
        "forward; a layer called 3 times per forward has call_index 0, 1, 2.",
        "- mode: a series is one (layer, call_index, signal, tensor_path, mode, metric). A "
        "tensor's samples taken in eval mode (module.training False; below, the other ways) "
        "are a series of their own, "
        "never one with its train samples: result.json has a tensor entry per mode (`mode`), "
        "`show` and `compare` print eval rows as `name [eval]`, `plot` and `heatmap` draw them "
        "as their own line or row, and TensorBoard has their histograms under `eval/<tag>`. "
        "That holds in a plain loop that calls model.eval() as under a trainer. In a plain "
        "loop a root forward called with grad disabled (torch.no_grad, inference_mode: an "
        "evaluation, each token of `generate()`, which leaves the model in train mode) is an "
        "evaluation forward: all its rows are eval, whatever the modules' flags, and it expects "
        "no gradient; it is on the sampler's one schedule (forward_index) like every root "
        "forward of a plain loop, so a generation between training steps takes samples the "
        "sampler gives it (a sampler that picks training steps counts its tokens too). The trainer "
        "callbacks sample training forwards only: the evaluation forwards inside the fit "
        "(Lightning's sanity check and validation, the Hugging Face Trainer's evaluations) take "
        "no sample and forward_index does not count them "
        "(index.md's notes say how many there were), unless record_eval=True records them, on "
        "their own schedule, as eval series; the forwards of the fit's setup (Lightning's model "
        "summary of example_input_array) are neither, never observed and counted apart; "
        "Lightning's validate, test and predict and the Hugging Face Trainer's evaluate and "
        "predict run after the fit, once the observer is removed: neither observed nor counted.",
        "- step: the trainer's global step (optimizer steps so far) in the Lightning and "
        "Hugging Face callbacks, so the samples of one optimizer step under gradient "
        "accumulation share it; in a plain loop the value last given with "
        "`torchinstruments.set_step(model, step)`; null otherwise. It joins history with a "
        "trainer's own logs (the query below), and `plot --x step` / `heatmap --x step` draw "
        "over it. The trainers log some metrics under another step than the samples of the "
        "forwards that computed them carry, in their TensorBoard too: the Hugging Face "
        "Trainer a training step's loss under the step after it (one more), Lightning a "
        "validation's metrics under the step before it (one less; the same step for one "
        "between the micro-batches of an accumulated step, which a note names); Lightning's "
        "training metrics and the Hugging Face Trainer's evaluations share their samples' step.",
        "- root forward: the outermost call of the observed model, via `model(x)` or "
        "`model.forward(x)`. A call of the model inside its own forward belongs to the "
        "enclosing root forward (not counted again; the next call_index if the model is itself "
        "a selected layer). A selected layer called outside any root forward is not observed. "
        "A call made during a backward pass (activation checkpointing recomputing the model or "
        "a block) is torch's recomputation: neither a root forward nor a call.",
        "- capture_direct_forwards=False: calls that bypass `nn.Module.__call__` "
        "(`module.forward(x)`) are neither root forwards nor measured; the proxy tells them "
        "apart by its caller's frame (`nn.Module._call_impl` or not).",
        "",
        "## Unavailable reasons (value is null)",
        "",
        MESSAGE_BOUND,
        "",
    ]
    lines += [f"- `{reason.template}`: {reason.meaning}" for reason in REASONS]
    lines += [
        "",
        "## Metrics",
        "",
        "The default metrics are computed over the finite entries of the tensor, except "
        "zero_fraction and nonfinite_fraction, which count over all of its entries; in float64 "
        "for integer and bool tensors (beyond 2**53 rounded to the nearest) and in float32 or "
        "better for low-precision floats (float16, bfloat16, float8). A tensor that is not a "
        "plain one is measured as what it stands for: a sparse (or other non-strided) tensor as "
        "the dense tensor, with its shape; a nested tensor over its components' entries, "
        "padding excluded (shape null); a tensor subclass over its entries as the subclass "
        "itself reads them (a wrapper such as TwoTensor through its own ops); a quantized tensor "
        "(a static quantized layer's `quint8` output) as its dequantized values, its `dtype` "
        "the quantized one. Complex and packed dtypes and tensors on the meta device have null rows with a "
        "reason (see Unavailable reasons). A custom reducer computes what it computes from the "
        "copy of the tensor it is given:",
        "",
    ]
    lines += [f"- `{name}`: {meaning}" for name, meaning in METRIC_NOTES]
    lines += [
        "- `interrupted` (reserved): a marker row, value always null; its unavailable_reason "
        "names the exception and the layer that raised it, the removal that cut the sample's "
        "forward or backward, or how much of a sample a crash left on disk (marked samples are "
        "listed near the top of this page).",
        "- other names: custom scalar reducers given at injection.",
        "",
        "## Not collected",
        "",
        "Inputs of layers, parameters and parameter gradients, losses, optimizer updates and "
        "learning rates are not recorded: only layer outputs and the gradients flowing into "
        "them. Unsampled forwards are only counted.",
        "",
    ]
    return lines


def section_result(run: RunInfo) -> list[str]:
    w = run.history.window
    return [
        "## result.json",
        "",
        "`[{layer, module_type, sampled_forwards, tensors: [{call_index, signal, tensor_path, "
        "mode, shape, dtype, observations, first_sample_id, latest_sample_id, previous, recent, "
        "metrics: {name: {valid, first, latest, min, max, previous, recent}}}]}]`, compact: one "
        "layer per line, no indentation. Every selected layer is listed, in traversal order, also "
        "if it never ran (`tensors: []`); tensors are sorted by (call_index, signal, "
        "tensor_path, mode: train before eval); shape and dtype are the latest seen, and a "
        "tensor that had more than one dtype over the run (a model cast mid-run) also has "
        "`dtypes`: each dtype with its first_sample_id and last_sample_id, earliest first. A tensor "
        "sampled in train and in eval mode has one entry per mode: every figure of an entry "
        "(windows, min / max, first / latest) is over that mode's samples only. A DTensor's entry also has its latest "
        "placement and mesh_coordinate.",
        "",
        "- sampled_forwards: in how many sampled forwards the layer was called (0: it never ran "
        "in one; null in the catalog written at injection). After an interrupted run it is "
        "rebuilt from history: the sampled forwards with an output row of the layer (a lower "
        "bound); null (unknown, never 0) for a layer with no output row on disk, which may have "
        "run in samples the end of the process lost (every layer when no output row reached "
        "the disk, even where TensorBoard events prove samples).",
        "- Which samples (per tensor, since every metric of a tensor is measured in the same "
        "samples): observations (history rows of each of its metrics), first_sample_id / "
        "latest_sample_id (its earliest / latest observation), and for each window `actual` "
        f"(samples in it, fewer than {w} early on), `first_sample_id`, `last_sample_id`. A "
        "metric whose own values of these differ (only when history lost rows, e.g. an "
        "unreadable part) repeats them in its entry, and its values win.",
        "- Per metric: valid (observations with a non-null value); first / latest: the value of "
        "the earliest / latest observation (null: see unavailable_reason in history).",
        "- min / max: `{value, sample_id}` of the smallest / largest finite value, earliest "
        "sample on ties; when no value is valid, both fields are null "
        '(`{"value": null, "sample_id": null}`).',
        f"- windows: over the tensor's own samples (sample_ids where it was observed), "
        f"newest first: `recent` = the latest {w}, `previous` = the {w} before them. Per "
        "metric each has `mean` (mean of its finite values, null if none) and `valid` "
        "(non-null values).",
        "- A window mean averages per-sample statistics (e.g. the mean of 10 per-sample stds); "
        "it is not the statistic of the pooled elements of those samples.",
        "",
    ]


__all__ = [
    "COLUMN_NOTES",
    "METRIC_NOTES",
    "quoted",
    "section_files",
    "section_meanings",
    "section_result",
    "section_schema",
]
