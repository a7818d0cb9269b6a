"""A run directory removed mid-run says what was lost, and an unknown count is said unknown.

A continued run whose earlier attempt was killed before any of its rows reached the disk, and
whose later attempt took no sample, knows no attempt's samples: its count is a bound of 0,
which is no count at all. The warning given when the directory is removed must say the number
is unknown, never "at least 0 samples" (a count nobody wrote is unknown, not 0).
"""

from __future__ import annotations

import shutil
import sys
import time
import warnings
from pathlib import Path

from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import kill_when_ready


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh())


def child_main(directory: Path) -> None:
    """An attempt that injects, takes no step, and waits to be killed."""
    inject_observer(model(), output_dir=directory, sampler=EveryNForwardsSampler(1))
    print("injected", flush=True)
    time.sleep(120)


def test_a_removed_directory_of_a_run_with_no_known_samples_says_the_count_is_unknown(
    tmp_path: Path,
) -> None:
    run = tmp_path / "stats"
    kill_when_ready(__file__, "injected", run)
    net = model()
    inject_observer(net, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    shutil.rmtree(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remove_observer(net)
    gone = [str(w.message) for w in caught if "no longer exists" in str(w.message)]
    assert len(gone) == 1
    assert "at least 0" not in gone[0]
    unknown = "samples (how many is unknown: no attempt's count of them is known) over 2 attempts"
    assert f"the run's {unknown} are lost" in gone[0]


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
