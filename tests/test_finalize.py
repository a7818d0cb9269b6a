"""`finalize` and the run lock: completing an interrupted directory, refusing a live one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.history_config import HistoryConfig
from torchinstruments.records import Measurement, MetricValue
from torchinstruments.rundir.finish import finalize
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.lock import RunLock, RunLockedError
from torchinstruments.rundir.output_dir import check_output_dir
from torchinstruments.rundir.writer import HistoryWriter

from conftest import run_cli, strict_json

HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from torchinstruments.rundir.lock import RunLock
    RunLock(Path(sys.argv[1])).acquire()
    print("locked", flush=True)
    time.sleep(60)
    """
)


def sample_rows(directory: Path, samples: int) -> None:
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=4))
    for s in range(samples):
        writer.append(
            [
                Measurement(
                    s,
                    s,
                    s,
                    None,
                    "a",
                    "Linear",
                    0,
                    "output",
                    "",
                    (1,),
                    "float32",
                    "train",
                    True,
                    ("mean",),
                    (MetricValue(1.0 * s),),
                )
            ]
        )
    writer.flush()


def test_finalize_refuses_a_directory_locked_by_a_live_process(tmp_path: Path) -> None:
    sample_rows(tmp_path, 8)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        refused = run_cli("finalize", tmp_path)
        assert refused.returncode == 2
        assert "live process" in refused.stderr
        assert f"pid {holder.pid}" in refused.stderr
        assert list_parts(tmp_path)
        assert not (tmp_path / "history.parquet").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (
        run_cli("finalize", tmp_path).returncode == 0
    )  # the kernel dropped the dead holder's lock


def test_unreadable_part_is_left_in_place_and_reported(tmp_path: Path) -> None:
    sample_rows(tmp_path, 12)
    good = list_parts(tmp_path)
    broken = tmp_path / "history.parts" / "part-000000777.parquet"
    broken.write_bytes(good[0].read_bytes()[:40])  # a torn file that no atomic write leaves
    report = finalize(tmp_path)
    assert report.merge is not None
    assert [p for p, _ in report.merge.unreadable_parts] == [broken]
    assert not report.complete
    assert any("part-000000777" in problem for problem in report.problems)
    assert broken.exists()
    assert all(not p.exists() for p in good)
    assert pl.read_parquet(tmp_path / "history.parquet").height == 12
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "INCOMPLETE" in index
    assert "part-000000777" in index
    assert not finalize(tmp_path).complete  # idempotent: nothing merged twice
    assert pl.read_parquet(tmp_path / "history.parquet").height == 12
    out = run_cli("finalize", tmp_path)
    assert out.returncode == 1
    assert "part-000000777" in out.stderr


def test_finalize_rebuilds_without_index(tmp_path: Path) -> None:
    sample_rows(tmp_path, 5)
    report = finalize(tmp_path)
    assert report.run_info_recovered
    assert [d["layer"] for d in strict_json(tmp_path / "result.json")] == ["a"]  # type: ignore[union-attr]


def test_finalize_on_a_directory_without_a_run(tmp_path: Path) -> None:
    out = run_cli("finalize", tmp_path)
    assert out.returncode == 1
    assert "holds no run" in out.stderr


def test_lock_is_exclusive_between_holders(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunLockedError, match="live process"):
        RunLock(tmp_path).acquire()  # a second open file description conflicts, as across processes
    first.release()
    with RunLock(tmp_path) as again:
        assert again.held


def test_finalize_says_the_reserve_it_deletes_is_the_disk_space_held_not_a_torn_write(
    tmp_path: Path,
) -> None:
    sample_rows(tmp_path, 2)
    reserve = tmp_path / ".reserve.torchinstruments-tmp"
    torn = tmp_path / "result.json.torchinstruments-tmp"
    reserve.write_bytes(b"held")
    torn.write_text("torn write", encoding="utf-8")
    printed = run_cli("finalize", tmp_path).stdout.splitlines()
    assert f"removed the disk space the live run held for its final state {reserve}" in printed
    assert f"removed incomplete temporary {torn}" in printed
    assert f"removed incomplete temporary {reserve}" not in printed


@pytest.mark.parametrize("marker", ["history.parts", "history.parquet", "result.json", "index.md"])
def test_check_output_dir_refuses_an_existing_run(tmp_path: Path, marker: str) -> None:
    check_output_dir(tmp_path / "new")  # a missing directory is fine
    check_output_dir(tmp_path)  # so is an empty one
    (tmp_path / marker).mkdir() if marker == "history.parts" else (tmp_path / marker).touch()
    with pytest.raises(
        FileExistsError, match=r"output_dir=.*already holds a run.*resume=True.*new output_dir"
    ):
        check_output_dir(tmp_path)


def test_finalize_deletes_only_the_librarys_temporaries(tmp_path: Path) -> None:
    sample_rows(tmp_path, 6)
    users = [
        tmp_path / "notes.tmp",
        tmp_path / "history.parquet.tmp",
        tmp_path / "history.parts" / "x.tmp",
    ]
    for path in users:
        path.write_text("the user's", encoding="utf-8")
    ours = tmp_path / "result.json.torchinstruments-tmp"
    ours.write_text("torn write", encoding="utf-8")
    report = finalize(tmp_path)
    assert report.removed_temporaries == (ours,)
    assert not ours.exists()
    for path in users:
        assert path.read_text(encoding="utf-8") == "the user's"


def test_finalize_of_only_result_json_and_parts_reads_the_layer_catalog(tmp_path: Path) -> None:
    """A directory holding only result.json (the catalog inject writes) and history.parts/ (the
    state file and index.md lost): finalize takes the selected layers from the catalog, in
    traversal order and with the layer that never ran, not from history, and says so."""
    import shutil

    import torch
    from torch import nn

    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    from conftest import wait_for_rows

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.never = nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    live, copy = tmp_path / "live", tmp_path / "copy"
    model = Model()
    inject_observer(
        model,
        output_dir=live,
        sampler=EveryNForwardsSampler(1),
        history_config=HistoryConfig(buffer_rows=1),
    )
    model(torch.randn(2, 4)).sum().backward()
    wait_for_rows(live, 1)
    copy.mkdir()
    shutil.copy(live / "result.json", copy / "result.json")
    shutil.copytree(live / "history.parts", copy / "history.parts")
    remove_observer(model)
    assert sorted(p.name for p in copy.iterdir()) == ["history.parts", "result.json"]
    out = run_cli("finalize", copy)
    assert "layers were read from result.json's catalog" in out.stdout, out.stdout
    assert "layers were rebuilt" not in out.stdout
    order = [name for name, _ in model.named_modules() if name]
    assert order == ["fc", "act", "never"]
    assert [d["layer"] for d in strict_json(copy / "result.json")] == order  # type: ignore[union-attr]
    index = (copy / "index.md").read_text(encoding="utf-8")
    assert "the layers were read from result.json's catalog" in index
    assert "`never` (Linear)" in index
