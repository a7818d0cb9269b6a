"""Focus-layer histograms in TensorBoard, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    EventAccumulator,
)
from tensorboard.backend.event_processing.plugin_event_accumulator import (
    EventAccumulator as PluginEventAccumulator,
)
from tensorboard.compat.proto.event_pb2 import Event  # type: ignore[attr-defined]
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    PyRecordReader_New,
    masked_crc32c,
)
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from torchinstruments import (
    DefaultStatistics,
    EveryNForwardsSampler,
    TensorBoardSink,
    has_observer,
    inject_observer,
    remove_observer,
)
from torchinstruments.events import Crc32c, EventFile
from torchinstruments.records import histogram_tag
from torchinstruments.sinks.tensorboard import ONE_PER_STEP

from conftest import read_history

CHECKSUM = Crc32c()  # built once: its table takes a few milliseconds


def histograms(log_dir: Path) -> dict[str, list]:
    """Every histogram tag in `log_dir` with its events, as TensorBoard reads them."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0})
    accumulator.Reload()
    tags: dict[str, Any] = accumulator.Tags()
    return {tag: accumulator.Histograms(tag) for tag in tags["histograms"]}


class Reversed(nn.Module):
    """Ten leaves, executed in the reverse of their traversal order."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = torch.tanh(block(x))
        return x


def test_default_focus_is_first_eight_layers_in_traversal_order(run_dir: Path) -> None:
    model = Reversed()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
    remove_observer(model)
    found = histograms(run_dir / "tensorboard")
    expected = {
        f"blocks.{i}/call_0/{signal}/tensor"
        for i in range(8)
        for signal in ("output", "output_gradient")
    }
    assert set(found) == expected
    for tag, events in found.items():
        assert [event.step for event in events] == [0, 1, 2], tag
        for event in events:
            assert sum(event.histogram_value.bucket) == 20  # 5 x 4 finite entries


def test_bucket_counts_sum_to_finite_entries_and_match_min_max(run_dir: Path) -> None:
    class WithNaN(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y[0, 0] = float("nan")
            y[1, 1] = float("inf")
            return y

    x = torch.randn(6, 5)
    model = nn.Sequential(WithNaN())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(x)
    remove_observer(model)
    (events,) = histograms(run_dir / "tensorboard").values()
    value = events[0].histogram_value
    finite = x.clone()
    finite[0, 0] = float("nan")
    finite[1, 1] = float("inf")
    finite = finite[torch.isfinite(finite)]
    assert sum(value.bucket) == finite.numel() == 28
    assert value.min == pytest.approx(finite.min().item())
    assert value.max == pytest.approx(finite.max().item())
    assert value.num == 28


def test_shared_calls_and_tuple_outputs_get_separate_tags(run_dir: Path) -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x[:, :2], x[:, 2:]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.split = Split()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.split(self.lin(self.lin(x)))
            return a.sum() + b.sum()

    model = Model()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4)).backward()
    remove_observer(model)
    assert set(histograms(run_dir / "tensorboard")) == {
        "lin/call_0/output/tensor",
        "lin/call_1/output/tensor",
        "split/call_0/output/[0]",
        "split/call_0/output/[1]",
        "lin/call_0/output_gradient/tensor",
        "lin/call_1/output_gradient/tensor",
        "split/call_0/output_gradient/[0]",
        "split/call_0/output_gradient/[1]",
    }


def test_histogram_selector_and_limit_choose_focus_modules(run_dir: Path) -> None:
    model = Reversed()
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        histogram_selector=lambda name, module: name.endswith(("3", "5", "7")),
        max_histogram_modules=2,
    )
    model(torch.randn(2, 4))
    remove_observer(model)
    assert set(histograms(run_dir / "tensorboard")) == {
        "blocks.3/call_0/output/tensor",
        "blocks.5/call_0/output/tensor",
    }


def test_histogram_selector_matching_nothing_raises_and_leaves_model_untouched(
    run_dir: Path,
) -> None:
    model = Reversed()
    with pytest.raises(ValueError, match="histogram_selector matched no observed layer"):
        inject_observer(model, output_dir=run_dir, histogram_selector=lambda n, m: False)
    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not run_dir.exists()


def test_tensorboard_sink_writes_into_the_callers_writer_and_leaves_it_open(
    run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[TensorBoardSink(writer)]
    )
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.add_scalar("caller/after_removal", 1.0, 0)
    writer.close()
    caller = histograms(tmp_path / "caller")
    assert "0/call_0/output/tensor" in caller
    assert "1/call_0/output_gradient/tensor" in caller
    scalars = EventAccumulator(str(tmp_path / "caller"))
    scalars.Reload()
    tags: dict[str, Any] = scalars.Tags()
    assert "caller/after_removal" in tags["scalars"]
    assert set(histograms(run_dir / "tensorboard")) == set(caller)
    assert read_history(run_dir).height > 0
    assert (run_dir / "result.json").exists()
    assert (run_dir / "index.md").exists()


def test_tensorboard_sink_accepts_a_lightning_logger(run_dir: Path, tmp_path: Path) -> None:
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    logger = loggers.TensorBoardLogger(save_dir=str(tmp_path), name="lightning", version=0)
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[TensorBoardSink(logger)]
    )
    model(torch.randn(2, 3))
    remove_observer(model)
    logger.experiment.add_scalar("still/usable", 2.0, 0)
    logger.finalize("success")
    assert "0/call_0/output/tensor" in histograms(Path(logger.log_dir))


def test_tensorboard_sink_rejects_objects_that_are_not_writers() -> None:
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardSink(object())


def test_events_are_readable_while_the_run_is_live(run_dir: Path) -> None:
    """An interrupted run keeps readable events: they reach the file long before removal."""
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    try:
        model(torch.randn(2, 3))
        deadline = time.monotonic() + 30
        found: dict[str, list] = {}
        while time.monotonic() < deadline and not found:
            time.sleep(0.2)
            found = histograms(run_dir / "tensorboard")
        assert "0/call_0/output/tensor" in found
    finally:
        remove_observer(model)


def test_tensorboard_sink_puts_histograms_on_the_callers_step(
    run_dir: Path, tmp_path: Path
) -> None:
    """`step=` replaces forward_index: forward and backward histograms land on the caller's step."""
    writer = SummaryWriter(str(tmp_path / "caller"))
    trainer_step = [0]
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(3),
        sinks=[TensorBoardSink(writer, step=lambda: trainer_step[0])],
    )
    for step in range(7):  # sampled: steps 0, 3, 6 (sample_ids 0, 1, 2)
        trainer_step[0] = 100 + step
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    caller = histograms(tmp_path / "caller")
    for tag in ("0/call_0/output/tensor", "0/call_0/output_gradient/tensor"):
        assert [event.step for event in caller[tag]] == [100, 103, 106], tag
        # the run directory's own events are on forward_index
        assert [event.step for event in histograms(run_dir / "tensorboard")[tag]] == [0, 3, 6]


@pytest.mark.parametrize(
    "make_step", [np.int64, lambda n: torch.tensor(n)], ids=["numpy int", "0-d int tensor"]
)
def test_tensorboard_sink_takes_the_integers_set_step_takes(
    make_step: Any, run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    trainer_step = [0]
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(2),
        sinks=[TensorBoardSink(writer, step=lambda: make_step(trainer_step[0]))],
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # the sink is never detached
        for step in range(4):
            trainer_step[0] = 50 + step
            model(torch.randn(2, 3)).sum().backward()
    assert not said, [str(w.message) for w in said]
    remove_observer(model)
    writer.close()
    caller = histograms(tmp_path / "caller")
    for tag in ("0/call_0/output/tensor", "0/call_0/output_gradient/tensor"):
        assert [event.step for event in caller[tag]] == [50, 52], tag


def test_tensorboard_sink_step_must_be_callable_and_return_an_int(
    run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    with pytest.raises(TypeError, match="step must be a zero-argument callable"):
        TensorBoardSink(writer, step=5)  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        sinks=[TensorBoardSink(writer, step=lambda: "7")],  # type: ignore[arg-type, return-value]
    )
    with pytest.warns(RuntimeWarning, match=r"step\(\) returned '7' \(str\), expected an integer"):
        model(torch.randn(2, 3))
    model(torch.randn(2, 3))  # the sink is detached; training and the run go on
    remove_observer(model)
    writer.close()
    assert histograms(tmp_path / "caller") == {}
    assert read_history(run_dir)["sample_id"].unique().to_list() == [0, 1]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000))
def test_checksum_equals_tensorboards_own(data: bytes) -> None:
    assert CHECKSUM.masked(data) == masked_crc32c(data)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 1020, 1023, 1024, 1025, 1027, 1028, 2048, 4099])
def test_checksum_equals_tensorboards_own_around_block_ends(size: int) -> None:
    data = bytes((index * 131 + 7) % 256 for index in range(size))
    assert CHECKSUM.masked(data) == masked_crc32c(data)


def records(path: Path) -> list[Event]:
    """Every record of one event file, each checked against its checksums by TensorBoard."""
    reader = PyRecordReader_New(str(path).encode())
    out = []
    while True:
        try:
            reader.GetNext()  # raises DataLossError on a checksum mismatch
        except errors.OutOfRangeError:
            return out
        out.append(Event.FromString(reader.record()))


def test_run_events_pass_tensorboards_checksums_one_event_per_record(run_dir: Path) -> None:
    model = Reversed()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
    remove_observer(model)
    (path,) = (run_dir / "tensorboard").iterdir()
    events = [event for event in records(path) if event.HasField("summary")]
    # per step, one event for the forward and one for the backward, 8 focus layers each
    assert [event.step for event in events] == [0, 0, 1, 1, 2, 2]
    for event in events:
        assert len(event.summary.value) == 8
        assert all(value.HasField("histo") for value in event.summary.value)


def test_event_file_takes_over_tensorboards_checksum(tmp_path: Path) -> None:
    """Pins the hand-over (private TensorBoard names): a TensorBoard upgrade that breaks it fails
    here instead of silently going back to the slow pure-Python checksum."""
    events = EventFile(str(tmp_path), flush_seconds=1.0)
    events.close()
    assert events.fast_checksum
    (path,) = tmp_path.iterdir()
    assert records(path)[0].file_version == "brain.Event:2"


def descriptions(log_dir: Path) -> dict[str, str]:
    """Each tag's description as TensorBoard's UI reads it (the plugin accumulator)."""
    accumulator = PluginEventAccumulator(str(log_dir))
    accumulator.Reload()
    tags = cast(dict[str, Any], accumulator.Tags())["tensors"]
    return {tag: accumulator.SummaryMetadata(tag).summary_description for tag in tags}


def test_each_tag_says_what_it_shows_and_the_step_axis_is_forward_index(
    run_dir: Path, tmp_path: Path
) -> None:
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(2),
        sinks=[TensorBoardSink(writer, step=lambda: 40, step_name="the trainer's global_step")],
    )
    for _ in range(2):  # sample 0, then an unsampled forward
        model(torch.randn(2, 3)).sum().backward()
    with pytest.warns(RuntimeWarning, match="sample 1 shares step 40 with an earlier sample"):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    run_events = histograms(run_dir / "tensorboard")
    assert [e.step for e in run_events["1/call_0/output_gradient/tensor"]] == [0, 2]
    # both samples are at step 40 in the caller's logger: the first one only
    assert [e.step for e in histograms(tmp_path / "caller")["0/call_0/output/tensor"]] == [40]
    assert descriptions(run_dir / "tensorboard")["1/call_0/output_gradient/tensor"] == (
        "Histogram of the gradient flowing back into the output of layer '1' (ReLU), call 0. "
        "Only finite entries are counted: NaN and Inf are left out (the history's "
        "nonfinite_fraction counts them), and at a sample where the tensor has no finite entry "
        "there is no histogram; the text tag '1/call_0/output_gradient/tensor (no histogram)' "
        "says so at that step. Step: forward_index, the root forward the sample was taken at "
        "(0 at inject_observer; the training step when each step is one root forward)."
    )
    caller = descriptions(tmp_path / "caller")
    assert set(caller) == set(run_events)
    assert caller["0/call_0/output/tensor"].startswith(
        "Histogram of the output of layer '0' (Linear), call 0. Only finite entries are counted"
    )
    assert caller["0/call_0/output/tensor"].endswith(
        f"Step: the trainer's global_step. {ONE_PER_STEP}"
    )
    index = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    assert (
        "1 sample shared a step with an earlier sample (gradient accumulation's micro-batches, "
        "an evaluation's batches), so the TensorBoard logger of TensorBoardSink(step=...) holds "
        "no histogram of it"
    ) in index


def test_samples_left_out_of_the_callers_step_are_each_counted_once_in_index_md(
    run_dir: Path, tmp_path: Path
) -> None:
    """A plain loop's TensorBoardSink on a step that never moves: every sample after the first
    is left out of the caller's logger, counted once (its forward and backward records both
    arrive), however many there are, and index.md says how many."""
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    sink = TensorBoardSink(writer, step=lambda: 7)
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[sink])
    model(torch.randn(2, 3)).sum().backward()  # sample 0: the step's first
    with pytest.warns(RuntimeWarning, match="sample 1 shares step 7 with an earlier sample"):
        model(torch.randn(2, 3)).sum().backward()
    for _ in range(148):  # said once: no more warnings
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    assert sink.shared_step_samples == 149
    assert [e.step for e in histograms(tmp_path / "caller")["0/call_0/output/tensor"]] == [7]
    index = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    assert "149 samples shared a step with an earlier sample" in index
    assert index.count("shared a step with an earlier sample") == 1


def test_a_tensor_without_finite_entries_is_said_to_have_no_histogram(
    run_dir: Path, tmp_path: Path
) -> None:
    class Poisoned(nn.Module):
        """All NaN from the second call on."""

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x * float("nan") if self.calls > 1 else x * 1.0

    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), Poisoned())
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[TensorBoardSink(writer)]
    )
    model(torch.randn(2, 3))
    with pytest.warns(RuntimeWarning, match=r"focus tensor 1/call_0/output/tensor has no histog"):
        model(torch.randn(2, 3))
    model(torch.randn(2, 3))  # warned once: the later steps are counted in index.md
    remove_observer(model)
    writer.close()
    tag = "1/call_0/output/tensor"
    assert [e.step for e in histograms(run_dir / "tensorboard")[tag]] == [0]
    for log_dir in (run_dir / "tensorboard", tmp_path / "caller"):
        accumulator = PluginEventAccumulator(str(log_dir))
        accumulator.Reload()
        notes = accumulator.Tensors(f"{tag} (no histogram)/text_summary")
        assert [n.step for n in notes] == [1, 2]
        assert notes[0].tensor_proto.string_val[0].decode() == (
            "No histogram at step 1: every entry is NaN or Inf (nonfinite_fraction 1). The "
            "history holds this sample's rows."
        )
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert (
        "2 focus-tensor histograms are missing from tensorboard/ because the tensor had no "
        f"finite entry to count or could not be measured (first: {tag} at forward_index 1: "
        "every entry is NaN or Inf"
    ) in index


def test_a_custom_reducers_failure_is_never_given_as_why_a_histogram_is_missing(
    run_dir: Path,
) -> None:
    """With custom reducers only, a NaN tensor's rows hold only the reducers' reasons; those say
    what went wrong with a reducer, not why the tensor has no histogram."""

    def zeroes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(0).sum()  # in place: null, with a reason naming this reducer

    model = nn.Sequential(nn.Identity())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        reducers=[DefaultStatistics(()), zeroes],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.full((2, 3), float("nan")))
    remove_observer(model)
    (said,) = [str(w.message) for w in caught if "has no histogram" in str(w.message)]
    assert "reducer zeroes" not in said
    assert "it has no finite entry to count, or measuring it failed" in said
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "0/call_0/output/tensor at forward_index 0: it has no finite entry" in index


def test_a_complex_focus_tensor_is_not_said_to_lack_finite_entries(run_dir: Path) -> None:
    """A complex output has finite entries but cannot be measured: index.md's note on missing
    histograms must not give "no finite entry" as the only cause."""

    class Complex(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.complex(x, x)

    model = nn.Sequential(Complex())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="unsupported dtype complex64"):
        model(torch.randn(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layer's missing gradient rows are warned too
        remove_observer(model)
    index = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    assert "because the tensor had no finite entry to count (first:" not in index
    assert (
        "because the tensor had no finite entry to count or could not be measured (first: "
        "0/call_0/output/tensor at forward_index 0: unsupported dtype complex64)"
    ) in index


def test_tensorboards_reader_reads_every_histogram_without_a_warning(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each tag's metadata names the histograms plugin (as `SummaryWriter.add_histogram`'s do):
    a description alone made EventAccumulator warn "oddly not associated with a plugin"."""
    writer = SummaryWriter(str(tmp_path / "caller"))
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        sinks=[TensorBoardSink(writer)],
    )
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    writer.close()
    for log_dir in (run_dir / "tensorboard", tmp_path / "caller"):
        caplog.clear()
        with caplog.at_level("DEBUG"):
            events = EventAccumulator(str(log_dir), size_guidance={HISTOGRAMS: 0}).Reload()
        tags = cast(dict[str, list[str]], events.Tags())["histograms"]
        assert len(tags) == 4  # two layers, output and gradient
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
        for tag in tags:
            assert events.SummaryMetadata(tag).plugin_data.plugin_name == "histograms", tag
            assert len(events.Histograms(tag)) == 2


class SlashNames(nn.Module):
    """A layer `a` run in eval mode beside a layer named `eval/a` run in train mode: their
    tags met before names were encoded."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.add_module("eval/a", nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) + self.get_submodule("eval/a")(x * 10)).sum()


def test_a_layer_name_with_a_slash_never_shares_a_tag(run_dir: Path) -> None:
    """Each tensor keeps its own tag, one event per step, and its description names the real
    layer; the ordinary name's tag is unchanged."""
    torch.manual_seed(0)
    model = SlashNames()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    model.a.eval()
    for _ in range(3):
        model(torch.randn(2, 3)).backward()
    remove_observer(model)
    found = histograms(run_dir / "tensorboard")
    said = descriptions(run_dir / "tensorboard")
    for signal in ("output", "output_gradient"):
        for tag, layer in (
            (f"eval/a/call_0/{signal}/tensor", "'a'"),
            (f"eval%2Fa/call_0/{signal}/tensor", "'eval/a'"),
        ):
            assert [e.step for e in found[tag]] == [0, 1, 2], tag
            assert f"layer {layer} (Linear)" in said[tag]
    assert len(found) == 4


def test_tags_are_one_per_tensor_for_any_layer_name() -> None:
    """Names that held `/`, `%` or spelled the root's `<root>` used to share tags with others;
    a name without them keeps the tag it always had."""
    names = ("", "<root>", "a", "a/b", "a%2Fb", "a%b", "eval/a", "eval", "call_0/output")
    tensors = [
        (name, call, signal, path, mode)
        for name in names
        for call in (0, 1)
        for signal in ("output", "output_gradient")
        for path in ("", "[0]", "['x/y']")
        for mode in ("train", "eval")
    ]
    tags = [histogram_tag(*t) for t in tensors]
    assert len(set(tags)) == len(tensors)
    assert histogram_tag("blocks.0.attn", 1, "output", "[0]") == "blocks.0.attn/call_1/output/[0]"
    assert histogram_tag("", 0, "output_gradient", "", "eval") == (
        "eval/<root>/call_0/output_gradient/tensor"
    )
