"""TorchInstruments: activation and output-gradient telemetry for PyTorch, without hooks.

`inject_observer(model, output_dir="stats")`, train as usual, `remove_observer(model)`. See
`index.md` in the run directory for what was written and how to query it.
"""

from torchinstruments.api import has_observer, inject_observer, remove_observer
from torchinstruments.history import HistoryConfig
from torchinstruments.records import (
    HistogramRecord,
    LayerInfo,
    Measurement,
    MetricValue,
    RunCounts,
    RunInfo,
    SampleRecord,
)
from torchinstruments.sampling import EveryNForwardsSampler, Sampler, TimeIntervalSampler
from torchinstruments.sinks import DirectorySink, Sink, TensorBoardSink
from torchinstruments.statistics import DEFAULT_METRICS, DefaultStatistics, Reducer

__all__ = [
    "DEFAULT_METRICS",
    "DefaultStatistics",
    "DirectorySink",
    "EveryNForwardsSampler",
    "HistogramRecord",
    "HistoryConfig",
    "LayerInfo",
    "Measurement",
    "MetricValue",
    "Reducer",
    "RunCounts",
    "RunInfo",
    "SampleRecord",
    "Sampler",
    "Sink",
    "TensorBoardSink",
    "TimeIntervalSampler",
    "has_observer",
    "inject_observer",
    "remove_observer",
]
