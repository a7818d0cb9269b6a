"""TorchInstruments: activation and output-gradient telemetry for PyTorch, without hooks.

`inject_observer(model, output_dir="stats")`, train as usual, `remove_observer(model)`. See
`index.md` in the run directory for what was written and how to query it.

The public names below are imported on first use (PEP 562), so `import torchinstruments` costs
nothing and the command line (`python -m torchinstruments finalize DIR`) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchinstruments._lazy import lazy_namespace

if TYPE_CHECKING:
    from torchinstruments.api import has_observer, inject_observer, remove_observer, set_step
    from torchinstruments.config import ObserverConfig
    from torchinstruments.history_config import HistoryConfig
    from torchinstruments.measurement.custom import AbsMax, L2Norm, Reducer
    from torchinstruments.measurement.reducers import DEFAULT_METRICS, DefaultStatistics
    from torchinstruments.records import (
        HistogramRecord,
        LayerInfo,
        Measurement,
        MeasurementBlock,
        MetricValue,
        RunCounts,
        RunInfo,
        SampleRecord,
    )
    from torchinstruments.sampling import EveryNForwardsSampler, Sampler, TimeIntervalSampler
    from torchinstruments.sinks.directory import DirectorySink
    from torchinstruments.sinks.protocol import Sink
    from torchinstruments.sinks.tensorboard import TensorBoardSink

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "DEFAULT_METRICS": "torchinstruments.measurement.reducers",
    "AbsMax": "torchinstruments.measurement.custom",
    "L2Norm": "torchinstruments.measurement.custom",
    "DefaultStatistics": "torchinstruments.measurement.reducers",
    "DirectorySink": "torchinstruments.sinks.directory",
    "EveryNForwardsSampler": "torchinstruments.sampling",
    "HistogramRecord": "torchinstruments.records",
    "HistoryConfig": "torchinstruments.history_config",
    "LayerInfo": "torchinstruments.records",
    "Measurement": "torchinstruments.records",
    "MeasurementBlock": "torchinstruments.records",
    "MetricValue": "torchinstruments.records",
    "ObserverConfig": "torchinstruments.config",
    "Reducer": "torchinstruments.measurement.custom",
    "RunCounts": "torchinstruments.records",
    "RunInfo": "torchinstruments.records",
    "SampleRecord": "torchinstruments.records",
    "Sampler": "torchinstruments.sampling",
    "Sink": "torchinstruments.sinks.protocol",
    "TensorBoardSink": "torchinstruments.sinks.tensorboard",
    "TimeIntervalSampler": "torchinstruments.sampling",
    "has_observer": "torchinstruments.api",
    "inject_observer": "torchinstruments.api",
    "remove_observer": "torchinstruments.api",
    "set_step": "torchinstruments.api",
}

__all__ = [
    "DEFAULT_METRICS",
    "AbsMax",
    "DefaultStatistics",
    "DirectorySink",
    "EveryNForwardsSampler",
    "HistogramRecord",
    "HistoryConfig",
    "L2Norm",
    "LayerInfo",
    "Measurement",
    "MeasurementBlock",
    "MetricValue",
    "ObserverConfig",
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
    "set_step",
]


__getattr__, __dir__ = lazy_namespace(__name__, globals(), _EXPORTS)
