"""A parent of rank runs read as one run: two real gloo ranks with rank_policy="all", then
`show`, `compare`, `plot`, `heatmap` and `finalize` on the parent and its index.md's queries,
each rank's values checked against that rank's own history.parquet."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal as signals
import sys
import threading
from pathlib import Path

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments.__main__ import main
from torchinstruments.rundir import layout, parent_rewrite
from torchinstruments.rundir.page_ranks import render_parent_index

from _ranks import joined, run_ranks

SERIES = ["layer", "call_index", "signal", "tensor_path", "metric"]
STEPS = 4


def worker(rank: int, world_size: int, port: int, output_dir: str) -> None:
    """One rank: a small MLP, rank-specific inputs, every forward sampled."""
    from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

    with joined(rank, world_size, port):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inject_observer(
            model,
            output_dir=output_dir,
            sampler=EveryNForwardsSampler(1),
            rank_policy="all",
        )
        for step in range(STEPS):
            torch.manual_seed(100 * rank + step)
            model(torch.randn(3, 4) * (rank + 1)).sum().backward()
        remove_observer(model)


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ranks") / "stats"
    directory.mkdir()
    run_ranks(worker, str(directory))
    return directory


def history(parent: Path, rank: int) -> pl.DataFrame:
    return pl.read_parquet(parent / f"rank-{rank:03d}" / "history.parquet")


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_show_parent_gives_each_ranks_latest_and_window(parent: Path) -> None:
    code, text = run_cli("show", str(parent), "--format", "json")
    assert code == 0
    rows = pl.DataFrame(json.loads(text)["rows"])
    latest = rows.filter(pl.col("at") == "latest")
    for layer, signal in (("0", "output"), ("2", "output_gradient")):
        values = []
        for rank in (0, 1):
            h = history(parent, rank).filter(
                pl.col("layer") == layer, pl.col("signal") == signal, pl.col("metric") == "mean"
            )
            values.append(h.sort("sample_id")["value"][-1])
        row = latest.filter(
            pl.col("layer") == layer, pl.col("signal") == signal, pl.col("metric") == "mean"
        ).row(0, named=True)
        assert row["ranks"] == 2
        assert (row["min"], row["max"]) == (min(values), max(values))
        assert row["median"] == pytest.approx(sum(values) / 2, rel=1e-12)
        assert row["farthest_by"] == pytest.approx(values[row["farthest_rank"]] - row["median"])
    code, text = run_cli("show", str(parent))
    assert code == 0
    assert "ranks: " in text
    assert "far rank" in text


def test_show_one_rank_is_that_ranks_show(parent: Path) -> None:
    assert run_cli("show", str(parent), "--rank", "1") == run_cli("show", str(parent / "rank-001"))


def test_compare_parent_first_departure_matches_a_walk(parent: Path) -> None:
    code, text = run_cli("compare", str(parent), "--tolerance", "0.05", "--format", "json")
    assert code == 0
    rows = pl.DataFrame(json.loads(text)["rows"])
    a, b = history(parent, 0), history(parent, 1)
    joined = a.join(b, on=[*SERIES, "sample_id"], suffix="_b")
    for r in rows.iter_rows(named=True):
        key = (pl.col(k) == r[k] for k in SERIES)
        pair = joined.filter(*key).sort("sample_id")
        differ = pair.filter((pl.col("value_b") - pl.col("value")).abs() > 0.05)
        expected = differ["sample_id"][0] if differ.height else None
        assert r["first_departure"] == expected, r
        assert r["matched_samples"] == pair.height
        if expected is not None:
            assert r["departing_ranks"] == [0, 1]
            first = differ.row(0, named=True)
            assert r["nearest_other"] == pytest.approx(abs(first["value_b"] - first["value"]))
    code, _ = run_cli("compare", str(parent), str(parent), "--rank", "0")
    assert code == 0


def test_plot_and_heatmap_of_the_parent(parent: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    code, text = run_cli("plot", str(parent), "-o", str(tmp_path / "p.png"), "--layers", "^2$")
    assert code == 0
    assert "tensor 2, 2 ranks" in text
    code, text = run_cli("heatmap", str(parent), "-o", str(tmp_path), "--metrics", "mean")
    assert code == 0
    assert "2 ranks (2 train rows) x 4 samples" in text
    image = Image.open(tmp_path / "heatmap-ranks-mean.png")
    description = json.loads(image.text["Description"])  # type: ignore[attr-defined]
    assert description["rows"] == [["rank 000: 0", 0, "", "train"], ["rank 001: 0", 0, "", "train"]]
    assert description["columns"] == list(range(STEPS))


def test_parent_index_queries_read_every_rank(parent: Path) -> None:
    text = (parent / "index.md").read_text()
    assert "2 rank directories, 2 finished" in text
    # every rank finished, yet a rank whose rewrite died with it is not on the page as it is
    # now: the page says what it may not have seen, whatever the states it shows
    assert (
        "a rank whose rewrite died with the rank writing this page (killed, or its write given "
        "up or failed, which that rank's warning says) may be further on than said here"
    ) in " ".join(text.split())
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    scope: dict[str, object] = {}
    outputs = []
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(block, scope)
        outputs.append(out.getvalue())
    per_rank = pl.read_csv(io.StringIO(outputs[1]))
    assert per_rank["rank"].to_list() == [0, 1]
    assert per_rank["rows"].to_list() == [history(parent, r).height for r in (0, 1)]
    latest = pl.read_csv(
        io.StringIO(outputs[2]),
        schema_overrides={"layer": pl.String, "tensor_path": pl.String},
    ).with_columns(pl.col("tensor_path").fill_null(""))
    for rank in (0, 1):
        h = history(parent, rank).filter(pl.col("metric") == "mean")
        expected = h.sort("sample_id").group_by(SERIES, maintain_order=True).last()
        got = latest.join(expected, on=SERIES)
        assert got.height == expected.height
        assert (got[str(rank)] == got["value"]).all()
    departs = outputs[4]
    assert "series of mean where a rank departs by more than 0.0" in departs


def test_finalize_parent_rewrites_its_index(parent: Path) -> None:
    (parent / "index.md").unlink()
    code, text = run_cli("finalize", str(parent))
    assert code == 0
    assert "wrote" in text
    assert "2 finished" in (parent / "index.md").read_text()


def _copy(parent: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "stats"
    shutil.copytree(parent, copy)
    return copy


def _table(page: str) -> list[str]:
    return [line for line in page.splitlines() if re.match(r"\| \d", line)]


def test_a_parent_of_hundreds_of_ranks_gives_like_ranks_one_row_and_does_not_grow_with_them(
    parent: Path, tmp_path: Path
) -> None:
    copy = _copy(parent, tmp_path)
    zero, one = (row.split(" | ", 2)[2] for row in _table(render_parent_index(copy)))
    assert zero == one  # the two ranks of the job finished alike
    for rank in range(2, 300):  # rank 1's state, as a job of 300 alike ranks would leave them
        (copy / f"rank-{rank:03d}").mkdir()
        shutil.copy(copy / "rank-001" / ".state.json", copy / f"rank-{rank:03d}")
    (copy / "rank-150" / ".state.json").unlink()  # one rank unlike the others
    page = render_parent_index(copy)

    assert _table(page) == [
        f"| 0-149 | `rank-000/` to `rank-149/` | {one}",
        "| 150 | `rank-150/` | no state file | - | - |",
        f"| 151-299 | `rank-151/` to `rank-299/` | {one}",
    ]
    assert "consecutive ranks whose state and counts are the same share a row" in page
    for rank in range(200, 300):
        shutil.rmtree(copy / f"rank-{rank:03d}")
    assert len(render_parent_index(copy)) == len(page)  # 100 ranks fewer, not a byte shorter


def test_a_rank_finishing_while_another_writes_the_page_returns_and_the_writer_renders_it(
    parent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(parent, tmp_path)
    state = copy / "rank-001" / ".state.json"
    finished = state.read_bytes()
    state.unlink()  # rank 1 has not finished yet
    rendering, go_on, renders = threading.Event(), threading.Event(), []

    def render(*args: object) -> str:
        page = render_parent_index(*args)  # type: ignore[arg-type]
        renders.append(page)
        if len(renders) == 1:  # the first writer holds the lock after reading the states
            rendering.set()
            go_on.wait(timeout=120)
        return page

    monkeypatch.setattr(parent_rewrite, "render_parent_index", render)
    first = threading.Thread(target=parent_rewrite.write_parent_index, args=(copy,))
    first.start()
    assert rendering.wait(timeout=120)
    state.write_bytes(finished)  # rank 1 finishes while rank 0's page is being written
    second = threading.Thread(target=parent_rewrite.write_parent_index, args=(copy,))
    second.start()
    second.join(timeout=120)
    assert not second.is_alive()
    assert len(renders) == 1
    go_on.set()
    first.join(timeout=120)

    assert not first.is_alive()
    assert len(renders) == 2
    assert "no state file" in _table(renders[0])[1]
    written = _table((copy / "index.md").read_text())
    assert "no state file" not in written[1]
    assert written == _table(render_parent_index(copy))


def test_finalize_parent_renders_its_page_once_not_once_a_rank(
    parent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(parent, tmp_path)
    renders: list[Path] = []

    def render(directory: Path, *args: object) -> str:
        renders.append(directory)
        return render_parent_index(directory, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(parent_rewrite, "render_parent_index", render)
    # asks that an earlier version of the library left, from ranks killed while asking
    left = [f"{parent_rewrite.PARENT_AGAIN}.{token}{layout.TMP_SUFFIX}" for token in "ab"]
    for name in left:
        (copy / name).write_text("x")
    code, text = run_cli("finalize", str(copy))
    assert code == 0
    assert renders == [copy]
    assert not list(copy.glob(f"*{layout.TMP_SUFFIX}"))
    said = [line for line in text.splitlines() if parent_rewrite.PARENT_AGAIN in line]
    assert said == [  # one line for them all, in the parent
        f"removed 2 temporaries an earlier version left in {copy} ({left[0]}, {left[1]}): "
        "asks of ranks killed while asking for its index.md to be rewritten"
    ]


def test_ranks_asking_for_the_page_at_once_all_return_and_the_page_is_whole(
    parent: Path, tmp_path: Path
) -> None:
    copy = _copy(parent, tmp_path)
    (copy / "index.md").unlink()
    start, go = os.pipe()
    children = []
    for _ in range(8):  # ranks finishing together, each asking for the page
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go)
                os.read(start, 1)
                parent_rewrite.write_parent_index(copy)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    os.close(start)
    os.write(go, b"x" * len(children))
    os.close(go)

    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children] == [0] * 8
    assert _table((copy / "index.md").read_text()) == _table(render_parent_index(copy))
    assert not list(copy.glob("*torchinstruments-tmp"))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL, fork, fcntl")
def test_a_rank_killed_while_asking_for_the_page_leaves_no_temporary_once_it_is_written_again(
    parent: Path, tmp_path: Path
) -> None:
    copy = _copy(parent, tmp_path)
    pid = os.fork()
    if pid == 0:  # a rank asking for the page, killed as its first file write is made durable
        try:
            layout.fsync_path = lambda path: os.kill(os.getpid(), signals.SIGKILL)
            parent_rewrite.write_parent_index(copy)
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signals.SIGKILL
    # and one an earlier version of the library left, killed between its write and its rename
    (copy / f"{parent_rewrite.PARENT_AGAIN}.0123456789abcdef{layout.TMP_SUFFIX}").write_text("x")

    parent_rewrite.write_parent_index(copy)  # the next rank to finish

    assert not list(copy.glob(f"*{layout.TMP_SUFFIX}"))
    assert _table((copy / "index.md").read_text()) == _table(render_parent_index(copy))


def test_a_page_write_that_fails_while_a_rank_asks_is_made_again_with_that_rank(
    parent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(parent, tmp_path)
    (copy / "index.md").unlink()
    state = copy / "rank-001" / ".state.json"
    finished = state.read_bytes()
    state.unlink()  # rank 1 has not finished yet
    rendering, go_on, writes = threading.Event(), threading.Event(), []

    def write(path: Path, text: str, *args: object, **kwargs: object) -> None:
        if path.name != "index.md":
            layout.write_text_atomic(path, text, *args, **kwargs)  # type: ignore[arg-type]
            return
        writes.append(text)
        if len(writes) == 1:  # rank 0's first write fails (a full disk, for a moment)
            rendering.set()
            go_on.wait(timeout=120)
            raise OSError(errno.ENOSPC, "No space left on device")
        layout.write_text_atomic(path, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(parent_rewrite, "write_text_atomic", write)
    first = threading.Thread(target=parent_rewrite.write_parent_index, args=(copy,))
    first.start()
    assert rendering.wait(timeout=120)
    state.write_bytes(finished)  # rank 1 finishes, asks, and returns: rank 0 holds the lock
    parent_rewrite.write_parent_index(copy)
    go_on.set()
    first.join(timeout=120)

    assert not first.is_alive()
    assert len(writes) == 2
    assert _table((copy / "index.md").read_text()) == _table(render_parent_index(copy))
    assert "no state file" not in _table((copy / "index.md").read_text())[1]
