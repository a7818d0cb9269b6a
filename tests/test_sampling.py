"""Samplers choose exact forward indices, driven by a fake clock where time matters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchinstruments import (
    EveryNForwardsSampler,
    TimeIntervalSampler,
    inject_observer,
    remove_observer,
)
from torchinstruments.sampling import read_step

from conftest import mlp, read_history


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_n_samples_multiples_of_n() -> None:
    sampler = EveryNForwardsSampler(4)
    assert [i for i in range(17) if sampler.should_sample(i)] == [0, 4, 8, 12, 16]


def test_time_interval_samples_first_then_first_after_each_interval() -> None:
    clock = FakeClock()
    sampler = TimeIntervalSampler(60, clock=clock)
    times = [0, 10, 59.9, 60, 61, 119, 120.5, 500, 500, 559.99, 560]
    sampled = []
    for index, offset in enumerate(times):
        clock.now = 1000.0 + offset
        if sampler.should_sample(index):
            sampled.append(index)
    assert sampled == [0, 3, 6, 7, 10]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True, None])
def test_every_n_rejects_non_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="n must be a positive int"):
        EveryNForwardsSampler(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf")])
def test_time_interval_rejects_non_positive_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="seconds must be a positive finite number"):
        TimeIntervalSampler(bad)


def test_default_sampler_with_fake_clock_through_the_observer(run_dir: Path) -> None:
    clock = FakeClock()
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=TimeIntervalSampler(30, clock=clock))
    for step in range(10):
        clock.now = 1000.0 + 10 * step
        model(torch.randn(2, 8))
    remove_observer(model)
    history = read_history(run_dir)
    assert history["forward_index"].unique().sort().to_list() == [0, 3, 6, 9]
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2, 3]


def test_raising_sampler_means_not_sampled_and_training_goes_on(run_dir: Path) -> None:
    class Broken:
        def should_sample(self, forward_index: int) -> bool:
            raise ZeroDivisionError("oops")

    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=Broken())
    with pytest.warns(RuntimeWarning, match="sampler"):
        model(torch.randn(2, 8))
    model(torch.randn(2, 8))
    remove_observer(model)
    assert read_history(run_dir).height == 0


class Unshowable:
    """An object whose repr raises (a proxy of something gone, a tensor subclass)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class UnshowableSampler(Unshowable):
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def should_sample(self, forward_index: int) -> object:
        if self.answer is None:
            raise ValueError(Unshowable())  # its message is the repr of what it holds
        return self.answer


@pytest.mark.parametrize("answer", [None, Unshowable()], ids=["raises", "answers-no-bool"])
def test_a_sampler_that_cannot_be_shown_in_its_warning_still_leaves_the_step_unsampled(
    run_dir: Path, answer: object
) -> None:
    """The warning quoted the sampler, its error and its answer by their reprs: one that
    raised broke the user's step (the root forward raised the repr's RuntimeError)."""
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=UnshowableSampler(answer))
    with pytest.warns(RuntimeWarning, match=r"sampler <UnshowableSampler \(its repr raised\)>"):
        model(torch.randn(2, 8))
    remove_observer(model)
    assert read_history(run_dir).height == 0


def test_a_step_source_whose_error_cannot_be_shown_gives_a_null_step_and_a_warning() -> None:
    """A trainer's step source that raises an error whose repr raises: the sample's step is
    null and the warning names the error by its type (quoting it raised in the user's step)."""

    def source() -> int:
        raise ValueError(Unshowable())

    said: list[str] = []
    step = read_step(source, 7, lambda key, message: said.append(message))
    assert step is None
    assert said == [
        "reading the step for the step column failed: ValueError(its message could not be read)"
        "; it is null"
    ]


class LongRepr:
    """A sampler whose repr prints its whole schedule."""

    def should_sample(self, forward_index: int) -> bool:
        return True

    def __repr__(self) -> str:
        return "LongRepr(" + "1," * 100_000 + ")"


def test_a_sampler_with_a_huge_repr_is_described_in_a_bounded_line(run_dir: Path) -> None:
    # Its 200,000-character repr was index.md's sampler line: a 250 KB page (bound: 64 KiB).
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=LongRepr())
    model(torch.randn(2, 8))
    remove_observer(model)
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert len(index.encode()) <= 64 * 1024
    line = next(line for line in index.splitlines() if line.startswith("- sampler: "))
    assert line == f"- sampler: {'LongRepr(' + '1,' * 245 + '1'} ... (199,510 more characters cut)"


class LongFailure:
    """A sampler that raises with, or answers, a 200,000-character text."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises

    def should_sample(self, forward_index: int) -> bool:
        if self.raises:
            raise ValueError("e" * 200_000)
        return "n" * 200_000  # type: ignore[return-value]


@pytest.mark.parametrize("raises", [True, False], ids=["raises", "answers"])
def test_a_sampler_failing_with_a_huge_text_is_quoted_in_a_bounded_note(
    run_dir: Path, raises: bool
) -> None:
    # Its error or its answer was quoted whole in the warning and index.md's note: a 250 KB page.
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=LongFailure(raises))
    with pytest.warns(RuntimeWarning, match=r"more characters cut\)"):
        model(torch.randn(2, 8))
    remove_observer(model)
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert len(index.encode()) <= 64 * 1024
    cut = "(199,514 more characters cut)" if raises else "(199,502 more characters cut)"
    assert cut in index


class UnclearSampler:
    """A sampler whose repr and answer hold a line break and a terminal escape."""

    def should_sample(self, forward_index: int) -> object:
        return UnclearSampler()

    def __repr__(self) -> str:
        return "Unclear(\x1b[2J\nx)"


def test_a_sampler_answer_with_unclear_text_is_quoted_on_one_line_in_index_md(
    run_dir: Path,
) -> None:
    # Its repr's line break split index.md's note, and the escape was written raw to it.
    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=UnclearSampler())
    with pytest.warns(RuntimeWarning, match="expected a bool"):
        model(torch.randn(2, 8))
    remove_observer(model)
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "\x1b" not in index
    note = next(line for line in index.splitlines() if "expected a bool" in line)
    said = r"'Unclear(\x1b[2J\nx)'"
    assert note.startswith(f"**Note:** sampler {said} returned {said} (UnclearSampler) for ")


def test_a_clock_giving_nan_is_a_sampler_error_said_in_index_md(run_dir: Path) -> None:
    # Compared with NaN no interval ever passed: one sample, then none, and nothing said.
    model = mlp()
    sampler = TimeIntervalSampler(30, clock=lambda: float("nan"))
    inject_observer(model, output_dir=run_dir, sampler=sampler)
    with pytest.warns(RuntimeWarning, match=r"clock\(\) returned nan, not a finite time"):
        model(torch.randn(2, 8))
    remove_observer(model)
    assert read_history(run_dir).height == 0
    assert "clock() returned nan" in (run_dir / "index.md").read_text(encoding="utf-8")
