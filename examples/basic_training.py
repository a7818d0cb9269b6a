"""The README's quick start, runnable as is: `uv run examples/basic_training.py`.

Why a file of its own: the README's code must work when pasted, so this file holds it verbatim
and tests/test_examples.py checks that both say the same thing and that both run. A tiny MLP
learns a deterministic synthetic task (does x0 * x1 have a positive sign?) for 300 steps;
one step in 50 is sampled. It writes `stats/run-<time>/` in the current directory.
"""

import time
from pathlib import Path

import polars as pl
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

torch.manual_seed(0)
inputs = torch.randn(2048, 20)
targets = (inputs[:, 0] * inputs[:, 1] > 0).long()  # a deterministic synthetic task
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

output_dir = Path("stats") / time.strftime("run-%Y%m%d-%H%M%S")  # a run needs a new directory
inject_observer(model, output_dir=output_dir, sampler=EveryNForwardsSampler(50))
for _ in range(300):  # your training loop, unchanged
    batch = torch.randint(0, len(inputs), (64,))
    loss = nn.functional.cross_entropy(model(inputs[batch]), targets[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
remove_observer(model)  # restores the model; writes history.parquet, result.json, index.md

print(f"artifacts: {output_dir}/ (start with index.md)")
history = pl.read_parquet(output_dir / "history.parquet")
zeros = history.filter(
    pl.col("module_type") == "ReLU",
    pl.col("signal") == "output",
    pl.col("metric") == "zero_fraction",
).pivot("layer", index=["sample_id", "forward_index"], values="value")
print("zero_fraction (share of exact zeros) of each ReLU's output; forward_index = training step")
print(zeros.rename({layer: f"ReLU {layer!r}" for layer in zeros.columns[2:]}))
