"""Bad arguments fail at inject_observer, naming the argument, before the model or disk change."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from torchinstruments import (
    AbsMax,
    DefaultStatistics,
    EveryNForwardsSampler,
    HistoryConfig,
    ObserverConfig,
    TimeIntervalSampler,
    has_observer,
    inject_observer,
    remove_observer,
)

from conftest import mlp, read_history


class Clashing:
    def __init__(self, metrics: tuple[str, ...] = ("mean",)) -> None:
        self.metrics = metrics

    def __call__(self, tensor: torch.Tensor) -> dict[str, float]:
        return dict.fromkeys(self.metrics, 0.0)


class QuietSink:
    """A sink that receives and keeps nothing."""

    def start(self, run: object) -> None: ...
    def write_forward(self, record: object) -> None: ...
    def write_backward(self, record: object) -> None: ...
    def close(self, counts: object) -> None: ...


TWICE = QuietSink()  # listed twice, it received each record twice

# Options that are wrong whatever the model: ObserverConfig refuses them on its own.
BAD_OPTIONS = [
    ({"output_dir": 3}, TypeError, "output_dir"),
    ({"sampler": object()}, TypeError, "sampler"),
    ({"selector": "leaves"}, TypeError, "selector"),
    ({"histogram_selector": 1}, TypeError, "histogram_selector"),
    ({"max_histogram_modules": -1}, ValueError, "max_histogram_modules"),
    ({"max_histogram_modules": 0}, ValueError, "max_histogram_modules must be an int >= 1"),
    ({"max_histogram_modules": 2.5}, ValueError, "max_histogram_modules"),
    ({"history_config": {"buffer_rows": 5}}, TypeError, "history_config"),
    ({"rank_policy": "rank1"}, ValueError, "rank_policy"),
    ({"capture_direct_forwards": "yes"}, TypeError, "capture_direct_forwards"),
    ({"sinks": "tensorboard"}, TypeError, "sinks"),
    # A class passed the check (its methods are callable) and was detached at the run's start.
    ({"sinks": [QuietSink]}, TypeError, r"sinks\[0\] is the class QuietSink.*QuietSink\(\.\.\.\)"),
    ({"sinks": QuietSink()}, TypeError, r"pass one sink in a list, sinks=\[sink\]"),
    ({"sinks": [QuietSink(), TWICE, TWICE]}, TypeError, r"sinks\[2\] is sinks\[1\] again"),
    ({"reducers": [Clashing()]}, ValueError, "mean"),
    ({"reducers": [object()]}, TypeError, "reducers"),
    ({"reducers": [AbsMax]}, TypeError, r"reducers\[0\] is the class AbsMax.*instantiate"),
    ({"reducers": [lambda t: t.mean()]}, TypeError, r"reducers\[0\] is a lambda"),
    # A name UTF-8 cannot encode failed inside inject with a bare UnicodeEncodeError.
    ({"reducers": {"r\udc80": torch.mean}}, ValueError, r"metric name 'r\\udc80' is not UTF-8"),
    ({"reducers": [Clashing(("x\udcff",))]}, ValueError, r"reducers: metric name 'x\\udcff'"),
    # A 100,000-character name made index.md 150 KB (its bound: 64 KiB).
    ({"reducers": {"m" * 100_000: torch.mean}}, ValueError, r"is 100,000 characters long"),
    # A line break split index.md's metrics line; an escape reached the terminal through show.
    ({"reducers": {"a\nb": torch.mean}}, ValueError, r"'a\\nb' holds the control character"),
    ({"reducers": [Clashing(("c\x1b[2J",))]}, ValueError, r"control character '\\x1b'"),
]
# Options that are wrong for this model (selectors that select nothing of it).
BAD_FOR_THE_MODEL = [
    (
        {"selector": lambda n, m: False},
        ValueError,
        r"^selector matched no module of the model, so nothing would be observed: pass a "
        r"selector that accepts some of its modules: '', '0', '1', '2'",
    ),
    (
        {"histogram_selector": lambda n, m: False},
        ValueError,
        r"^histogram_selector matched no observed layer: pass one that accepts some of the "
        r"observed layers \(or None, for the first ones\): '0', '1'",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_OPTIONS + BAD_FOR_THE_MODEL)
def test_bad_argument_raises_naming_it_and_changes_nothing(
    run_dir: Path, kwargs: dict, error: type[Exception], match: str
) -> None:
    model = mlp()
    kwargs.setdefault("output_dir", run_dir)
    with pytest.raises(error, match=match):
        inject_observer(model, **kwargs)
    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not run_dir.exists()


def test_model_must_be_a_module(run_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        inject_observer(lambda x: x, output_dir=run_dir)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["buffer_rows", "window"])
@pytest.mark.parametrize("bad", [0, -3])
def test_history_config_rejects_non_positive_sizes(field: str, bad: int) -> None:
    with pytest.raises(ValueError, match=field):
        HistoryConfig(**{field: bad})


def test_default_statistics_rejects_unknown_metric() -> None:
    with pytest.raises(ValueError, match="p99"):
        DefaultStatistics(metrics=("mean", "p99"))


def test_output_dir_holding_a_run_is_refused(run_dir: Path) -> None:
    first = nn.Linear(2, 2)
    inject_observer(first, output_dir=run_dir)
    first(torch.randn(1, 2))
    remove_observer(first)
    second = nn.Linear(2, 2)
    with pytest.raises(FileExistsError, match="output_dir"):
        inject_observer(second, output_dir=run_dir)
    assert not has_observer(second)


def test_data_parallel_is_refused_at_inject(run_dir: Path) -> None:
    model = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="DataParallel"):
        inject_observer(model, output_dir=run_dir)
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("empty", ["", "   "])
def test_empty_output_dir_is_refused_naming_it(empty: str, tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="output_dir must name a directory"):
        inject_observer(model, output_dir=empty)
    assert not has_observer(model)
    assert "forward" not in model.__dict__


class _FsPath:
    """A path object whose `__fspath__` gives `value`, or raises it when it is an exception."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __fspath__(self) -> object:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value

    def __repr__(self) -> str:
        return "_FsPath()"


@pytest.mark.parametrize(
    ("output_dir", "error", "said"),
    [
        ("stats\x00old", ValueError, r"output_dir='stats\\x00old' holds a NUL character"),
        (_FsPath(b"stats"), TypeError, r"output_dir=_FsPath\(\) gives a bytes path"),
        (_FsPath(5), TypeError, r"output_dir=_FsPath\(\): os.fspath\(\) of it raised TypeError"),
        (_FsPath(OSError("mount gone")), TypeError, r"raised OSError: mount gone"),
    ],
    ids=["nul", "bytes", "int", "raises"],
)
def test_an_output_dir_no_path_can_be_made_of_is_refused_naming_it(
    output_dir: object, error: type[Exception], said: str, tmp_path: Path
) -> None:
    # A NUL character failed in Path.exists with a bare "embedded null byte"; a path object
    # giving bytes was called an empty name, and one that raised raised its own error.
    model = nn.Linear(2, 2)
    with pytest.raises(error, match=said):
        inject_observer(model, output_dir=output_dir)  # type: ignore[arg-type]
    assert "forward" not in model.__dict__


def test_output_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("mine", encoding="utf-8")
    model = nn.Linear(2, 2)
    with pytest.raises(FileExistsError, match=r"output_dir=.*notes\.txt.* is an existing file"):
        inject_observer(model, output_dir=existing)
    assert existing.read_text(encoding="utf-8") == "mine"
    assert "forward" not in model.__dict__


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_OPTIONS)
def test_observer_config_refuses_the_same_bad_arguments_without_a_model(
    run_dir: Path, kwargs: dict, error: type[Exception], match: str
) -> None:
    kwargs.setdefault("output_dir", run_dir)
    with pytest.raises(error, match=match):
        ObserverConfig(**kwargs)
    assert not run_dir.exists()


def test_observer_config_is_frozen_and_normalised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = ObserverConfig(output_dir="~/../relative", sinks=[])
    assert config.output_dir == Path("~/../relative").expanduser().absolute()
    assert isinstance(config.sampler, TimeIntervalSampler)
    assert config.history_config == HistoryConfig()
    assert config.sinks == ()
    with pytest.raises(AttributeError):
        config.rank_policy = "all"  # type: ignore[misc]


def test_observer_config_options_pass_through_to_inject_observer(run_dir: Path) -> None:
    config = ObserverConfig(
        output_dir=run_dir,
        sampler=EveryNForwardsSampler(2),
        history_config=HistoryConfig(window=3),
        max_histogram_modules=1,
    )
    model = mlp()
    assert inject_observer(model, **config.options()) == run_dir
    for _ in range(4):
        model(torch.randn(2, 8))
    remove_observer(model)
    history = read_history(run_dir)
    assert sorted(history["forward_index"].unique().to_list()) == [0, 2]


def test_inject_observer_and_observer_config_name_the_same_options_and_defaults() -> None:
    """The two spellings of the options (the signature, the config's fields) cannot drift."""
    parameters = inspect.signature(inject_observer).parameters
    signature = {name: p.default for name, p in parameters.items() if name != "model"}
    fields = {item.name: item.default for item in dataclasses.fields(ObserverConfig) if item.init}
    assert signature == fields
    # ... and its docstring's Args say what each one means, in the same order.
    doc = inspect.getdoc(inject_observer) or ""
    args = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0]
    documented = [line.split(":")[0].strip() for line in args.splitlines() if line[4:5] != " "]
    assert documented == ["model", *fields]


def test_the_readme_options_table_names_every_option_once() -> None:
    """README's table of options is held to the one list (ObserverConfig's fields)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Options and extension points", 1)[1].split("\n\n", 2)[1]
    named = [
        name.strip("` ")
        for line in table.splitlines()[2:]
        for name in line.split("|")[1].split(",")
    ]
    options = [item.name for item in dataclasses.fields(ObserverConfig) if item.init]
    assert sorted(named) == sorted(options)


def test_inject_observer_builds_one_config_and_the_run_keeps_it(
    run_dir: Path, config_builds: list[ObserverConfig]
) -> None:
    from torchinstruments.registry import OBSERVERS

    model = mlp()
    inject_observer(model, output_dir=run_dir, sampler=EveryNForwardsSampler(3))
    try:
        model(torch.randn(2, 8))
        assert len(config_builds) == 1
        assert OBSERVERS[model].config is config_builds[0]
        assert OBSERVERS[model].sampler is config_builds[0].sampler
    finally:
        remove_observer(model)


@pytest.mark.parametrize("folder", ["history.parts", "tensorboard"])
def test_an_output_dir_inside_another_runs_folder_is_refused_naming_it(
    tmp_path: Path, folder: str
) -> None:
    # It was accepted: its files mixed with the live run's, and that run's removal left it there.
    first, second = mlp(), mlp()
    inject_observer(first, output_dir=tmp_path / "a")
    try:
        with pytest.raises(ValueError, match=rf"is inside .*the {folder}/ folder of the run in "):
            inject_observer(second, output_dir=tmp_path / "a" / folder / "b")
    finally:
        remove_observer(first)
    assert not (tmp_path / "a" / folder / "b").exists()
    assert "forward" not in second.__dict__


def test_a_relative_output_dir_in_a_deleted_current_directory_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Path.absolute raised a bare FileNotFoundError, naming neither the argument nor a path.
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    model = nn.Linear(2, 2)
    with pytest.raises(FileNotFoundError, match=r"output_dir='stats' is relative, and the curr"):
        inject_observer(model, output_dir="stats")
    assert "forward" not in model.__dict__
