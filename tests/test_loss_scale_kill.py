"""Loss scales survive a SIGKILL: the live run saves them as its rows reach the disk.

A real child process (forked from this file run once as a script, `_fork_server`) trains an MLP under float16 autocast with `torch.amp.GradScaler("cpu")`
(a scale too large for float16: it overflows, halves and grows again during the run), prints
each step's scale to a file, waits until every sample's gradient rows are in history parts and
the run's state file was saved after them, and is killed with SIGKILL. `torchinstruments
finalize` then writes index.md, whose loss-scale query, run as printed, must divide each
gradient row by exactly the scale the child reported for its sample. A second attempt
(resume=True into the same directory) must keep the killed attempt's scales beside its own,
and a sample whose scale no save held reads as unknown (null), never as an earlier one's.
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from _fork_server import ForkServer, serve, write_whole
from test_loss_scale import python_blocks, scaled_step

from torchinstruments import remove_observer
from torchinstruments.history_config import HistoryConfig
from torchinstruments.rundir.layout import list_parts
from torchinstruments.rundir.page_loss_scale import SCALED_METRICS

from conftest import cli_in_process, mlp, observe, read_history

STEPS = 10
READY = "ready"
WAIT_S = 60.0


def gradient_samples(directory: Path) -> int:
    """How many samples have output_gradient rows in the run's parts."""
    parts = list_parts(directory)
    if not parts:
        return 0
    frame = pl.scan_parquet(parts, glob=False).filter(pl.col("signal") == "output_gradient")
    return frame.select(pl.col("sample_id").n_unique()).collect().item()


def saved_through(directory: Path) -> int:
    """The first sample after those whose scale the live state file holds (0: none)."""
    try:
        spans = json.loads((directory / ".state.json").read_text("utf-8")).get("loss_scales")
    except (OSError, ValueError):
        return 0
    return spans[-1]["first_sample_id"] if spans else 0


def child_main(directory: Path, reported: Path, attempt: int) -> None:
    """The killed process: STEPS scaled steps, each sample's scale reported, then says it is
    ready (the file `reported.ready`) and waits (`attempt` 1: resume=True, after STEPS samples
    of a killed attempt 0)."""
    torch.set_num_threads(1)
    torch.manual_seed(attempt)
    model = mlp(16, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (22 - attempt), growth_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = HistoryConfig(1024, flush_seconds=0.25)
        observe(model, directory, grad_scaler=scaler, history_config=config, resume=attempt > 0)
    x = torch.randn(32, 16)
    with reported.open("w", encoding="utf-8") as out:
        for _ in range(STEPS):
            out.write(f"{scaler.get_scale()!r}\n")
            out.flush()
            scaled_step(model, optimizer, scaler, x)
    deadline = time.monotonic() + WAIT_S
    # a resumed attempt's parts are its own (the earlier ones were merged); its ids go on
    while gradient_samples(directory) < STEPS or saved_through(directory) < (attempt + 1) * STEPS:
        if time.monotonic() > deadline:
            print("timeout", flush=True)
            return
        time.sleep(0.02)
    write_whole(reported.with_suffix(".ready"), READY)
    time.sleep(WAIT_S)


def scenario(root: Path, args: Sequence[str]) -> None:
    """A child of the server (`_fork_server`): `child_main` for `args`."""
    child_main(Path(args[0]), Path(args[1]), int(args[2]))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """This file run once as a script that imported torch; it forks each killed attempt when a
    test asks, so the second attempt's child costs no second import."""
    server = ForkServer(__file__, tmp_path_factory.mktemp("server") / "server.err")
    yield server
    server.close()


def finalize(directory: Path) -> None:
    done = cli_in_process("finalize", directory)
    assert done.returncode == 0, done.stderr


def unscaled_by_index(directory: Path) -> pl.DataFrame:
    """index.md's setup and loss-scale query, run as printed."""
    blocks = python_blocks((directory / "index.md").read_text(encoding="utf-8"))
    (setup,) = [block for block in blocks if "def this_run" in block]
    (query,) = [block for block in blocks if "join_asof" in block]
    session: dict[str, Any] = {}
    exec(compile(setup, "index.md:setup", "exec"), session)
    exec(compile(query, "index.md:loss-scale", "exec"), session)
    return session["unscaled"]


def assert_unscaled_by(directory: Path, scales: list[float | None]) -> None:
    """Every scaled gradient row, divided by exactly its sample's scale (None: unknown)."""
    unscaled = unscaled_by_index(directory)
    rows = read_history(directory).filter(
        pl.col("signal") == "output_gradient", pl.col("metric").is_in(SCALED_METRICS)
    )
    assert unscaled.height == rows.height > 0
    assert set(unscaled["sample_id"]) == set(range(len(scales)))
    for row in unscaled.iter_rows(named=True):
        scale = scales[row["sample_id"]]
        assert row["scale"] == scale, row
        if scale is None or row["value"] is None:
            assert row["unscaled"] is None
        else:
            assert row["unscaled"] == row["value"] / scale


def kill_child(
    server: ForkServer, directory: Path, reported: Path, attempt: int = 0
) -> list[float | None]:
    """SIGKILL to an attempt's child once it is ready; the scales it reported."""
    child = server.start(reported.parent, f"attempt-{attempt}", directory, reported, attempt)
    try:
        assert child.wait_for(reported.with_suffix(".ready"), WAIT_S * 2) == READY
    finally:
        child.kill()
    scales: list[float | None] = [float(line) for line in reported.read_text("utf-8").split()]
    assert len(scales) == STEPS
    assert len(set(scales)) > 1  # the scale changed during the attempt
    return scales


@pytest.fixture(scope="module")
def killed_once(
    tmp_path_factory: pytest.TempPathFactory, server: ForkServer
) -> tuple[Path, list[float | None]]:
    """One first attempt killed with SIGKILL: a pristine copy of its run directory, and the
    scales its child reported. The tests differ only in what they do after the kill, and a
    child is the slow part."""
    root = tmp_path_factory.mktemp("killed")
    scales = kill_child(server, root / "stats", root / "scales.txt")
    shutil.copytree(root / "stats", root / "pristine", symlinks=True)
    return root, scales


@pytest.fixture
def killed_run(killed_once: tuple[Path, list[float | None]]) -> tuple[Path, list[float | None]]:
    """The killed run directory as the kill left it, at the path it was killed in (its state
    file and index.md name that path, and the loss-scale query reads it), and its scales."""
    root, scales = killed_once
    directory = root / "stats"
    shutil.rmtree(directory)
    shutil.copytree(root / "pristine", directory, symlinks=True)
    return directory, list(scales)


def test_loss_scales_of_a_killed_run_unscale_its_rows_after_finalize(
    killed_run: tuple[Path, list[float | None]],
) -> None:
    directory, scales = killed_run
    finalize(directory)

    state = json.loads((directory / ".state.json").read_text("utf-8"))
    assert state["counts"]["loss_scales"][-1] == {"first_sample_id": STEPS, "scale": None}
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert f"sample 0: {scales[0]:.0f}; " in page
    assert "No loss scale is recorded" not in page
    assert_unscaled_by(directory, scales)
    finalize(directory)  # a second finish rebuilds the counts from history: the scales stay
    assert_unscaled_by(directory, scales)


def test_samples_after_the_last_saved_scale_read_as_unknown(
    killed_run: tuple[Path, list[float | None]],
) -> None:
    """Killed after rows reached the disk whose scales no save held yet: the state file as an
    earlier save wrote it (scales of samples 0-3), then finalize."""
    directory, scales = killed_run
    state_file = directory / ".state.json"
    state = json.loads(state_file.read_text("utf-8"))
    kept = [span for span in state["loss_scales"] if span["first_sample_id"] < 4]
    state["loss_scales"] = [*kept, {"first_sample_id": 4, "scale": None}]
    state_file.write_text(json.dumps(state), "utf-8")
    finalize(directory)
    assert_unscaled_by(directory, [*scales[:4], *[None] * (STEPS - 4)])
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert "samples 4 on: not recorded." in page


def test_a_run_resumed_after_a_kill_keeps_the_killed_attempts_scales(
    killed_run: tuple[Path, list[float | None]],
) -> None:
    directory, scales = killed_run
    model = mlp(16, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observe(model, directory, grad_scaler=scaler, resume=True)
    for _ in range(3):
        scales.append(scaler.get_scale())
        scaled_step(model, optimizer, scaler, torch.randn(4, 16))
    remove_observer(model)
    assert_unscaled_by(directory, scales)


def test_a_resumed_attempt_killed_too_keeps_both_attempts_scales(
    killed_run: tuple[Path, list[float | None]], tmp_path: Path, server: ForkServer
) -> None:
    directory, scales = killed_run
    scales += kill_child(server, directory, tmp_path / "second.txt", attempt=1)
    finalize(directory)
    assert_unscaled_by(directory, scales)


if __name__ == "__main__":
    serve(scenario)
