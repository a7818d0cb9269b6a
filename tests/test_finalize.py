"""Crash safety and recovery: SIGKILL mid-run, `python -m torchinstruments finalize`, the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest

from torchinstruments.finalize import RunLock, RunLockedError, check_output_dir, finalize
from torchinstruments.history import HistoryConfig, HistoryWriter, list_parts
from torchinstruments.index_page import read_run_info
from torchinstruments.records import Measurement, MetricValue

WRITER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from torchinstruments.finalize import RunLock
    from torchinstruments.history import HistoryConfig, HistoryWriter
    from torchinstruments.index_page import write_index
    from torchinstruments.records import LayerInfo, Measurement, MetricValue, RunInfo
    from torchinstruments.summary import write_catalog

    directory = Path(sys.argv[1])
    layers = (LayerInfo("a", "Linear"), LayerInfo("b", "ReLU"), LayerInfo("idle", "Dropout"))
    run = RunInfo(directory, "0.1.0", "x", "Net", layers, ("a",), "every 3", ("mean", "std"),
                  None, None, "rank0", True, 10, 4, "2026-01-01T00:00:00+00:00")
    lock = RunLock(directory)
    lock.acquire()
    write_catalog(directory, layers)
    write_index(directory, run, None)
    writer = HistoryWriter(directory, HistoryConfig(buffer_rows=10, window=4))
    s = 0
    while True:  # runs until killed
        writer.append([
            Measurement(s, 3 * s, time.time_ns() // 1000, None, name, "Linear", 0, "output", "",
                        (8, 4), "float32", "train", True, ("mean", "std"),
                        (MetricValue(float(s)), MetricValue(0.5)))
            for name in ("a", "b")
        ])
        s += 1
    """
)

HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from torchinstruments.finalize import RunLock
    RunLock(Path(sys.argv[1])).acquire()
    print("locked", flush=True)
    time.sleep(60)
    """
)


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchinstruments", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def strict_json(path: Path) -> object:
    def refuse(name: str) -> None:
        raise ValueError(name)

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


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


def test_sigkill_leaves_readable_parts_and_finalize_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "stats"
    run_dir.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT, encoding="utf-8")
    child = subprocess.Popen([sys.executable, str(script), str(run_dir)])
    try:
        deadline = time.monotonic() + 60
        while len(list_parts(run_dir)) < 200:
            assert child.poll() is None, "writer died on its own"
            assert time.monotonic() < deadline, "writer too slow"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    parts = list_parts(run_dir)
    part_rows = sum(pl.read_parquet(p).height for p in parts)  # every part reads back
    assert part_rows == 10 * len(parts)

    done = cli("finalize", run_dir)
    assert done.returncode == 0, done.stderr
    history = pl.read_parquet(run_dir / "history.parquet")
    assert history.height == part_rows
    assert history.select(pl.struct("sample_id", "layer", "metric").is_unique().all()).item()
    assert list_parts(run_dir) == []
    assert not list(run_dir.rglob("*.tmp"))

    result = strict_json(run_dir / "result.json")
    assert isinstance(result, list)
    assert [d["layer"] for d in result] == ["a", "b", "idle"]
    assert result[2]["tensors"] == []
    mean = result[0]["tensors"][0]["metrics"]["mean"]
    assert mean["observations"] == history.filter(layer="a", metric="mean").height
    assert mean["recent"]["actual"] == 4

    text = (run_dir / "index.md").read_text(encoding="utf-8")
    root_forwards = history["forward_index"].max() + 1  # type: ignore[operator]
    assert f"{root_forwards} root forwards" in text
    assert "lower bounds" in text
    assert read_run_info(run_dir).window == 4


def test_finalize_refuses_a_directory_locked_by_a_live_process(tmp_path: Path) -> None:
    sample_rows(tmp_path, 8)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        refused = cli("finalize", tmp_path)
        assert refused.returncode == 2
        assert "live process" in refused.stderr
        assert f"pid {holder.pid}" in refused.stderr
        assert list_parts(tmp_path)
        assert not (tmp_path / "history.parquet").exists()
    finally:
        holder.kill()
        holder.wait()
    assert cli("finalize", tmp_path).returncode == 0  # the kernel dropped the dead holder's lock


def test_unreadable_part_is_left_in_place_and_reported(tmp_path: Path) -> None:
    sample_rows(tmp_path, 12)
    good = list_parts(tmp_path)
    broken = tmp_path / "history.parts" / "part-000000777.parquet"
    broken.write_bytes(good[0].read_bytes()[:40])  # a torn file that no atomic write leaves
    with pytest.warns(RuntimeWarning, match="part-000000777"):
        report = finalize(tmp_path)
    assert [p for p, _ in report.unreadable_parts] == [broken]
    assert broken.exists()
    assert all(not p.exists() for p in good)
    assert pl.read_parquet(tmp_path / "history.parquet").height == 12
    with pytest.warns(RuntimeWarning):
        finalize(tmp_path)  # idempotent: nothing merged twice
    assert pl.read_parquet(tmp_path / "history.parquet").height == 12
    out = cli("finalize", tmp_path)
    assert out.returncode == 0
    assert "part-000000777" in out.stderr


def test_finalize_rebuilds_without_index(tmp_path: Path) -> None:
    sample_rows(tmp_path, 5)
    report = finalize(tmp_path)
    assert report.run_info_recovered
    assert [d["layer"] for d in strict_json(tmp_path / "result.json")] == ["a"]  # type: ignore[union-attr]


def test_finalize_on_a_directory_without_a_run(tmp_path: Path) -> None:
    out = cli("finalize", tmp_path)
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


@pytest.mark.parametrize("marker", ["history.parts", "history.parquet", "result.json", "index.md"])
def test_check_output_dir_refuses_an_existing_run(tmp_path: Path, marker: str) -> None:
    check_output_dir(tmp_path / "new")  # a missing directory is fine
    check_output_dir(tmp_path)  # so is an empty one
    (tmp_path / marker).mkdir() if marker == "history.parts" else (tmp_path / marker).touch()
    with pytest.raises(FileExistsError, match=r"output_dir=.*already holds a run.*finalize"):
        check_output_dir(tmp_path)
