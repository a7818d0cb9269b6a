"""`ObserverConfig`: every option of `inject_observer`, validated once, frozen, passed down.

Design decision: the options are one frozen dataclass that validates itself when built. It is
built once per run and handed down as one object: by `inject_observer` from its keywords, or by
a trainer callback when the callback is built (so a mistake fails in the user's own line), and
`api.start_run` starts the run with that very object. The fields below are the one list of the
options (each default and each check); everything else derives from them (`OPTION_NAMES`,
`options()`, the callbacks' keyword check), except `inject_observer`'s signature, which spells
them out for readers and editors and is held to these fields by a test. A mistake fails while
the object is built, with a message naming the argument, before anything touches the model or
the disk.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torchinstruments.distributed import check_rank_policy
from torchinstruments.global_option import GlobalOption, check_global_statistics
from torchinstruments.history_config import HistoryConfig
from torchinstruments.loss_scale import check_grad_scaler
from torchinstruments.measurement.custom import ReducerSpec
from torchinstruments.measurement.reducers import Measurer
from torchinstruments.reasons import utf8_text
from torchinstruments.rundir.output_dir import resolve_output_dir
from torchinstruments.sampling import Sampler, TimeIntervalSampler, check_sampler
from torchinstruments.selection import Selector, check_selector
from torchinstruments.sinks.protocol import Sink, check_sinks

__all__ = ["OPTION_NAMES", "ObserverConfig", "check_option_names"]


@dataclass(frozen=True)
class ObserverConfig:
    """The options of one observed run; see `inject_observer` for what each one means.

    Building one checks every option and normalises it: `output_dir` becomes an absolute path
    (fixed for the life of the run), a None `sampler` or `history_config` becomes its default,
    `sinks` a tuple, and `reducers` is compiled into `measurer`.

    Raises:
        TypeError, ValueError: an option is invalid (the message names it).
        FileExistsError: `output_dir` names an existing file.
    """

    output_dir: str | os.PathLike[str] = "stats"
    sampler: Sampler | None = None
    selector: Selector | None = None
    reducers: Sequence[ReducerSpec] | Mapping[str, Callable[..., object]] | None = None
    histogram_selector: Selector | None = None
    max_histogram_modules: int = 8
    history_config: HistoryConfig | None = None
    rank_policy: str = "rank0"
    capture_direct_forwards: bool = True
    sinks: Sequence[Sink] = ()
    resume: bool = False
    global_statistics: Any = False
    global_statistics_timeout: Any = None
    grad_scaler: Any = None
    # The compiled reducers; built from `reducers`, never passed.
    measurer: Measurer = field(init=False, repr=False, compare=False)
    # The checked `global_statistics`; None when off.
    global_option: GlobalOption | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        output_dir: object = self.output_dir
        if not isinstance(output_dir, str | os.PathLike):
            raise TypeError(f"output_dir must be a str or os.PathLike, got {output_dir!r}")
        self._set("output_dir", resolve_output_dir(output_dir))
        sampler = TimeIntervalSampler() if self.sampler is None else self.sampler
        check_sampler(sampler)
        self._set("sampler", sampler)
        check_selector("selector", self.selector)
        check_selector("histogram_selector", self.histogram_selector)
        limit: object = self.max_histogram_modules
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(
                f"max_histogram_modules must be an int >= 1, got {limit!r}: "
                "histograms are always on; histogram_selector and max_histogram_modules choose "
                "which layers get them, never whether"
            )
        history_config = HistoryConfig() if self.history_config is None else self.history_config
        if not isinstance(history_config, HistoryConfig):
            raise TypeError(
                f"history_config must be a HistoryConfig or None, got {history_config!r}: pass "
                "e.g. history_config=HistoryConfig(window=20)"
            )
        self._set("history_config", history_config)
        self._set("rank_policy", check_rank_policy(self.rank_policy))
        direct: object = self.capture_direct_forwards
        if not isinstance(direct, bool):
            raise TypeError(f"capture_direct_forwards must be True or False, got {direct!r}")
        self._set("sinks", check_sinks(self.sinks))
        resume: object = self.resume
        if not isinstance(resume, bool):
            raise TypeError(
                f"resume must be True (continue the run already in output_dir) or False, got "
                f"{resume!r}"
            )
        check_grad_scaler(self.grad_scaler)
        measurer = Measurer(self.reducers)
        _check_text_metrics(measurer.metrics)
        self._set("measurer", measurer)
        self._set(
            "global_option",
            check_global_statistics(
                self.global_statistics, sampler, self.rank_policy, self.global_statistics_timeout
            ),
        )

    def _set(self, name: str, value: Any) -> None:
        """Store a normalised value on the frozen instance (only while it is being built)."""
        object.__setattr__(self, name, value)

    @property
    def directory(self) -> Path:
        """`output_dir`, resolved: the absolute path the run is placed under."""
        return Path(self.output_dir)

    @property
    def history(self) -> HistoryConfig:
        """`history_config`, never None once built."""
        assert isinstance(self.history_config, HistoryConfig)
        return self.history_config

    def options(self) -> dict[str, Any]:
        """The options as `inject_observer` keywords: `inject_observer(model, **config.options())`."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


# Unicode categories a metric name may not hold: control characters (line breaks, tabs, terminal
# escapes) and line or paragraph separators.
_CONTROL = frozenset({"Cc", "Zl", "Zp"})
# The longest metric name: each is a TensorBoard tag's last part and a word of index.md.
METRIC_NAME_CHARS = 200


def _check_text_metrics(metrics: Sequence[str]) -> None:
    """Refuse a metric name UTF-8 cannot encode (a lone surrogate, as `surrogateescape` decodes
    bytes that are not UTF-8): it failed the first write of the run's state, inside
    inject_observer, with a bare UnicodeEncodeError; the history's `metric` column and the
    run's files are UTF-8. Refuse a control character (a line break, an escape), which broke
    index.md's list of metrics and reached the terminal through `show`. Refuse one longer than `METRIC_NAME_CHARS`: index.md lists the
    metrics, and one name of 100,000 characters (a generated key) made it 150 KB, past its
    64 KiB bound."""
    for name in metrics:
        control = next((c for c in name if unicodedata.category(c) in _CONTROL), None)
        if control is not None:
            raise ValueError(
                f"reducers: metric name {name[:80]!r} holds the control character {control!r}: "
                "a line break split index.md's list of metrics, and an escape was printed raw "
                "to the terminal by `torchinstruments show`; name the metric with printable text"
            )
        if len(name) > METRIC_NAME_CHARS:
            raise ValueError(
                f"reducers: metric name {name[:40]!r}... is {len(name):,} characters long, over "
                f"the {METRIC_NAME_CHARS} a metric name may have (it names a TensorBoard tag and "
                "is listed in index.md): give the metric a short name"
            )
        if utf8_text(name) != name:
            raise ValueError(
                f"reducers: metric name {name!r} is not UTF-8 text (it holds a lone surrogate, "
                "as bytes decoded with 'surrogateescape' give), which the history's metric "
                "column and the run's files cannot hold: name the metric with UTF-8 text, e.g. "
                f"{utf8_text(name)!r}"
            )


# The options' names, in the order of the fields: what `inject_observer` takes besides the model.
OPTION_NAMES = tuple(item.name for item in fields(ObserverConfig) if item.init)


def check_option_names(owner: str, names: Iterable[str]) -> None:
    """Refuse a keyword that is not an option, listing the options (a callback's `**options`).

    Raises:
        TypeError: naming the first unknown keyword and the allowed ones.
    """
    for name in names:
        if name not in OPTION_NAMES:
            raise TypeError(
                f"{owner}: {name!r} is not an option of inject_observer; the options are "
                f"{', '.join(OPTION_NAMES)}"
            )
