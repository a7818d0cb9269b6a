"""Shared fixtures and helpers: models, run directories, readers, references, sync detection."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchinstruments import (
    EveryNForwardsSampler,
    ObserverConfig,
    has_observer,
    inject_observer,
    remove_observer,
)
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.records import Measurement, MetricValue

_CHECKOUT = Path(__file__).resolve().parents[1]
_UNTRACKED = pytest.StashKey[set[str] | None]()
# `-n auto` starts one worker per core up to this many: each imports torch, transformers and
# Lightning, and many tests start ranks or children of their own.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for `-n auto`: the cores this process may run on, at least two, at most
    `MAX_WORKERS`. Why at least two: the CI machine has two cores, and while one worker's test
    waits on its children or ranks the other core has work."""
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may use
        cores = len(os.sched_getaffinity(0))
    else:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(2, min(cores, MAX_WORKERS))


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (the controller checks the checkout)."""
    return hasattr(config, "workerinput")


def _untracked_in_checkout() -> set[str] | None:
    """What `git status` would offer to add in the checkout (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(_CHECKOUT), "status", "--porcelain", "--untracked-files=normal"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {line[3:] for line in done.stdout.splitlines() if line.startswith("?? ")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_worker(session.config):
        return
    session.config.stash[_UNTRACKED] = _untracked_in_checkout()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if its tests left files in the checkout that git would offer to commit.

    Why: a test whose trainer wrote its run directory into the working directory left four run
    directories that were committed with the change that added it; tests write only under their
    own temporary folders."""
    if _is_worker(session.config):
        return
    before = session.config.stash.get(_UNTRACKED, None)
    after = _untracked_in_checkout()
    if before is None or after is None:
        return
    if left := sorted(after - before):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\ntests left files in the checkout (write under tmp_path): {left}", file=sys.stderr)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state."""
    torch.manual_seed(0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh, not yet existing run directory."""
    return tmp_path / "stats"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, so float reductions run in one order and compare bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["host", "device"])
def reduction_path(request: pytest.FixtureRequest) -> str:
    """Runs a test on the CPU's NumPy paths ("host") and on the sync-free general path
    ("device", `Measurer(..., host_paths=False)`), which every non-CPU device runs."""
    return request.param


@pytest.fixture
def cleanup() -> Iterator[list[nn.Module]]:
    """Models appended here get their observer removed even when a test fails."""
    models: list[nn.Module] = []
    yield models
    for model in models:
        if has_observer(model):
            remove_observer(model)


@pytest.fixture
def config_builds(monkeypatch: pytest.MonkeyPatch) -> list[ObserverConfig]:
    """Every `ObserverConfig` built while the test runs, in order (its checks run as usual)."""
    built: list[ObserverConfig] = []
    check = ObserverConfig.__post_init__

    def counted(self: ObserverConfig) -> None:
        built.append(self)
        check(self)

    monkeypatch.setattr(ObserverConfig, "__post_init__", counted)
    return built


def mlp(width: int = 8, depth: int = 3) -> nn.Sequential:
    """Linear+ReLU blocks; leaves are Linear and ReLU."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def read_history(directory: Path) -> pl.DataFrame:
    """The merged history written at removal."""
    return pl.read_parquet(directory / "history.parquet")


def strict_loads(text: str) -> Any:
    """Parse JSON, refusing NaN and Infinity (which result.json must never hold)."""

    def reject(constant: str) -> Any:
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def strict_json(path: Path) -> Any:
    """A UTF-8 JSON file parsed with `strict_loads`."""
    return strict_loads(path.read_text(encoding="utf-8"))


# The one State line index.md shows for each status of the state file.
STATE_LINES = {
    "in progress": "**State: in progress.**",
    "complete": "**State: complete.**",
    "interrupted": "**State: interrupted.**",
    "incomplete": "**State: INCOMPLETE.**",
}


def run_status(directory: Path) -> str:
    """The status in `directory/.state.json`; index.md must show that State line and no other."""
    status = strict_json(directory / ".state.json")["status"]
    page = (directory / "index.md").read_text(encoding="utf-8")
    assert [s for s, line in STATE_LINES.items() if line in page] == [status], page[:400]
    return status


def page_prose(directory: Path) -> str:
    """A run's index.md without its code blocks (the ready queries, whose status query prints
    every status a run can have), whitespace collapsed: what the page says of this run."""
    text = (directory / "index.md").read_text("utf-8")
    return " ".join(re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL).split())


def read_spans(text: str) -> list[str]:
    """The texts `text` quotes as code spans (`rundir.shell.literal_span`), read back: each
    span's content, a Python literal where it begins with a quote (one that is not printable)."""
    spans = re.findall(r"(?<!`)(`+)(?!`) ?(.+?) ?(?<!`)\1(?!`)", text)
    return [ast.literal_eval(s) if s[:1] in "'\"" else s for _, s in spans]


def read_result(directory: Path) -> list[dict[str, Any]]:
    """result.json, rejecting NaN and Infinity."""
    return strict_json(directory / "result.json")


def observe(model: nn.Module, run_dir: Path, **kwargs: Any) -> Path:
    """Inject with every root forward sampled (unless `sampler` is given)."""
    kwargs.setdefault("sampler", EveryNForwardsSampler(1))
    directory = inject_observer(model, output_dir=run_dir, **kwargs)
    assert directory is not None
    return directory


def measure(
    tensor: torch.Tensor, measurer: Measurer | None = None, *, host_paths: bool = True
) -> dict[str, MetricValue]:
    """Both halves of a reduction, as the engine runs them, by metric name."""
    measurer = measurer or Measurer(None, host_paths=host_paths)
    pending = measurer.launch(tensor)
    vector = pending.device_vector
    if vector is not None:
        assert vector.dtype == torch.float64
        assert vector.dim() == 1
        assert vector.device == tensor.device
    got = pending.resolve([] if vector is None else vector.tolist())
    assert len(got) == len(measurer.metrics)
    return dict(zip(measurer.metrics, got, strict=True))


def numpy_profile(values: np.ndarray) -> dict[str, float | None]:
    """The default profile computed independently by NumPy in float64 (None: unavailable)."""
    flat = values.astype(np.float64).ravel()
    finite = flat[np.isfinite(flat)]
    out: dict[str, float | None] = {
        "zero_fraction": float(np.count_nonzero(flat == 0)) / flat.size,
        "nonfinite_fraction": float(flat.size - finite.size) / flat.size,
    }
    if finite.size == 0:
        out.update(dict.fromkeys(("mean", "std", "min", "max", "p25", "p50", "p75")))
        return out
    # Moments on values scaled by a power of two (exact), so NumPy neither overflows nor underflows.
    exponent = max(-1000, min(1000, math.frexp(float(np.abs(finite).max()))[1]))
    scale = math.ldexp(1.0, exponent)
    out["mean"] = float(np.mean(finite / scale)) * scale
    out["std"] = float(np.std(finite / scale)) * scale
    out["min"] = float(finite.min())
    out["max"] = float(finite.max())
    for name, q in (("p25", 25), ("p50", 50), ("p75", 75)):
        out[name] = float(np.percentile(finite, q, method="linear"))
    return out


ORDER_METRICS = ("min", "max", "p25", "p50", "p75")


def assert_matches_numpy(got: dict[str, MetricValue], values: np.ndarray) -> None:
    """Order statistics and fractions exactly, moments to 1e-9; nulls only with a reason."""
    want = numpy_profile(values)
    finite = values.astype(np.float64)[np.isfinite(values.astype(np.float64))]
    magnitude = float(np.abs(finite).max()) if finite.size else 0.0
    for name, expected in want.items():
        actual = got[name].value
        if expected is None:
            assert actual is None, name
            assert got[name].reason == "no finite entries", name
        elif name in ORDER_METRICS or name.endswith("_fraction"):
            assert actual == expected, (name, actual, expected)
        else:
            assert actual is not None, (name, got[name].reason)
            assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12 * magnitude), name


def kill_when_ready(script: str, ready: str, *args: str | Path) -> None:
    """Run a test file's child mode (`script` with `args`), wait until it prints the line
    `ready`, then SIGKILL it: a real kill at a known point of the child's run."""
    child = subprocess.Popen(
        [sys.executable, script, *map(str, args)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == ready
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def rows_in_parts(directory: Path) -> int:
    """The rows in the run's completed `history.parts/` (their Parquet metadata)."""
    from torchinstruments.rundir.layout import list_parts

    parts = list_parts(directory)
    return pl.scan_parquet(parts, glob=False).select(pl.len()).collect().item() if parts else 0


def wait_for_rows(directory: Path, rows: int, timeout: float = 60.0) -> None:
    """Wait until the run's parts hold `rows` rows. The flush thread writes each full chunk
    while training goes on, so a test that copies the parts, forks or kills at a known point
    first waits for the rows that point has on disk (rows, not parts: whether the flush thread
    or the training thread wrote a sample's first rows decides how they are cut)."""
    deadline = time.monotonic() + timeout
    while rows_in_parts(directory) < rows:
        assert time.monotonic() < deadline, f"{rows} rows not in parts within {timeout} s"
        time.sleep(0.005)


def child_report(script: str, *args: object) -> Any:
    """Run `script` in a new Python process (`python -c script ARGS`), which must exit 0 within
    300 s, and return the JSON of the last line it printed: a stall the script sets up (a FIFO
    that never answers) then stays in the child, and a hang fails the test instead of the run."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`python -m torchinstruments ARGS` in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "torchinstruments", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_mean(sample_id: int) -> Measurement:
    """One output row of layer 'l' (a Linear): its mean, the sample's id, for writer tests."""
    return Measurement(
        sample_id=sample_id,
        forward_index=sample_id,
        timestamp_us=int(time.time() * 1e6),
        rank=None,
        layer="l",
        module_type="Linear",
        call_index=0,
        signal="output",
        tensor_path="",
        shape=(2,),
        dtype="float32",
        mode="train",
        grad_enabled=True,
        metrics=("mean",),
        values=(MetricValue(float(sample_id)),),
    )


class NoHostSync(TorchFunctionMode):
    """Records every torch call that would make a device tensor wait for the host.

    Violations are collected in `violations` rather than raised: the library catches exceptions
    inside measurement (turning them into null values), so a raised assertion could be swallowed.
    Assert `mode.violations == []` after the block.
    """

    SYNCING = frozenset(
        {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
         "masked_select", "bincount", "unique", "histc", "cpu", "numpy", "kthvalue"}
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in self.SYNCING:
            self.violations.append(name)
        elif name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flatten(args[1:])
        ):
            self.violations.append("boolean-mask indexing")
        return func(*args, **(kwargs or {}))


def _flatten(items: tuple[Any, ...]) -> Iterator[Any]:
    """Index arguments, tuples opened."""
    for item in items:
        if isinstance(item, tuple):
            yield from item
        else:
            yield item


def values(frame: pl.DataFrame, **where: Any) -> list[float | None]:
    """`value` column of the rows matching all `column=value` filters, in sample order."""
    for column, wanted in where.items():
        frame = frame.filter(pl.col(column) == wanted)
    return frame.sort("sample_id")["value"].to_list()


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, learning_rate: float) -> float:
    """One ordinary training step: forward, MSE loss, backward, plain SGD update.

    Written out rather than `torch.optim.SGD` because the first optimizer a process builds imports
    torch._dynamo (seconds), which adds nothing to tests that start fresh interpreters.
    """
    model.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter -= learning_rate * parameter.grad
    return loss.item()


def cli_in_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`torchinstruments ARGS` in this process (the entry point the script calls)."""
    import contextlib
    import io

    from torchinstruments.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


# -- heatmap PNGs ------------------------------------------------------------------------------


def read_heatmap(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    """A heatmap PNG's RGB pixels and the JSON of its "Description" text chunk."""
    from PIL import Image

    image = Image.open(path)
    return np.asarray(image.convert("RGB")), json.loads(image.text["Description"])  # type: ignore[attr-defined]


def heatmap_cell(panel: dict[str, Any], row: int, column: int) -> tuple[int, int]:
    """(y, x) of the centre pixel of a cell."""
    return (
        panel["top"] + row * panel["cell_height"] + panel["cell_height"] // 2,
        panel["left"] + column * panel["cell_width"] + panel["cell_width"] // 2,
    )


def expected_colours(
    history: pl.DataFrame, metric: str, sig: str, tensors: list[tuple], x: str
) -> tuple[dict[tuple[int, int], tuple[int, ...]], list[Any]]:
    """Per (row, column): the colour the cell must have; and the columns' x values.

    `tensors`: (layer, call_index, tensor_path, mode) per row (mode "train" when left out).
    """
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    from torchinstruments.cli.pictures_grid import ABSENT_COLOUR, NULL_COLOUR

    rows = history.filter(pl.col("metric") == metric)
    columns = sorted(set(rows[x].to_list()))
    panel = rows.filter(pl.col("signal") == sig)
    finite = [v for v in panel["value"].to_list() if v is not None and np.isfinite(v)]
    norm = Normalize(min(finite), max(finite))
    cmap = colormaps["viridis"]
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for r, (layer, call, path, *mode) in enumerate(tensors):
        series = panel.filter(
            pl.col("layer") == layer,
            pl.col("call_index") == call,
            pl.col("tensor_path") == path,
            pl.col("mode") == (mode[0] if mode else "train"),
        )
        got = dict(zip(series[x].to_list(), series["value"].to_list(), strict=True))
        for c, at in enumerate(columns):
            if at not in got:
                out[r, c] = ABSENT_COLOUR
            elif got[at] is None:
                out[r, c] = NULL_COLOUR
            else:
                out[r, c] = tuple(int(v) for v in cmap(norm(got[at]), bytes=True)[:3])
    return out, columns


def check_heatmap(
    png: Path, history: pl.DataFrame, metric: str, tensors: list[tuple], x: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """Every cell of every panel of a heatmap PNG has the colour computed from `history`.

    `tensors` are the rows the image must have, in order; the columns are `history`'s sorted
    `x` values. A measured value: viridis over the panel's finite min..max; a null: the null
    colour; no row: the absent colour. Returns the pixels and the metadata.
    """
    pixels, meta = read_heatmap(png)
    assert meta["metric"] == metric
    tensors = [t if len(t) == 4 else (*t, "train") for t in tensors]
    assert [tuple(t) for t in meta["rows"]] == tensors
    for panel in meta["panels"]:
        want, columns = expected_colours(history, metric, panel["signal"], tensors, x)
        assert meta["columns"] == columns
        bottom = panel["top"] + panel["cell_height"] * len(tensors)
        right = panel["left"] + panel["cell_width"] * len(columns)
        assert bottom < pixels.shape[0]
        assert right < pixels.shape[1]
        for (r, c), colour in want.items():
            y, xx = heatmap_cell(panel, r, c)
            assert tuple(pixels[y, xx]) == pytest.approx(colour, abs=1), (panel["signal"], r, c)
    return pixels, meta


class Wrapped(torch.Tensor):
    """A minimal wrapper tensor subclass: like DTensor, it has no storage of its own, so
    `.numpy()` and `.tolist()` refuse it; every op runs on `plain` and is wrapped again."""

    plain: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapped:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )
        wrapper.plain = inner
        return wrapper

    def __repr__(self, *, tensor_contents: object = None) -> str:  # not through ops
        return f"Wrapped({self.plain!r})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[bad-override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        def unwrap(item: Any) -> Any:
            if isinstance(item, Wrapped):
                return item.plain
            if isinstance(item, list | tuple):
                return type(item)(unwrap(i) for i in item)
            return item

        def wrap(item: Any) -> Any:
            if isinstance(item, torch.Tensor):
                return Wrapped(item)
            if isinstance(item, list | tuple):
                return type(item)(wrap(i) for i in item)
            return item

        kwargs = {key: unwrap(value) for key, value in (kwargs or {}).items()}
        return wrap(func(*unwrap(args), **kwargs))


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """No compiled code, counter or stance leaks from one test into another (torch.compile's
    tests: `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def grouped_rows(lines: list[str], start: int) -> list[list[str]]:
    """The rows of the grouped table below `lines[start]` (its header two lines down) as split
    cells, up to the blank line after it, each with its module type: a type is printed on its
    group's first row only, or whole on a line of its own above it."""
    rows: list[list[str]] = []
    current = ""
    for line in lines[start + 3 :]:
        if not line.strip():
            break
        cells = line.split()
        if line.startswith(" "):
            cells = [current, *cells]
        elif len(cells) == 1:
            current = cells[0]
            continue
        current = cells[0]
        rows.append(cells)
    return rows
