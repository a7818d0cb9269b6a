"""Focus tensors without a histogram: each said with its true reason (no finite entries), never
with a reason that is not why (a custom reducer's failure, a complex tensor)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from tensorboard.backend.event_processing.plugin_event_accumulator import (
    EventAccumulator as PluginEventAccumulator,
)
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from torchinstruments import (
    DefaultStatistics,
    EveryNForwardsSampler,
    TensorBoardSink,
    inject_observer,
    remove_observer,
)

from _tensorboard_runs import histograms


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
    with pytest.warns(
        RuntimeWarning, match=r"focus tensor 1/call_0/output/tensor has no histog"
    ) as w:
        model(torch.randn(2, 3))
    model(torch.randn(2, 3))  # warned once: the later steps are counted in index.md
    remove_observer(model)
    writer.close()
    tag = "1/call_0/output/tensor"
    assert [e.step for e in histograms(run_dir / "tensorboard")[tag]] == [0]
    for log_dir in (run_dir / "tensorboard", tmp_path / "caller"):
        accumulator = PluginEventAccumulator(str(log_dir))
        accumulator.Reload()
        note_tag = f"{tag} (no histogram)/text_summary"  # the text plugin adds /text_summary
        tags = accumulator.Tags()["tensors"]
        assert isinstance(tags, list)
        assert [t for t in tags if "no histogram" in t] == [note_tag]
        notes = accumulator.Tensors(note_tag)
        assert [n.step for n in notes] == [1, 2]
        assert notes[0].tensor_proto.string_val[0].decode() == (
            "No histogram at step 1: every entry is NaN or Inf (nonfinite_fraction 1). The "
            "history holds this sample's rows."
        )
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert (
        "2 focus-tensor histograms are missing from tensorboard/ because the tensor had no "
        f"finite entry to count or could not be measured (first: `{tag}` at forward_index 1: "
        "`every entry is NaN or Inf"
    ) in index
    # every text that sends a reader to the note names the tag the event file holds, and the
    # page says how a tensor's tag is made
    page = " ".join(index.split())
    assert "A tensor's `<tag>` is `layer/call_N/signal/tensor_path` (e.g." in page
    assert "a bare tensor's empty path is written `tensor`" in page
    assert "shows a text note `<tag> (no histogram)/text_summary` at each such step" in index
    assert "a text note `<tag> (no histogram)/text_summary` there says why" in " ".join(
        index.split()
    )
    said = " ".join(str(x.message) for x in w)
    assert f"a text note '{tag} (no histogram)/text_summary' at each such step" in said


def test_a_custom_reducers_failure_is_never_given_as_why_a_histogram_is_missing(
    run_dir: Path,
) -> None:
    """With custom reducers only, a NaN tensor's rows hold only the reducers' reasons; those say
    what went wrong with a reducer, not why the tensor has no histogram. The layer's name holds a
    line break: the tag is quoted as its literal, never as a backslash and an `n`."""

    def zeroes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(0).sum()  # in place: null, with a reason naming this reducer

    model = nn.Sequential()
    model.add_module("a\nb", nn.Identity())
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
    assert said.startswith("torchinstruments: focus tensor 'a\\nb/call_0/output/tensor' has no")
    assert "a text note 'a\\nb/call_0/output/tensor (no histogram)/text_summary' at each" in said
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "`'a\\nb/call_0/output/tensor'` at forward_index 0: `it has no finite entry" in index


def test_a_complex_focus_tensor_is_not_said_to_lack_finite_entries_and_a_quantized_one_is_measured(
    run_dir: Path,
) -> None:
    """A complex output has finite entries but cannot be measured: index.md's note on missing
    histograms must not give "no finite entry" as the only cause, nor its description of
    tensorboard/. A quantized one (a static quantized layer's `quint8`) is measured as the reals
    it stands for (`dequantize()`), its histogram too."""

    class Complex(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.complex(x, x)

    class Quantized(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.quantize_per_tensor(x.real, 0.1, 10, torch.quint8)

    model = nn.Sequential(Complex(), Quantized())
    seen: list[np.ndarray] = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out.dequantize().numpy()))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1))
    with pytest.warns(RuntimeWarning, match="unsupported dtype complex64"):
        model(torch.randn(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layer's missing gradient rows are warned too
        remove_observer(model)
    index = " ".join((run_dir / "index.md").read_text(encoding="utf-8").split())
    assert "because the tensor had no finite entry to count (first:" not in index
    assert (
        "1 focus-tensor histogram is missing from tensorboard/ because the tensor had no "
        "finite entry to count or could not be measured (first: "
        "`0/call_0/output/tensor` at forward_index 0: `unsupported dtype complex64`)"
    ) in index
    assert (
        "A focus tensor with no finite entry, or one that cannot be measured (a complex dtype"
    ) in index
    rows = pl.read_parquet(run_dir / "history.parquet").filter(layer="1", signal="output")
    values = seen[0].astype(np.float64).reshape(-1)
    assert rows["dtype"].unique().to_list() == ["quint8"]
    assert dict(zip(rows["metric"], rows["value"], strict=True)) == {
        "mean": pytest.approx(values.mean(), rel=1e-12),
        "std": pytest.approx(values.std(), rel=1e-12),
        "min": values.min(),
        "max": values.max(),
        "p25": pytest.approx(np.percentile(values, 25), rel=1e-12),
        "p50": pytest.approx(np.percentile(values, 50), rel=1e-12),
        "p75": pytest.approx(np.percentile(values, 75), rel=1e-12),
        "zero_fraction": float((values == 0).mean()),
        "nonfinite_fraction": 0.0,
    }
    assert list(histograms(run_dir / "tensorboard")) == ["1/call_0/output/tensor"]
