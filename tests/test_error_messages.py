"""Each mistake a new user makes gets one line that names the argument and the fix, no traceback.

Library mistakes raise at `inject_observer` (before the model or the disk change) or at
`remove_observer`; command-line mistakes exit 1 with one line on stderr, checked in a real
process where a traceback used to show.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_rank_parent_readers import observe_rank
from torch import nn

from torchinstruments import (
    AbsMax,
    DefaultStatistics,
    EveryNForwardsSampler,
    HistoryConfig,
    TensorBoardSink,
    TimeIntervalSampler,
    inject_observer,
    remove_observer,
    set_step,
)
from torchinstruments.__main__ import main
from torchinstruments.integrations._fit import FitObservation

from conftest import run_cli


def cli_error(*args: str | Path) -> str:
    """The one stderr line of a command that fails with exit code 1."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    assert code == 1, (out.getvalue(), err.getvalue())
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("runs") / "experiment" / "baseline"
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    inject_observer(model, output_dir=directory)
    model(torch.randn(3, 2)).sum().backward()
    remove_observer(model)
    return directory


@pytest.mark.parametrize("option", ["selector", "histogram_selector"])
def test_a_class_as_selector_says_to_write_a_function(option: str, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    options: dict[str, Any] = {option: nn.Linear}  # what a type checker would refuse, at run time
    with pytest.raises(TypeError) as caught:
        inject_observer(model, output_dir=tmp_path / "run", **options)
    message = str(caught.value)
    assert message.startswith(f"{option}=Linear is a class, not a function")
    assert f"{option}=lambda name, module: isinstance(module, Linear)" in message
    assert not (tmp_path / "run").exists()  # refused before the disk changed
    assert "forward" not in model[0].__dict__  # and before the model changed


@pytest.mark.parametrize("option", ["selector", "histogram_selector"])
def test_a_one_argument_selector_says_how_it_is_called(option: str, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    options: dict[str, Any] = {option: lambda module: isinstance(module, nn.Linear)}
    with pytest.raises(TypeError) as caught:
        inject_observer(model, output_dir=tmp_path / "run", **options)
    message = str(caught.value)
    assert message.startswith(
        f"{option}=<lambda>(module) cannot be called as {option}(name, module)"
    )
    assert "lambda name, module:" in message
    assert not (tmp_path / "run").exists()


def _raises_on_relu(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.ReLU):
        raise KeyError("no ReLU here")
    return True


@pytest.mark.parametrize("option", ["selector", "histogram_selector"])
def test_a_raising_selector_is_named_with_the_module_it_failed_on(
    option: str, tmp_path: Path
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    options: dict[str, Any] = {option: _raises_on_relu}
    with pytest.raises(ValueError, match="no ReLU here") as caught:
        inject_observer(model, output_dir=tmp_path / "run", **options)
    assert str(caught.value).startswith(
        f"{option} raised KeyError: 'no ReLU here' when asked about module '1' (ReLU)"
    )
    assert isinstance(caught.value.__cause__, KeyError)
    assert not (tmp_path / "run").exists()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("option", ["selector", "histogram_selector"])
@pytest.mark.parametrize("answer", ["no", torch.tensor([True, True]), 1, None], ids=repr)
def test_a_selector_answer_that_is_not_a_bool_is_refused_naming_it(
    option: str, answer: object, tmp_path: Path
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    options: dict[str, Any] = {option: lambda name, module: answer if name == "0" else True}
    with pytest.raises(TypeError) as caught:
        inject_observer(model, output_dir=tmp_path / "run", **options)
    assert str(caught.value) == (
        f"{option} returned {answer!r} for module '0' (Linear); it must return a bool (True to "
        "select the module)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("option", ["selector", "histogram_selector"])
@pytest.mark.parametrize("yes", [np.bool_(True), torch.tensor(True)], ids=repr)
def test_numpy_and_tensor_bools_are_selector_answers(
    option: str, yes: object, tmp_path: Path
) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    options: dict[str, Any] = {option: lambda name, module: yes if name == "0" else False}
    inject_observer(model, output_dir=tmp_path / "run", **options)
    model(torch.randn(1, 2)).sum().backward()
    remove_observer(model)
    assert (tmp_path / "run" / "history.parquet").is_file()


def test_remove_observer_of_a_name_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"model must be the nn.Module given to inject_observer"):
        remove_observer("model")  # type: ignore[arg-type]


def test_a_mistyped_run_directory_does_not_exist(finished: Path) -> None:
    wrong = finished.parent / "baselin"
    for command in ("show", "plot", "heatmap"):
        line = cli_error(command, wrong)
        assert (
            line
            == f"torchinstruments {command}: {wrong} does not exist: pass a run's output directory"
        )
    line = cli_error("compare", finished, wrong)
    assert f"{wrong} does not exist" in line


def test_a_mistyped_directory_with_rank_or_compared_alone_is_not_called_one_run(
    finished: Path, tmp_path: Path
) -> None:
    """`compare DIR` (its ranks) and `--rank` need a directory of rank runs; a typo or an empty
    folder is said to be what it is, not "one run"."""
    wrong = finished.parent / "baselin"
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (
        ("compare", wrong),
        ("compare", wrong, "--rank", "0,1"),
        ("show", wrong, "--rank", "1"),
        ("plot", wrong, "--rank", "1"),
    ):
        line = cli_error(*args)
        assert line == (
            f"torchinstruments {args[0]}: {wrong} does not exist: pass a run's output directory"
        )
    line = cli_error("show", empty, "--rank", "1")
    assert line == (
        f"torchinstruments show: {empty} holds no run: neither history.parquet nor history.parts/"
    )


def test_heatmap_on_a_missing_run_blames_the_run_not_the_output_folder(finished: Path) -> None:
    line = cli_error("heatmap", finished.parent / "nothing")
    assert "does not exist" in line
    assert "output-dir" not in line


def test_heatmap_into_a_missing_folder_names_the_option(finished: Path, tmp_path: Path) -> None:
    line = cli_error("heatmap", finished, "-o", tmp_path / "no" / "such")
    assert "-o/--output-dir" in line
    assert "create it" in line


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of two rank runs, as torchrun's ranks write it with rank_policy="all"."""
    directory = tmp_path_factory.mktemp("ranks") / "stats"
    for rank in range(2):
        observe_rank(directory, rank)
    return directory


@pytest.mark.parametrize("of", ["run", "parent"])
def test_plot_into_a_missing_folder_or_not_a_png_names_the_option_for_a_run_and_a_parent(
    finished: Path, parent: Path, of: str, tmp_path: Path
) -> None:
    """Checked before drawing, for a parent of rank runs as for a run (a parent's plot used to
    draw, then end in a traceback at the save)."""
    directory = finished if of == "run" else parent
    missing = tmp_path / "missing" / "plot.png"
    assert cli_error("plot", directory, "-o", missing) == (
        f"torchinstruments plot: -o {missing}: the folder {missing.parent} does not exist; "
        "create it, or choose a PNG path in an existing folder"
    )
    for name in ("plot.svg", "plot"):  # the file would hold a PNG whatever its name says
        assert cli_error("plot", directory, "-o", tmp_path / name) == (
            f"torchinstruments plot: -o {tmp_path / name}: plot writes a PNG image; give a "
            "file name ending in .png"
        )
        assert not (tmp_path / name).exists()
    folder = tmp_path / "plot.png"  # a folder's name ending in .png: the save raised
    folder.mkdir(exist_ok=True)
    assert cli_error("plot", directory, "-o", folder) == (
        f"torchinstruments plot: -o {folder} is a folder; give the PNG file's path in it, such as "
        f"{folder / 'trends.png'}"
    )
    assert cli_error("heatmap", directory, "-o", missing.parent) == (
        f"torchinstruments heatmap: -o/--output-dir {missing.parent} is not an existing "
        "folder; create it, or choose an existing one"
    )


def test_heatmap_on_an_empty_run_says_it_recorded_no_rows(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=tmp_path / "empty")
    with pytest.warns(RuntimeWarning, match="no sample was recorded"):
        remove_observer(model)  # never called: no sample
    for command in ("heatmap", "show", "plot"):
        line = cli_error(command, tmp_path / "empty")
        assert "recorded no rows" in line, line
        assert "only nothing" not in line


def test_plot_into_a_missing_folder_is_one_line_in_a_real_process(
    finished: Path, tmp_path: Path
) -> None:
    result = run_cli("plot", finished, "-o", tmp_path / "missing" / "plot.png")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"torchinstruments plot: -o {tmp_path / 'missing' / 'plot.png'}: ")
    assert f"the folder {tmp_path / 'missing'} does not exist; create it" in line


def test_show_on_a_parent_of_runs_lists_the_runs_below(finished: Path) -> None:
    sibling = finished.parent / "broken"
    model = nn.Sequential(nn.Linear(2, 2))
    inject_observer(model, output_dir=sibling)
    model(torch.randn(1, 2))
    remove_observer(model)
    line = cli_error("show", finished.parent.parent)
    assert "holds no run itself but 2 below it (experiment/baseline, experiment/broken)" in line
    assert str(finished) in line


def test_a_folder_below_that_cannot_be_read_is_passed_over_when_naming_the_runs_below(
    finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`show` of a folder that holds no run looks for runs below it; a directory there it may
    not list (another user's, a `/proc` entry under `show /`) is passed over, not a traceback."""
    top = tmp_path / "shared"
    locked = top / "someone_else" / "private"
    locked.mkdir(parents=True)
    shutil.copytree(finished, top / "runs" / "baseline")
    locked.chmod(0)
    listdir = Path.iterdir

    def as_the_os_does_for_another_user(self: Path) -> Any:
        if self == locked:  # root may list it anyway: refuse as the OS does for other users
            raise PermissionError(13, "Permission denied", str(self))
        return listdir(self)

    monkeypatch.setattr(Path, "iterdir", as_the_os_does_for_another_user)
    try:
        line = cli_error("show", top)
    finally:
        locked.chmod(0o755)
    assert "holds no run itself but 1 below it (runs/baseline)" in line


# -- One style for every refused argument --------------------------------------------------------
# Each mistake: (what the user wrote, the argument, how its value is shown, the fix or the allowed
# values). The message must be one line holding all three, so it says what was wrong, where, and
# what to write instead.


def _inject(**options: Any) -> Callable[[Path], object]:
    return lambda run: inject_observer(nn.Sequential(nn.Linear(2, 2)), output_dir=run, **options)


def _no_output_dir(value: object) -> Callable[[Path], object]:
    return lambda run: inject_observer(nn.Linear(2, 2), output_dir=value)  # type: ignore[arg-type]


def _fit(**arguments: Any) -> Callable[[Path], object]:
    options = arguments.pop("options", {})
    return lambda run: FitObservation("Callback", None, options=options, **arguments)


MISTAKES: list[tuple[str, Callable[[Path], object], str, str, str]] = [
    ("sampler object", _inject(sampler=object()), "sampler", "<object object", "should_sample"),
    (
        "sampler class",
        _inject(sampler=EveryNForwardsSampler),
        "sampler",
        "EveryNForwardsSampler",
        "sampler=EveryNForwardsSampler(...)",
    ),
    (
        "max_histogram_modules",
        _inject(max_histogram_modules=0),
        "max_histogram_modules",
        "0",
        ">= 1",
    ),
    ("rank_policy", _inject(rank_policy="every"), "rank_policy", "'every'", "'rank0', 'all'"),
    (
        "history_config",
        _inject(history_config={"window": 3}),
        "history_config",
        "{'window': 3}",
        "history_config=HistoryConfig(window=20)",
    ),
    (
        "capture_direct_forwards",
        _inject(capture_direct_forwards="yes"),
        "capture_direct_forwards",
        "'yes'",
        "True or False",
    ),
    ("resume", _inject(resume=1), "resume", "1", "True (continue"),
    ("sinks", _inject(sinks=[object()]), "sinks", "<object object", "a Sink has start"),
    ("reducers object", _inject(reducers=[object()]), "reducers[0]", "<object object", "mapping"),
    ("reducers class", _inject(reducers=[AbsMax]), "reducers[0]", "AbsMax", "reducers=[AbsMax()]"),
    (
        "reducers lambda",
        _inject(reducers=[lambda t: t.abs().max()]),
        "reducers[0]",
        "lambda",
        "def my_metric",
    ),
    ("reducers clash", _inject(reducers={"mean": len}), "reducers", "'mean'", "Rename"),
    ("global_statistics", _inject(global_statistics="yes"), "global_statistics", "'yes'", "True"),
    (
        "global_statistics without a group",
        _inject(global_statistics=True),
        "global_statistics",
        "True",
        "init_process_group",
    ),
    (
        "global_statistics_timeout type",
        _inject(global_statistics_timeout="10m"),
        "global_statistics_timeout",
        "'10m'",
        "datetime.timedelta",
    ),
    (
        "global_statistics_timeout zero",
        _inject(global_statistics_timeout=0),
        "global_statistics_timeout",
        "0",
        "never wait forever",
    ),
    (
        "global_statistics_timeout infinite",
        _inject(global_statistics_timeout=float("inf")),
        "global_statistics_timeout",
        "inf",
        "pass e.g. 600",
    ),
    ("output_dir type", _no_output_dir(3), "output_dir", "3", "str or os.PathLike"),
    ("output_dir empty", _no_output_dir(""), "output_dir", "''", "output_dir='stats'"),
    (
        "selector nothing",
        _inject(selector=lambda name, module: False),
        "selector",
        "'0'",
        "pass a selector that accepts",
    ),
    (
        "histogram_selector nothing",
        _inject(histogram_selector=lambda name, module: False),
        "histogram_selector",
        "'0'",
        "pass one that accepts",
    ),
    (
        "HistoryConfig window",
        lambda run: HistoryConfig(window=0),
        "window",
        "0",
        "an int >= 1",
    ),
    (
        "HistoryConfig cap",
        lambda run: HistoryConfig(buffer_rows=10, max_buffered_rows=5),
        "max_buffered_rows",
        "5",
        ">= buffer_rows (10",
    ),
    (
        "HistoryConfig flush",
        lambda run: HistoryConfig(flush_seconds=float("nan")),
        "flush_seconds",
        "nan",
        "> 0",
    ),
    ("EveryNForwardsSampler", lambda run: EveryNForwardsSampler(0), "n", "0", "a positive int"),
    (
        "TimeIntervalSampler",
        lambda run: TimeIntervalSampler(seconds=-1),
        "seconds",
        "-1",
        "a positive finite number",
    ),
    (
        "DefaultStatistics",
        lambda run: DefaultStatistics(metrics=("mean", "median")),
        "metrics",
        "'median'",
        "allowed: mean, std",
    ),
    (
        "TensorBoardSink logger",
        lambda run: TensorBoardSink(object()),  # type: ignore[arg-type]
        "logger",
        "<object object",
        "SummaryWriter",
    ),
    (
        "TensorBoardSink step",
        lambda run: TensorBoardSink(object(), step=3),  # type: ignore[arg-type]
        "step",
        "3",
        "lambda: trainer.global_step",
    ),
    ("set_step", lambda run: set_step(nn.Linear(1, 1), 1.5), "step", "1.5", "an integer or None"),  # type: ignore[arg-type]
    ("model", lambda run: inject_observer("net", output_dir=run), "model", "str", "nn.Module"),  # type: ignore[arg-type]
    (
        "model DataParallel",
        lambda run: inject_observer(
            nn.Sequential(nn.DataParallel(nn.Linear(2, 2))), output_dir=run
        ),
        "model",
        "model.0",
        "DistributedDataParallel",
    ),
    ("callback option", _fit(module=None, options={"samplr": 1}), "'samplr'", "samplr", "sampler,"),
    ("callback module", _fit(module=3), "module", "3", "an attribute path such as 'net'"),
    (
        "callback record_eval",
        _fit(module=None, record_eval="yes"),
        "record_eval",
        "'yes'",
        "False, True or a Sampler",
    ),
]


@pytest.mark.parametrize(
    ("call", "argument", "value", "fix"),
    [case[1:] for case in MISTAKES],
    ids=[case[0] for case in MISTAKES],
)
def test_each_mistake_is_one_line_naming_the_argument_its_value_and_the_fix(
    tmp_path: Path, call: Callable[[Path], object], argument: str, value: str, fix: str
) -> None:
    run = tmp_path / "run"
    with pytest.raises((TypeError, ValueError)) as caught:
        call(run)
    message = str(caught.value)
    assert "\n" not in message
    assert argument in message
    assert value in message
    assert fix in message
    assert not run.exists()  # refused before the disk changed


def test_finalize_on_a_directory_without_a_run_names_it_and_the_fix(tmp_path: Path) -> None:
    line = cli_error("finalize", tmp_path)
    assert line == (
        f"torchinstruments finalize: {tmp_path} holds no run: neither history.parts/ nor "
        "history.parquet exists; pass the output_dir a run wrote"
    )


@pytest.mark.parametrize(
    ("args", "argument", "value", "allowed"),
    [
        (("show", "--window", "0"), "--window", "got 0", "an int >= 1"),
        (("show", "--width", "-3"), "--width", "got '-3'", "an int >= 40"),
        (("show", "--width", "1"), "--width", "got '1'", "an int >= 40"),
        (("compare", "--width", "39"), "--width", "got '39'", "an int >= 40"),
        (("compare", "--tolerance", "-0.5"), "--tolerance", "got '-0.5'", "a number >= 0"),
        # not a number at all: the same words (argparse's own named a private function)
        (("show", "--window", "x"), "--window", "got 'x'", "an int >= 1"),
        (("plot", "--max-tensors", "2.5"), "--max-tensors", "got '2.5'", "an int >= 1"),
        (("compare", "--tolerance", "abc"), "--tolerance", "got 'abc'", "a number >= 0"),
        (("show", "--window", str(2**63)), "--window", f"got {2**63}", f"an int <= {2**63 - 1}"),
    ],
    ids=[
        "window",
        "width",
        "width-too-narrow",
        "compare-width-too-narrow",
        "tolerance",
        "window-not-a-number",
        "max-tensors-not-an-int",
        "tolerance-not-a-number",
        "window-past-int64",
    ],
)
def test_a_refused_command_line_number_names_the_option_its_value_and_what_is_allowed(
    finished: Path, args: tuple[str, ...], argument: str, value: str, allowed: str
) -> None:
    command, *options = args
    directories = [finished] * (2 if command == "compare" else 1)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main([command, *map(str, directories), *options])
    assert exited.value.code == 2  # argparse's usage error
    last = err.getvalue().splitlines()[-1]
    assert argument in last
    assert value in last
    assert allowed in last


NO_SUCH_USER = "~torchinstruments-no-such-user"


def test_an_output_dir_of_a_user_that_does_not_exist_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="output_dir='~torchinstruments-no-such-user/stats'"
    ) as error:
        inject_observer(nn.Linear(2, 2), output_dir=NO_SUCH_USER + "/stats")
    assert "./~torchinstruments-no-such-user" in str(error.value)  # what to do instead


@pytest.mark.parametrize("command", ["finalize", "show", "plot", "heatmap", "compare"])
def test_a_command_on_a_user_that_does_not_exist_says_it_in_one_line(command: str) -> None:
    done = run_cli(command, NO_SUCH_USER)
    assert done.returncode == 2  # a usage error
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"torchinstruments {command}: ")
    assert "~torchinstruments-no-such-user" in lines[0]
    assert "./~torchinstruments-no-such-user" in lines[0]


@pytest.mark.parametrize(
    "args",
    [("show", "-run"), ("compare", "-run", "b"), ("finalize", "-run")],
    ids=["show", "compare", "finalize"],
)
def test_a_directory_whose_name_starts_with_a_dash_is_named_with_how_to_pass_it(
    args: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse reads `-run` as an unknown option and said only that DIR is required (or that
    `-run` is not recognized): the last line names the directory and how to pass it."""
    (tmp_path / "-run").mkdir()
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2  # still argparse's usage error
    assert err.getvalue().splitlines()[-1] == (
        f"torchinstruments {args[0]}: error: -run is read as an option, but it is a path here: "
        "pass it as ./-run (or after --)"
    )


@pytest.mark.parametrize(("of", "name"), [("run", "mean"), ("parent", "ranks-mean")])
def test_a_picture_that_cannot_be_written_is_one_line_naming_it(
    finished: Path, parent: Path, of: str, name: str, tmp_path: Path
) -> None:
    """A folder where heatmap writes `heatmap-mean.png`: the write's error in one line that
    names the file, exit 1 (it ended in an IsADirectoryError traceback)."""
    (tmp_path / f"heatmap-{name}.png").mkdir()
    directory = finished if of == "run" else parent
    assert cli_error("heatmap", directory, "--metrics", "mean", "-o", tmp_path) == (
        "torchinstruments heatmap: IsADirectoryError: [Errno 21] Is a directory: "
        f"'{tmp_path / f'heatmap-{name}.png'}'"
    )
