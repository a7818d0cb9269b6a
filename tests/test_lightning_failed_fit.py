"""A Lightning fit that raised anywhere (a validation step, another callback, Ctrl-C in a training
step, a SIGTERM that Lightning turns into `SIGTERMException`): Lightning calls `on_exception`, so
`LightningObserver` finishes the run there, as interrupted with the truth in index.md, restores
the forwards, and a second fit is a fresh one."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments import EveryNForwardsSampler, has_observer
from torchinstruments.integrations import LightningObserver

from conftest import read_history, run_status


class Failing(lightning.LightningModule):
    """One Linear layer; raises `error` where `where` says, at global step 2."""

    def __init__(self, where: str | None, error: BaseException) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.where, self.error = where, error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        if self.where == "forward" and torch.is_grad_enabled() and self.global_step == 2:
            raise self.error  # after the layer returned: a sample with output rows, marked
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.where == "training_step" and self.global_step == 2:
            raise self.error
        loss = self(batch[0]).sum()
        if self.where == "loss" and self.global_step == 2:
            raise self.error  # after the forward, before the backward
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.where == "validation_step" and self.global_step == 2:
            raise self.error
        self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RaiseAfterBatch(lightning.Callback):
    """Another callback that raises after the second training batch."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 2:
            raise self.error


def fit(tmp_path: Path, model: Failing, callbacks: list[Any]) -> None:
    def data() -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)

    lightning.Trainer(
        default_root_dir=tmp_path, max_steps=4, val_check_interval=2, num_sanity_val_steps=0,
        callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    ).fit(model, data(), data())  # fmt: skip


@pytest.mark.parametrize(
    ("where", "error", "said"),
    [
        (
            "validation_step",
            RuntimeError("boom"),
            "ended with an exception at global step 2: RuntimeError: boom.",
        ),
        (
            "forward",
            RuntimeError("boom"),
            "ended with an exception at global step 2: RuntimeError: boom.",
        ),
        (
            "loss",
            RuntimeError("boom"),
            "ended with an exception at global step 2: RuntimeError: boom.",
        ),
        (
            "callback",
            RuntimeError("boom"),
            "ended with an exception at global step 2: RuntimeError: boom.",
        ),
        # Ctrl-C, said as such; no message: no colon
        (
            "training_step",
            KeyboardInterrupt(),
            "was interrupted with an exception at global step 2: KeyboardInterrupt.",
        ),
    ],
)
def test_a_fit_that_raised_is_finished_where_it_stopped_and_the_next_fit_is_fresh(
    tmp_path: Path, where: str, error: BaseException, said: str
) -> None:
    model = Failing(where, error)
    observer = LightningObserver(sampler=EveryNForwardsSampler(1))
    callbacks: list[Any] = [observer, RaiseAfterBatch(error)] if where == "callback" else [observer]
    sigint = signal.getsignal(signal.SIGINT)
    try:  # Lightning turns a KeyboardInterrupt into SystemExit(1), ignoring SIGINT from then on
        with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
            fit(tmp_path, model, callbacks)
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert not has_observer(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    run = tmp_path / "torchinstruments"
    assert observer.directory == run
    assert run_status(run) == "complete"
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert f"the fit {said} The run holds" in index
    # Steps 0 and 1 trained; step 2's training step raised before its forward (Ctrl-C), or
    # never came (the validation at step 2 and the callback after batch 1 raised first), or
    # its forward raised: a sample marked `interrupted`, or its loss did: a sample with output
    # rows only. The traceback Lightning holds keeps their outputs alive at removal; neither is
    # said to await a backward run after it, the second is said to be cut by the exception.
    history = read_history(run)
    trained = sorted(history.filter(history["mode"] == "train")["step"].unique())
    assert trained == ([0, 1, 2] if where in ("forward", "loss") else [0, 1])
    marked = history.filter(history["metric"] == "interrupted")
    assert marked["step"].to_list() == ([2] if where == "forward" else [])
    assert "when remove_observer was called" not in index
    cut = (
        "**Note:** sample 2: no gradient had reached its outputs when the fit ended with "
        "RuntimeError at global step 2: the exception came after its forward and before its "
        "backward (the training step raised in its loss or its backward), so it has output "
        "rows and no output_gradient rows"
    )
    assert (cut in index) == (where == "loss")

    model.where = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing left of the first fit to say
        fit(tmp_path, model, [observer])
    assert observer.directory == tmp_path / "torchinstruments-2"
    assert run_status(tmp_path / "torchinstruments-2") == "complete"
    assert not has_observer(model)


class TerminateAfterBatch(lightning.Callback):
    """The job is preempted: SIGTERM to this process after the second training batch."""

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 2 and not trainer.received_sigterm:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_ends_the_fit_the_way_lightning_ends_it_and_the_run_says_so(
    tmp_path: Path,
) -> None:
    """Lightning installs its SIGTERM handler after `on_fit_start` (over the observer's, which
    it calls) and ends the fit with `SIGTERMException`, a SystemExit its loggers and callbacks
    see. The observer's handler writes the rows and returns: the process is not killed in
    Lightning's place (exit status 143, the run left unfinished)."""
    model = Failing(None, RuntimeError())
    observer = LightningObserver(sampler=EveryNForwardsSampler(1))
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SIGTERMException):
            fit(tmp_path, model, [observer, TerminateAfterBatch()])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert not has_observer(model)
    run = tmp_path / "torchinstruments"
    assert run_status(run) == "complete"
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert "the fit ended with an exception at global step 2: SIGTERMException. The run" in index
    history = read_history(run)
    assert sorted(history.filter(history["mode"] == "train")["step"].unique()) == [0, 1]
