"""After a kill, the count of the model's calls during backward passes is a lower bound.

The live run saves its notes in its state file at the flush thread's rounds, so the count of
recomputed calls that a note carries is as of the last round. The child runs STEPS steps of
a model checkpointed whole (each backward calls it once more: STEPS such calls) and is killed
before any later round: the page `finalize` writes must not state the count of the last round
as the run's (it said "once"), but as what it is, a lower bound.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchinstruments import EveryNForwardsSampler, inject_observer
from torchinstruments.rundir.finish import finalize

from conftest import kill_when_ready

STEPS = 6


def child_main(directory: Path) -> None:
    """STEPS steps of whole-model non-reentrant checkpointing, then wait to be killed."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    inject_observer(model, output_dir=directory, sampler=EveryNForwardsSampler(2))
    for _ in range(STEPS):
        x = torch.randn(4, 3, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).sum().backward()
    print("stepped", flush=True)
    time.sleep(120)


def test_a_killed_runs_recomputed_calls_are_a_lower_bound_never_a_stale_count(
    tmp_path: Path,
) -> None:
    run = tmp_path / "stats"
    kill_when_ready(__file__, "stepped", run)
    finalize(run)
    index = (run / "index.md").read_text(encoding="utf-8")
    said = re.findall(r"called during a backward pass at least (once|(\d+) times) \(up to", index)
    assert len(said) == 1
    assert int(said[0][1] or 1) <= STEPS
    assert not re.search(r"called during a backward pass (once|\d+ times) \(activation", index)


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
