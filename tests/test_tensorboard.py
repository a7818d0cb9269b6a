"""Focus-layer histograms in TensorBoard, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    EventAccumulator,
)
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from torchinstruments import (
    EveryNForwardsSampler,
    TensorBoardSink,
    has_observer,
    inject_observer,
    remove_observer,
)
from torchinstruments.records import histogram_tag
from torchinstruments.sinks.tensorboard import ONE_PER_STEP

from _tensorboard_runs import Reversed, descriptions, histograms


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
        "Histogram of the gradient flowing back into the output of layer `1` (ReLU), call 0. "
        "Only finite entries are counted: NaN and Inf are left out (the history's "
        "nonfinite_fraction counts them), and at a sample where the tensor has no finite entry "
        "there is no histogram; the text tag "
        "`1/call_0/output_gradient/tensor (no histogram)/text_summary` says so at that step. Step: forward_index, the root forward the sample was taken at "
        "(0 at inject_observer; the training step when each step is one root forward)."
    )
    caller = descriptions(tmp_path / "caller")
    assert set(caller) == set(run_events)
    assert caller["0/call_0/output/tensor"].startswith(
        "Histogram of the output of layer `0` (Linear), call 0. Only finite entries are counted"
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
            (f"eval/a/call_0/{signal}/tensor", "`a`"),
            (f"eval%2Fa/call_0/{signal}/tensor", "`eval/a`"),
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
