"""Library warnings name the user's line (the forward, the backward, the removal), not ours.

Each warning is caught with `warnings.catch_warnings(record=True)` and its filename and line are
compared with the line of this file that made the call, found with `inspect`.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.notices import warn
from torchinstruments.registry import add_run_note


def next_line() -> int:
    """The number of the caller's next line."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.unused = nn.Linear(2, 2)  # never called: said at removal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def caught_ours(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    ours = [w for w in caught if str(w.message).startswith("torchinstruments:")]
    where = [(Path(w.filename).name, w.lineno, str(w.message)[:70]) for w in ours]
    assert ours
    assert all(w.filename == __file__ for w in ours), where
    return ours


def test_warnings_point_at_the_users_forward_and_removal(tmp_path: Path) -> None:
    model = WithUnused()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    x = torch.full((1, 2), float("nan"))  # every entry NaN: the focus tensors get no histogram
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward_line = next_line()
        model(x)
        removal_line = next_line()
        remove_observer(model)
    ours = caught_ours(caught)
    forward = [w for w in ours if "output/tensor has no histogram" in str(w.message)]
    assert [w.lineno for w in forward] == [forward_line]
    removal = [w for w in ours if "never ran in a sampled forward" in str(w.message)]
    assert [w.lineno for w in removal] == [removal_line]


def test_a_warning_from_a_gradient_hook_points_at_the_backward(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    out = model(torch.ones(1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward_line = next_line()
        (out.sum() * float("nan")).backward()  # NaN gradients: no histogram
    remove_observer(model)
    ours = caught_ours(caught)
    assert "output_gradient/tensor has no histogram" in str(ours[0].message)
    assert [w.lineno for w in ours] == [backward_line]


def test_a_warning_and_a_note_write_each_character_that_is_not_printable_as_its_escape(
    tmp_path: Path,
) -> None:
    """Whatever a warning or an index.md note quotes raw (a run directory in a trainer
    callback's warning, a note an integration adds) never reaches a terminal or the page as a
    line break or an escape."""
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    assert add_run_note(model, "a note \x1b[2J\nx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("torchinstruments: a\nb\x1b[2J")
    remove_observer(model)
    assert [str(w.message) for w in caught] == [r"torchinstruments: a\nb\x1b[2J"]
    index = (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
    assert "**Note:** a note \\x1b[2J\\nx\n" in index
