"""index.md's notes name layers as its Layers section does: a code span of the name's literal.

Why: an `nn.ModuleDict` key can be any string, and a name holding `*`, `_` or `<x>` written
outside code (`'layers.*a*'`) renders on GitHub as emphasis or as an HTML tag, which it drops.
The warnings that say the same things name layers by `repr`, as every library warning does.
TensorBoard renders a histogram tag's description as Markdown, so it names them as code too.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
from tensorboard.plugin_util import markdown_to_safe_html
from torch import nn

from torchinstruments import EveryNForwardsSampler, HistoryConfig, inject_observer, remove_observer
from torchinstruments.records import LayerInfo, RunInfo
from torchinstruments.rundir.page_layers import layers_line

from _tensorboard_runs import descriptions


class Pair(nn.Module):
    """Returns one tensor twice: the second place is an alias of the first."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # `<b>` is fed the input (no grad), `*a*` is swapped after inject, `_c_` aliases.
        self.layers = nn.ModuleDict({"<b>": nn.ReLU(), "*a*": nn.Linear(3, 3), "_c_": Pair()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers["*a*"](self.layers["<b>"](x))
        first, second = self.layers["_c_"](y)
        return (first + second).sum()


def outside_code(markdown: str) -> str:
    """`markdown` without its fenced blocks and inline code spans (any fence length)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    return re.sub(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.DOTALL)


def test_every_note_names_a_layer_holding_markdown_as_code_and_its_warning_by_repr(
    tmp_path: Path,
) -> None:
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_observer(
            model,
            output_dir=tmp_path / "s",
            sampler=EveryNForwardsSampler(1),
            selector=lambda name, module: name.startswith("layers."),
        )
        model(torch.randn(2, 3)).backward()
        model.double()  # the same layers, another dtype: index.md's dtype note names them
        model(torch.randn(2, 3, dtype=torch.float64)).backward()
        model.layers["*a*"] = nn.Linear(3, 3)  # taken out, and one added in its place
        remove_observer(model)
    said = [str(w.message) for w in caught]
    index = (tmp_path / "s" / "index.md").read_text(encoding="utf-8")
    for note in (
        "no output_gradient rows: `layers.<b>` (nothing before",
        "layer `layers._c_` returned the same tensor at tensor_path `[1]` as at `[0]`",
        "taken out of the model (no rows once they stopped running): `layers.*a*` (Linear)",
        "not observed (no rows): `layers.*a*` (Linear)",
        "`layers.*a*` (Linear): float32 sample 0, float64 sample 1",
    ):
        assert note in index, note
    rest = outside_code(index)
    assert [name for name in ("<b>", "*a*", "_c_") if name in rest] == []
    for warning in (
        "layer 'layers._c_' returned the same tensor at tensor_path '[1]' as at '[0]'",
        "taken out of the model (no rows once they stopped running): 'layers.*a*' (Linear)",
    ):
        assert any(warning in w for w in said), (warning, said)
    # TensorBoard renders a tag's description as Markdown: the names are code there too.
    described = descriptions(tmp_path / "s" / "tensorboard")
    shown = markdown_to_safe_html(described["layers.<b>/call_0/output/tensor"])
    assert "of layer <code>layers.&lt;b&gt;</code> (ReLU)" in shown
    assert (
        "the text tag <code>layers.&lt;b&gt;/call_0/output/tensor (no histogram)/text_summary</code>"
        in shown
    )
    shown = markdown_to_safe_html(described["layers._c_/call_0/output/[0]"])
    assert "of layer <code>layers._c_</code> (Pair), call 0, tensor <code>[0]</code>" in shown
    assert "<em>" not in " ".join(markdown_to_safe_html(text) for text in described.values())


def test_the_layers_line_leaves_github_no_bare_link_in_a_module_type() -> None:
    """A class can be named anything (`type("a@b.co", ...)`): the Run section's list of layers
    writes its module type outside code, where GitHub linked an e-mail address or a URL."""
    layers = (LayerInfo("0", "a@b.co"), LayerInfo("1", "see https://x.y"))
    run = RunInfo(
        output_dir=Path("stats"),
        library_version="0",
        torch_version="0",
        model_class="Net",
        layers=layers,
        focus_layers=(),
        sampler="s",
        metrics=(),
        rank=None,
        world_size=None,
        rank_policy="rank0",
        capture_direct_forwards=True,
        history=HistoryConfig(),
        started_at="0",
    )
    assert layers_line(run) == (
        "selected layers (2, traversal order): `0` (`a@b.co`), `1` (see https\\://x.y)"
    )
    assert "by module type: `a@b.co` 1, see https\\://x.y 1;" in layers_line(run, too_long=True)
