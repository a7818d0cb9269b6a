"""What the history writer does around part writes that do not return: it never writes on the
training thread of a run directory, a write it gave up never touches a later writer's files,
and the loss ledger says what became of the rows it kept."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from torchinstruments.history_config import HistoryConfig
from torchinstruments.rundir import writer as writer_module
from torchinstruments.rundir.layout import is_library_temporary, list_parts
from torchinstruments.rundir.writer import HistoryWriter

from conftest import one_mean


def test_a_full_buffer_whose_flush_thread_writes_nothing_drops_rows_instead_of_writing_here(
    tmp_path: Path,
) -> None:
    """The flush thread is busy elsewhere (stuck writing the run state on a stalled disk): a
    write on the appending thread (the training step) could block it just as long, so the
    rows beyond the cap are dropped and counted, and nothing is written here."""
    config = HistoryConfig(buffer_rows=2, max_buffered_rows=4, flush_seconds=0.02)
    writer = HistoryWriter(tmp_path, config, chunks_elsewhere=True)
    woken: list[bool] = []
    writer.wake_writer = lambda: woken.append(True)  # a flush thread that does not come
    for sample_id in range(4):
        writer.append([one_mean(sample_id)])
    assert writer.rows_buffered == 4
    with pytest.warns(RuntimeWarning, match="the flush thread had written no part after"):
        writer.append([one_mean(4)])  # finds the buffer full
    writer.append([one_mean(5)])
    assert woken  # the flush thread was asked to make room
    assert list_parts(tmp_path) == []
    assert writer.rows_written == 0
    assert writer.rows_buffered == 4  # samples 0-3, kept
    (loss,) = writer.losses
    assert (loss.rows, loss.first_sample_id, loss.last_sample_id) == (2, 4, 5)
    assert "the flush thread had written no part after 0.01 s" in loss.reason


def test_a_given_up_write_that_returns_leaves_the_next_attempts_part_of_that_number_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run resumed in the same process right after removal gave a part write up writes its
    parts while that write may still return. The old write, returning, writes its temporary
    and deletes it when it finds its run gave it up: were that the new attempt's temporary of
    the same part (one name for both), the new attempt's part would be lost or hold the old
    attempt's rows."""
    real = writer_module.write_parquet_atomic
    old_writing, old_release = threading.Event(), threading.Event()
    new_written, new_release = threading.Event(), threading.Event()

    def held(frame: pl.DataFrame, path: Path, **kwargs: Any) -> None:
        if threading.current_thread().name == "old attempt":  # returns once released
            old_writing.set()
            assert old_release.wait(60)
            real(frame, path, **kwargs)
            return
        rename = kwargs.pop("rename")

        def held_rename(tmp: Path, final: Path) -> None:  # its temporary written, not yet renamed
            new_written.set()
            assert new_release.wait(60)
            rename(tmp, final)

        real(frame, path, rename=held_rename, **kwargs)

    monkeypatch.setattr(writer_module, "write_parquet_atomic", held)
    config = HistoryConfig(buffer_rows=100)
    old = HistoryWriter(tmp_path, config, attempt=0)
    old.append([one_mean(i) for i in range(5)])
    old_flush = threading.Thread(target=old.flush, name="old attempt")
    old_flush.start()
    assert old_writing.wait(60)
    assert old.give_up("the write hangs", 60)
    assert not old.close(write=False)

    new = HistoryWriter(tmp_path, config, attempt=1)
    new.append([one_mean(i) for i in range(5, 8)])
    new_flush = threading.Thread(target=new.flush)
    new_flush.start()
    assert new_written.wait(60)
    old_release.set()  # the old write returns now, while the new one's temporary waits
    old_flush.join(60)
    assert not old_flush.is_alive()
    new_release.set()
    new_flush.join(60)
    assert not new_flush.is_alive()

    (part,) = list_parts(tmp_path)
    assert pl.read_parquet(part)["sample_id"].to_list() == [5, 6, 7]
    assert new.rows_written == 3
    assert new.close()
    assert old.rows_written == 0
    assert not [p for p in tmp_path.iterdir() if is_library_temporary(p)]


class _FailingDisk:
    """Part writes that raise OSError until `works` is set."""

    def __init__(self) -> None:
        self.works = False
        self.real = writer_module.write_parquet_atomic

    def __call__(self, frame: pl.DataFrame, path: Path, **kwargs: Any) -> None:
        if not self.works:
            raise OSError(5, "Input/output error")
        self.real(frame, path, **kwargs)


@pytest.mark.parametrize("at_removal", ["given up", "still failing", "written"])
def test_the_cap_drop_reason_says_the_kept_rows_are_retried_only_while_that_is_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_removal: str
) -> None:
    """Rows dropped at the memory cap are counted with a reason that says the rows already
    buffered are kept and retried. When removal then does not write those either (a write given
    up, or one that still fails), the reason says so instead; when it writes them, it stands."""
    disk = _FailingDisk()
    monkeypatch.setattr(writer_module, "write_parquet_atomic", disk)
    writer = HistoryWriter(tmp_path, HistoryConfig(buffer_rows=2, max_buffered_rows=4))
    with pytest.warns(RuntimeWarning, match="could not write history part"):
        writer.append([one_mean(0), one_mean(1)])
    writer.append([one_mean(2), one_mean(3)])
    with pytest.warns(RuntimeWarning, match="newer rows are dropped and counted"):
        writer.append([one_mean(4)])
    writer.append([one_mean(5)])
    (dropped,) = writer.losses
    assert (dropped.first_sample_id, dropped.last_sample_id) == (4, 5)
    assert dropped.reason.endswith("the buffered ones are kept and retried")
    if at_removal == "given up":
        writer.give_up("the write hangs", 1)
    disk.works = at_removal == "written"
    assert writer.close(write=at_removal != "given up") is False  # samples 4-5 are lost anyway
    first, *rest = writer.losses
    assert (first.rows, first.first_sample_id, first.last_sample_id) == (2, 4, 5)
    if at_removal == "written":
        assert first == dropped
        assert rest == []
        assert writer.rows_written == 4
        return
    assert "kept and retried" in first.reason
    assert "retried but not written at removal either" in first.reason
    assert first.reason.startswith(dropped.reason.removesuffix("are kept and retried"))
    (kept,) = rest
    assert (kept.rows, kept.first_sample_id, kept.last_sample_id) == (4, 0, 3)
    assert kept.reason.startswith("not written at removal")
