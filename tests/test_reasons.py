"""Every unavailable reason the code can emit is explained in index.md, from one table."""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

import torchinstruments
from torchinstruments import EveryNForwardsSampler, inject_observer, reasons, remove_observer
from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import LayerInfo, RunInfo
from torchinstruments.rundir.index_page import render_index
from torchinstruments.rundir.state import RunState

from conftest import page_prose, run_status

SOURCE = Path(torchinstruments.__file__).parent


def every_builder_output() -> list[str]:
    """One reason from each constant and builder in `reasons`, with made-up arguments."""
    made = [reasons.EMPTY, reasons.NO_FINITE, reasons.NON_FINITE_RESULT, reasons.NO_VALUE]
    made += [reasons.META_DEVICE, reasons.FAKE_TENSOR]
    made += [str(reasons.without_values(meta, not meta)) for meta in (True, False)]
    made += [reasons.RECORD_NO_VALUE, reasons.record_value("str")]
    made += [
        reasons.unsupported_dtype("complex64"),
        reasons.unsupported_dtype("float4_e2m1fn_x2"),
        reasons.unsupported_layout("torch.sparse_coo"),
        reasons.partial_placement("Partial(sum)"),
        reasons.error("reducer", ValueError("bad: input")),
        reasons.error("statistics", RuntimeError("x")),
        reasons.error("measurement", TypeError("y")),
        reasons.reducer_returned("list"),
        reasons.reducer_value("str", "abs_max"),
        reasons.reducer_left_out("gone"),
        reasons.reducer_tensor_layout("torch.sparse_coo"),
        reasons.reducer_tensor_dtype("complex64"),
        reasons.reducer_tensor_shape((2, 3)),
        reasons.host_values_mismatch(7, 3),
        reasons.reducer_modified_input("Doubling"),
        reasons.shared_output(2),
        reasons.interrupted(ValueError("bad\ninput"), "blocks.1", 2),
        reasons.interrupted(KeyboardInterrupt(), None, 0),
        reasons.partly_written("output", 3, 9),
        reasons.unwritten_at_removal("output_gradient", 3, 9),
        reasons.dropped_at_cap(65536),
        reasons.removed_during("forward"),
        reasons.removed_during("backward"),
        reasons.raised_on_ranks([3], [0, 1, 2], (0, 1, 2, 3)),
        reasons.different_forwards("step", ["2", "none"]),
        reasons.global_stopped(4, RuntimeError("Timed out waiting 60000ms")),
        reasons.global_stopped(None, RuntimeError("connect failed")),
        reasons.EMPTY_GLOBAL,
        reasons.NOT_GLOBAL_CUSTOM,
        reasons.not_on_all_ranks([0], (0, 1)),
    ]
    return made


def test_every_builder_is_exercised_here() -> None:
    builders = {
        name
        for name, value in vars(reasons).items()
        if inspect.isfunction(value)
        and value.__module__ == reasons.__name__
        and not name.startswith("_")  # a private helper of builders builds no reason
    }
    source = inspect.getsource(every_builder_output)
    # explain reads a reason; utf8_text makes any text (a reason, a note) fit UTF-8 files, and
    # cut_message bounds an error's message in one, which error_message reads
    assert {name for name in builders if f"reasons.{name}(" not in source} == {
        "cut_message",
        "error_message",
        "explain",
        "utf8_text",
    }


@pytest.mark.parametrize("reason", every_builder_output())
def test_each_reason_matches_exactly_one_template(reason: str) -> None:
    matching = [entry.template for entry in reasons.REASONS if entry.matches(reason)]
    assert len(matching) == 1, (reason, matching)


def test_index_page_explains_every_template() -> None:
    run = RunInfo(
        Path("/tmp/run"), "0", "0", "Net", (LayerInfo("a", "Linear"),), (), "s", ("mean",),
        None, None, "rank0", True, HistoryConfig(buffer_rows=10, window=3), "now",
    )  # fmt: skip
    page = render_index(RunState(run))
    assert reasons.MESSAGE_BOUND in page  # how long a quoted message can be
    assert "at most its first 1,000 characters" in reasons.MESSAGE_BOUND
    for entry in reasons.REASONS:
        assert f"- `{entry.template}`: {entry.meaning}" in page


def test_a_reducers_own_nonfinite_value_is_the_reason_that_names_reducers(
    tmp_path: Path,
) -> None:
    """`non-finite result` is also what a custom reducer's NaN or Inf is stored as, so its
    explanation must not be only about an overflowing statistic."""

    def undefined(tensor: torch.Tensor) -> float:
        return float("nan")

    model = nn.Linear(2, 2)
    inject_observer(
        model, output_dir=tmp_path, sampler=EveryNForwardsSampler(1), reducers=[undefined]
    )
    model(torch.ones(1, 2))
    remove_observer(model)
    row = pl.read_parquet(tmp_path / "history.parquet").filter(pl.col("metric") == "undefined")
    (reason,) = row["unavailable_reason"].to_list()
    (entry,) = [e for e in reasons.REASONS if e.matches(reason)]
    assert "a custom reducer returned NaN or +-inf" in entry.meaning


def test_measurement_code_writes_no_reason_literal() -> None:
    """Reasons come from `reasons` builders only: no MetricValue(None, "<literal>") elsewhere."""
    offenders = []
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "MetricValue"
                and len(node.args) == 2
                and isinstance(node.args[1], ast.Constant | ast.JoinedStr)
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_a_huge_error_message_is_cut_to_its_beginning_with_the_count_of_what_was_cut() -> None:
    """A reason is copied into every row it explains: a 10 MB message put 10 MB in each."""
    kept = "x" * reasons.MESSAGE_KEPT
    huge = ValueError(kept + "y" * 10_000_000)
    assert reasons.error("reducer", huge) == (
        f"reducer error: ValueError: {kept} ... (10,000,000 more characters cut)"
    )
    stopped = reasons.global_stopped(3, RuntimeError(kept + "z"))
    assert stopped.endswith(f"RuntimeError: {kept} ... (1 more character cut)")
    assert reasons.error("statistics", ValueError(kept)) == f"statistics error: ValueError: {kept}"
    assert reasons.explain(reasons.error("reducer", huge)) is reasons.explain(
        reasons.error("reducer", ValueError("short"))
    )


def test_explain_refuses_foreign_text() -> None:
    assert reasons.explain("something the library never says") is None
    assert reasons.explain("empty tensor") == reasons.REASONS[0]


def test_error_messages_holding_bytes_that_are_not_utf8_keep_the_run_complete(
    tmp_path: Path,
) -> None:
    """An error about an undecodable file name carries a lone surrogate (`surrogateescape`):
    a reason holding it failed the run directory's write, which was detached, and the run
    stayed in progress without a row. The reasons and notes that quote a message escape it."""
    undecodable = b"data-\xff.bin".decode("utf-8", "surrogateescape")

    class Uploads:
        """A sink whose upload fails on the undecodable name (it is detached, with a note)."""

        def start(self, run: RunInfo) -> None:
            pass

        def write_forward(self, record: object) -> None:
            raise OSError(f"cannot upload {undecodable}")

        def write_backward(self, record: object) -> None:
            pass

        def close(self, counts: object) -> None:
            pass

    def opened(tensor: torch.Tensor) -> float:
        raise FileNotFoundError(f"no such file: {undecodable}")

    class Loads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                raise FileNotFoundError(f"no such file: {undecodable}")
            return x * 2

    model = nn.Sequential(nn.Linear(2, 2), Loads())
    inject_observer(
        model,
        output_dir=tmp_path,
        sampler=EveryNForwardsSampler(1),
        reducers=[opened],
        sinks=[Uploads()],
    )
    with (
        pytest.warns(RuntimeWarning, match=r"reducer error: FileNotFoundError"),
        pytest.warns(RuntimeWarning, match=r"raised OSError: cannot upload"),
    ):
        model(torch.ones(1, 2))
    with torch.no_grad(), pytest.raises(FileNotFoundError) as raised:
        model(torch.ones(1, 2))
    assert undecodable in str(raised.value)  # the user's exception, unchanged
    remove_observer(model)
    assert run_status(tmp_path) == "complete"
    history = pl.read_parquet(tmp_path / "history.parquet")
    failed = history.filter(pl.col("metric") == "opened")["unavailable_reason"].unique()
    assert failed.to_list() == ["reducer error: FileNotFoundError: no such file: data-\\udcff.bin"]
    (mark,) = history.filter(pl.col("metric") == "interrupted")["unavailable_reason"].to_list()
    assert "raised FileNotFoundError: no such file: data-\\udcff.bin in layer '1'" in mark
    assert "raised OSError: cannot upload data-\\udcff.bin in write_forward()" in page_prose(
        tmp_path
    )


class Key:
    """A mapping key whose `repr` holds a lone surrogate: a tensor_path is made of it."""

    def __repr__(self) -> str:
        return "key\udcfe"


KEY = Key()


class Keyed(nn.Module):
    """A Linear whose output is returned in a dict, under `KEY`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> dict[Key, torch.Tensor]:
        return {KEY: self.linear(x)}


def test_names_from_the_model_that_utf8_cannot_encode_are_recorded_escaped(
    tmp_path: Path,
) -> None:
    """A layer name with a lone surrogate (and a sampler's description, a reducer's own name)
    failed inject_observer's first write of the run with a bare UnicodeEncodeError, and a
    mapping key whose repr holds one (a tensor_path) failed every history part holding its
    rows. They come from the user's objects, not from an argument to check: each is recorded
    with its surrogates written as escapes, as error messages are, and the run completes."""

    class Described(EveryNForwardsSampler):
        def describe(self) -> str:
            return "every forward, Z\udcfc"

    def doubling(tensor: torch.Tensor) -> float:
        tensor.mul_(2)  # in place: the reason names the reducer by its own name
        return 0.0

    doubling.__name__ = "doubling\udcff"
    model = nn.Sequential()
    model.add_module("lin\udc80", Keyed())
    inject_observer(
        model,
        output_dir=tmp_path,
        sampler=Described(1),
        selector=lambda name, module: isinstance(module, Keyed),
        histogram_selector=lambda name, module: name == "lin\udc80",  # the module's own name
        reducers={"d": doubling},
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model(torch.ones(1, 2))[KEY].sum().backward()
        remove_observer(model)
    # nothing else: no layer said to have moved, or never to have run
    assert ["modified its argument" in str(w.message) for w in said] == [True]
    assert run_status(tmp_path) == "complete"
    history = pl.read_parquet(tmp_path / "history.parquet")
    assert history["layer"].unique().to_list() == ["lin\\udc80"]
    assert history["tensor_path"].unique().to_list() == ["[key\\udcfe]"]
    assert set(history["signal"]) == {"output", "output_gradient"}
    assert history.filter(pl.col("metric") == "d")["unavailable_reason"].unique().to_list() == [
        reasons.reducer_modified_input("doubling\\udcff of metric 'd'")
    ]
    prose = page_prose(tmp_path)
    assert "every forward, Z\\udcfc" in prose
    assert "| `lin\\udc80` | Keyed | 1 |" in prose
    assert "focus layers (TensorBoard histograms): `lin\\udc80`" in prose
