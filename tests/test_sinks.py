"""Custom sinks see every record; a raising sink is reported once and detached."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import (
    EveryNForwardsSampler,
    RunCounts,
    RunInfo,
    SampleRecord,
    inject_observer,
    remove_observer,
)
from torchinstruments.rundir import shell

from conftest import read_history


class Recording:
    """A sink that keeps what it receives."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.records: list[SampleRecord] = []
        self.counts: RunCounts | None = None

    def start(self, run: RunInfo) -> None:
        self.calls.append("start")

    def write_forward(self, record: SampleRecord) -> None:
        self.calls.append("forward")
        self.records.append(record)

    def write_backward(self, record: SampleRecord) -> None:
        self.calls.append("backward")
        self.records.append(record)

    def close(self, counts: RunCounts) -> None:
        self.calls.append("close")
        self.counts = counts


class Raising(Recording):
    def write_forward(self, record: SampleRecord) -> None:
        super().write_forward(record)
        raise OSError("remote store unavailable")


def test_custom_sink_receives_lifecycle_and_plain_records(run_dir: Path) -> None:
    sink = Recording()
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2), sinks=[sink])
    for _ in range(4):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    assert sink.calls == ["start", "forward", "backward", "forward", "backward", "close"]
    assert sink.counts == RunCounts(
        root_forwards=4,
        samples=2,
        backward_samples=2,
        layer_samples={"0": 2, "1": 2},
        train_forwards=4,  # a plain loop's forwards are all on the training schedule
        eval_forwards=0,
        unobserved_eval_forwards=0,  # and none is passed through: counted, so 0, not unknown
        unobserved_setup_forwards=0,
    )
    rows = sum(len(m.metrics) for r in sink.records for m in r.measurements)
    assert rows == read_history(run_dir).height
    for record in sink.records:
        for measurement in record.measurements:
            for value in measurement.values:
                assert value.value is None or type(value.value) is float


def test_raising_sink_is_warned_once_and_detached_and_others_keep_working(run_dir: Path) -> None:
    bad, good = Raising(), Recording()
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[bad, good])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(2, 3))
        remove_observer(model)
    messages = [str(w.message) for w in caught if "remote store unavailable" in str(w.message)]
    assert len(messages) == 1
    assert "detached" in messages[0]
    assert bad.calls == ["start", "forward"]
    assert good.calls == ["start", "forward", "forward", "forward", "close"]
    assert read_history(run_dir)["sample_id"].unique().sort().to_list() == [0, 1, 2]


def test_a_warnings_filter_that_makes_errors_never_breaks_the_step_and_the_warning_is_written(
    run_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # `-W error` or pytest's `filterwarnings = error`: a library warning raised as an exception
    # inside a sampled step would cut the sample's end short; it is written to stderr instead.
    bad, good = Raising(), Recording()
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[bad, good])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    err = capfd.readouterr().err
    written = [line for line in err.splitlines() if "remote store unavailable" in line]
    assert len(written) == 1, err
    assert "detached" in written[0]
    assert "[written, not raised" in written[0]
    assert "test_sinks.py" in written[0]  # still at the user's line
    assert good.calls == ["start", *["forward", "backward"] * 3, "close"]
    assert read_history(run_dir)["sample_id"].unique().sort().to_list() == [0, 1, 2]
    state = json.loads((run_dir / ".state.json").read_text(encoding="utf-8"))
    assert state["status"] == "complete"


class _RaisingHandler(logging.Handler):
    """A caller's logging handler that fails (a log shipper whose connection dropped)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise ConnectionError("log shipper down")


def test_a_logging_handler_that_raises_on_warnings_never_breaks_the_step_or_the_removal(
    run_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Under logging.captureWarnings(True) a library warning goes through the caller's handlers:
    # one that raised broke the sampled step (a sink detached) and remove_observer, unfinished.
    handler = _RaisingHandler()
    logger = logging.getLogger("py.warnings")
    bad, good = Raising(), Recording()
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[bad, good])
    logging.captureWarnings(True)
    logger.addHandler(handler)
    try:
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    finally:
        logger.removeHandler(handler)
        logging.captureWarnings(False)
    err = capfd.readouterr().err
    written = [line for line in err.splitlines() if "remote store unavailable" in line]
    assert len(written) == 1, err
    assert "showing the warning raised ConnectionError('log shipper down')" in written[0]
    assert good.calls == ["start", "forward", "backward", "forward", "backward", "close"]
    assert read_history(run_dir)["sample_id"].unique().sort().to_list() == [0, 1]
    assert "remote store unavailable" in (run_dir / "index.md").read_text()


class Editing(Recording):
    """A careless sink: it tries to overwrite each record's values in place."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def write_forward(self, record: SampleRecord) -> None:
        super().write_forward(record)
        block = record.measurements
        try:
            block.values[:] = [-1.0] * len(block.values)  # type: ignore[index]
        except TypeError:
            self.refused += 1

    write_backward = write_forward


def test_a_sink_cannot_change_the_records_other_sinks_and_the_directory_hold(
    run_dir: Path,
) -> None:
    editing, after = Editing(), Recording()
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(
        model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[editing, after]
    )
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    assert editing.refused == len(editing.records) == 6
    history = read_history(run_dir)
    assert history.height > 0
    assert (history["value"] == -1.0).sum() == 0
    seen = [v.value for r in after.records for m in r.measurements for v in m.values]
    assert len(seen) == history.height
    assert -1.0 not in seen


def test_object_without_sink_methods_is_rejected_at_inject(run_dir: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"sinks: .* lacks .*write_forward"):
        inject_observer(model, output_dir=run_dir, sinks=[object()])  # type: ignore[list-item]


def test_full_disk_reported_by_polars_keeps_the_directory_attached_and_the_rows(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import polars as pl

    from torchinstruments import HistoryConfig
    from torchinstruments.rundir import writer

    real_write = writer.write_parquet_atomic
    failures = {"left": 3}

    def full_disk(frame: pl.DataFrame, path: Path, **kwargs: object) -> None:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise pl.exceptions.ComputeError("parquet: No space left on device (os error 28)")
        real_write(frame, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "write_parquet_atomic", full_disk)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    inject_observer(
        model,
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=9),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    messages = [str(w.message) for w in caught]
    assert sum("could not write history part" in m for m in messages) == 1
    assert not any("detached" in m for m in messages)
    assert read_history(run_dir).height == 10 * 2 * 2 * 9  # samples x layers x signals x metrics


class RaisingAtSecond(Recording):
    """A sink whose store fails from its second forward record on."""

    def write_forward(self, record: SampleRecord) -> None:
        super().write_forward(record)
        if len(self.records) == 2:
            raise OSError("remote store\nunavailable")

    def __repr__(self) -> str:
        return "RaisingAtSecond(store='s3://bucket')"


class RaisingAtStart(Recording):
    def __init__(self, message: str = "no credentials") -> None:
        super().__init__()
        self.message = message

    def start(self, run: RunInfo) -> None:
        raise ValueError(self.message)

    def __repr__(self) -> str:
        return "RaisingAtStart()"


def test_a_detached_sink_is_named_in_index_with_the_sample_it_failed_on_and_why(
    run_dir: Path,
) -> None:
    bad = RaisingAtSecond()
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(2), sinks=[bad])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(6):
            model(torch.randn(2, 3))
        remove_observer(model)
    assert [r.sample_id for r in bad.records] == [0, 1]
    index = (run_dir / "index.md").read_text()
    notes = [line for line in index.splitlines() if "RaisingAtSecond" in line]
    assert len(notes) == 1
    assert (  # the `:` of `://` behind a backslash: GitHub makes no bare link of it
        r"sink RaisingAtSecond(store='s3\://bucket') raised 'OSError: remote store\nunavailable' in "
        "write_forward() on the output record of sample 1 (forward_index 2); it was detached and received no later record"
    ) in notes[0]
    assert read_history(run_dir)["sample_id"].unique().sort().to_list() == [0, 1, 2]


def test_a_sink_that_raised_at_start_is_named_in_index(run_dir: Path) -> None:
    """A message of any length: its note (a paragraph of index.md) keeps its first 1,000
    characters; a 10 MB message was copied whole, and index.md was 10 MB."""
    good = Recording()
    huge = RaisingAtStart("x" * 1000 + "y" * 10_000_000)
    model = nn.Sequential(nn.Linear(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inject_observer(
            model,
            output_dir=run_dir,
            sampler=EveryNForwardsSampler(1),
            sinks=[RaisingAtStart(), huge, good],
        )
        model(torch.randn(2, 3))
        remove_observer(model)
    assert good.calls == ["start", "forward", "close"]
    index = (run_dir / "index.md").read_text()
    assert (
        "sink RaisingAtStart() raised ValueError: no credentials in start() at the start of the "
        "run, before any sample; it was detached and received no later record"
    ) in index
    cut = "x" * 1000 + " ... (10,000,000 more characters cut) in start()"
    assert f"sink RaisingAtStart() raised ValueError: {cut}" in index
    assert len(index.encode("utf-8")) <= 64 * 1024


class UnprintableError(Exception):
    """An error whose message raises when read (one a tensor subclass or a proxy raised)."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


class RaisingUnprintable(Recording):
    def write_forward(self, record: SampleRecord) -> None:
        super().write_forward(record)
        raise UnprintableError()

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_sink_whose_error_message_and_repr_raise_is_still_detached_and_named_by_type(
    run_dir: Path,
) -> None:
    bad, good = RaisingUnprintable(), Recording()
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[bad, good])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            model(torch.randn(2, 3))
        remove_observer(model)
    assert bad.calls == ["start", "forward"]
    assert good.calls == ["start", "forward", "forward", "close"]
    index = (run_dir / "index.md").read_text()
    assert (
        "sink <RaisingUnprintable (its repr raised)> raised UnprintableError: (its message could not "
        "be read) in write_forward() on the output record of sample 0 (forward_index 0)"
    ) in index
    assert read_history(run_dir)["sample_id"].unique().sort().to_list() == [0, 1]


class Unclear(Recording):
    """A sink whose repr and error hold a line break and a terminal escape."""

    def write_forward(self, record: SampleRecord) -> None:
        raise ValueError("store \x1b[31mdown\nretry")

    def __repr__(self) -> str:
        return "Unclear(\x1b[2J\nx)"


def test_a_detached_sink_with_unclear_text_is_named_on_one_line_without_raw_escapes(
    run_dir: Path,
) -> None:
    # Its repr's line break split index.md's note, and the escapes were written raw to it.
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[Unclear()])
    with pytest.warns(RuntimeWarning, match="detached"):
        model(torch.randn(2, 3))
    remove_observer(model)
    index = (run_dir / "index.md").read_text(encoding="utf-8")
    assert "\x1b" not in index
    note = next(line for line in index.splitlines() if "in write_forward()" in line)
    assert note.startswith(
        "**Note:** sink 'Unclear(\\x1b[2J\\nx)' raised 'ValueError: store \\x1b[31mdown\\nretry' in "
    )


class NoteRaising(Recording):
    """A sink of the caller's with a `note_so_far` method (so a note keeper to the library)
    whose note cannot be read: it raises, or gives a number."""

    def __init__(self, note: object) -> None:
        super().__init__()
        self.note = note

    def note_so_far(self) -> object:
        if isinstance(self.note, Exception):
            raise self.note
        return self.note


@pytest.mark.parametrize(
    ("note", "said"),
    [
        (RuntimeError("note store gone"), "raised RuntimeError: note store gone"),
        (42, "returned 42 (int), not a str or None"),
    ],
)
def test_a_sink_whose_note_cannot_be_read_is_warned_and_named_and_the_run_completes(
    run_dir: Path, note: object, said: str
) -> None:
    """Its note was read unguarded: remove_observer raised (or the run directory's close failed
    on a number), and the run was left "in progress"."""
    sink = NoteRaising(note)
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 3)).sum().backward()
        remove_observer(model)
    assert sink.calls == ["start", "forward", "backward", "close"]
    assert json.loads((run_dir / ".state.json").read_text())["status"] == "complete"
    messages = [str(w.message) for w in caught if "note_so_far()" in str(w.message)]
    assert messages == [
        f"torchinstruments: sink {sink!r} {said} in note_so_far(); its note is left out"
    ]
    index = (run_dir / "index.md").read_text()
    assert f"sink {sink!r} {said} in note_so_far(); its note is left out" in index


def test_a_sink_note_of_any_length_is_cut_to_fit_the_page_in_linear_time(run_dir: Path) -> None:
    """A caller's sink whose note ran to 200,000 characters (letters, and an address at its end)
    made index.md 253 KB, past its 64 KiB bound, and at 32,000 characters removal spent 41 s
    looking for e-mail addresses in it (a regular expression tried from every position)."""
    long = "x" * 199_990 + " a@b.co"
    sink = NoteRaising(long)
    model = nn.Sequential(nn.Linear(3, 3))
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(1), sinks=[sink])
    model(torch.randn(2, 3)).sum().backward()
    remove_observer(model)
    assert json.loads((run_dir / ".state.json").read_text())["status"] == "complete"
    index = (run_dir / "index.md").read_text()
    assert len(index.encode("utf-8")) <= 64 * 1024
    note = next(line for line in index.splitlines() if "x" * 100 in line)
    assert note == f"**Note:** {'x' * 4000} ... (195,997 more characters cut)"


@pytest.mark.parametrize(
    "text",
    [
        "mail a@b.co, or x.y+z@host-1.example.org.",
        "a@b@c.d a.@b.c _a@b.c. @b.c a@.b.c a@b- a@b.c-@d.e",
        "a@b.c.+q@y.z and ab@cd@ef.gh",
        "x" * 5000 + "@" + "y.z" * 2000,
    ],
)
def test_e_mail_addresses_in_notes_are_found_as_gfms_pattern_finds_them(text: str) -> None:
    """The linear scan finds what the pattern it replaced found, leftmost first."""
    pattern = re.compile(r"[A-Za-z0-9.+_-]*[A-Za-z0-9]@[A-Za-z0-9._-]*[A-Za-z0-9]")
    found = [(m.start(), m.end()) for m in pattern.finditer(text)]
    assert list(shell._emails(text)) == found
    assert found  # each text holds one at least


def test_a_sink_a_live_run_writes_to_is_refused_for_another_model_naming_it(
    run_dir: Path, tmp_path: Path
) -> None:
    """Two observed models given one sink (a GAN's generator and discriminator): it took both
    runs' records under the same layer names, started and closed twice, and nothing said so."""
    sink = Recording()
    first, second = nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3))
    inject_observer(first, output_dir=run_dir, sinks=[sink])
    with pytest.raises(ValueError, match=r"^sinks\[1\] ") as refused:
        inject_observer(second, output_dir=tmp_path / "other", sinks=[Recording(), sink])
    assert str(refused.value).startswith(
        f"sinks[1] ({sink!r}) is a sink of the live run in {run_dir.resolve()}: it would take "
        "both runs' records under the same layer names"
    )
    assert not (tmp_path / "other").exists()  # refused before anything was written
    remove_observer(first)
    inject_observer(second, output_dir=tmp_path / "other", sinks=[sink])  # its run ended
    remove_observer(second)
    assert sink.calls.count("start") == 2
