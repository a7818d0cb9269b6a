"""Which run a resumed fit continues: the checkpoint's, even in a new logger version or from an
older run's checkpoint; one that is gone, or that a checkpoint does not name, said in index.md;
an explicit output_dir wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal
from test_huggingface_callback import examples, tiny_bert
from transformers import Trainer, TrainingArguments

from torchinstruments import EveryNForwardsSampler
from torchinstruments.integrations import HuggingFaceObserver, LightningObserver
from torchinstruments.rundir.state import read_state

from _resumed_fits import FIRST, TOTAL, check_continued, lightning_fit
from conftest import read_spans


def versioned_fit(tmp_path: Path, max_steps: int, ckpt: Path | None, **options: object) -> Path:
    """`lightning_fit` with the default auto-versioned TensorBoardLogger (each trainer writes a
    new `logs/version_N`); returns the callback's run directory."""
    callback = LightningObserver(sampler=EveryNForwardsSampler(1), **options)  # type: ignore[arg-type]
    trainer = lightning_fit(tmp_path, max_steps, ckpt, callback, version=None)
    if ckpt is None:
        trainer.save_checkpoint(tmp_path / "step3.ckpt")
    assert callback.directory is not None
    return callback.directory


def test_a_fit_resumed_into_a_new_logger_version_continues_the_checkpoints_run(
    tmp_path: Path,
) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    assert run == tmp_path / "logs" / "version_0" / "torchinstruments"
    first = pl.read_parquet(run / "history.parquet")
    assert versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt") == run
    assert (tmp_path / "logs" / "version_1").is_dir()  # the logger moved on; the run did not
    assert not (tmp_path / "logs" / "version_1" / "torchinstruments").exists()
    check_continued(run, first)


def test_a_checkpoints_run_that_is_gone_is_named_in_index_md(tmp_path: Path) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    shutil.rmtree(run)
    with pytest.warns(RuntimeWarning, match="could not be continued"):
        later = versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt")
    assert later == tmp_path / "logs" / "version_1" / "torchinstruments"
    index = (later / "index.md").read_text(encoding="utf-8")
    assert f"whose run `{run}` could not be continued (`{run}` holds no run)" in index
    assert f"`{tmp_path / 'step3.ckpt'}`" in index


def test_a_lightning_checkpoint_that_names_no_run_says_the_run_starts_at_its_step(
    tmp_path: Path,
) -> None:
    """A checkpoint saved without the callback: the resumed fit's logger version holds no run
    to continue, so a new one starts there at the checkpoint's step, and a warning and index.md
    say so (before, it read as a fresh fit whose first step happened to be 3), naming the
    checkpoint as it is (a backtick, `|`, Markdown's characters, a line break)."""
    versioned_fit(tmp_path, FIRST, None)
    saved = torch.load(tmp_path / "step3.ckpt", weights_only=False)
    assert set(saved["callbacks"]) == {"LightningObserver"}
    del saved["callbacks"]["LightningObserver"]
    plain = tmp_path / "pl`ain | *a_b_* [c](d)\n<e>.ckpt"
    torch.save(saved, plain)
    with pytest.warns(RuntimeWarning, match="names no run") as caught:
        later = versioned_fit(tmp_path, TOTAL, plain)
    assert later == tmp_path / "logs" / "version_1" / "torchinstruments"
    history = pl.read_parquet(later / "history.parquet")
    assert sorted(history["step"].unique()) == list(range(FIRST, TOTAL))
    [note] = [
        line
        for line in (later / "index.md").read_text(encoding="utf-8").splitlines()
        if "which names no run" in line
    ]
    assert read_spans(note) == [str(plain), str(later)]  # each read back as itself
    assert note.startswith("**Note:** this fit resumed from the checkpoint ")
    assert (
        ", which names no run (written without LightningObserver, or by a torchinstruments "
        "release whose checkpoints did not keep it); LightningObserver started "
    ) in note
    assert (
        ", a new run, since trainer.log_dir holds no run to continue: its first samples are at "
        f"the checkpoint's step (global step {FIRST})"
    ) in note
    said = [str(w.message) for w in caught if "names no run" in str(w.message)]
    assert [read_spans(s) for s in said] == [[str(plain), str(later)]]


def test_an_explicit_output_dir_wins_over_the_checkpoints_run(tmp_path: Path) -> None:
    run = versioned_fit(tmp_path, FIRST, None)
    elsewhere = tmp_path / "elsewhere"
    assert versioned_fit(tmp_path, TOTAL, tmp_path / "step3.ckpt", output_dir=elsewhere) == (
        elsewhere
    )
    assert read_state(run).attempts[-1].attempt == 0  # the checkpoint's run is left as it was


def hf_fit(
    out: Path, max_steps: int, save: bool, resume: str | None, **options: Any
) -> HuggingFaceObserver:
    """A Trainer fit into `out` with a default-directory observer (every forward sampled),
    checkpointing every FIRST steps if `save`; returns the callback."""
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_strategy="steps" if save else "no",
        save_steps=FIRST,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **options,
    )
    callback = HuggingFaceObserver(sampler=EveryNForwardsSampler(1), max_histogram_modules=1)
    trainer = Trainer(
        model=tiny_bert(), args=args, train_dataset=examples(32), callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=resume)
    return callback


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_an_hf_train_resumed_from_an_older_runs_checkpoint_continues_that_run(
    tmp_path: Path, restore_callback_states: bool
) -> None:
    """Two fits into one output_dir (the second a fresh one, torchinstruments-2), then a resume
    from the first fit's checkpoint: the checkpoint names its run, which the resumed fit
    continues; the later run is left as it was. With restore_callback_states_from_checkpoint,
    which rebuilds a callback whose class name the checkpoint keeps from its saved arguments,
    the user's callback (its sampler samples every forward) is the one that observes."""
    out = tmp_path / "out"
    first_run, later_run = out / "torchinstruments", out / "torchinstruments-2"
    assert hf_fit(out, FIRST, True, None).directory == first_run
    assert hf_fit(out, 2, False, None).directory == later_run
    first = pl.read_parquet(first_run / "history.parquet")
    later = pl.read_parquet(later_run / "history.parquet")
    resumed = hf_fit(
        out,
        TOTAL,
        False,
        str(out / f"checkpoint-{FIRST}"),
        restore_callback_states_from_checkpoint=restore_callback_states,
    )
    assert resumed.directory == first_run
    check_continued(first_run, first)
    assert_frame_equal(pl.read_parquet(later_run / "history.parquet"), later)
    assert [a.attempt for a in read_state(later_run).attempts] == [0]


def test_an_hf_checkpoint_that_names_no_run_says_which_run_was_continued(tmp_path: Path) -> None:
    """A checkpoint whose trainer_state.json keeps no run (written before checkpoints kept it):
    the resumed fit continues the last run under output_dir, and a warning and index.md say that
    it may not be the run that wrote the checkpoint."""
    out = tmp_path / "out"
    hf_fit(out, FIRST, True, None)
    later_run = out / "torchinstruments-2"
    assert hf_fit(out, 2, False, None).directory == later_run
    saved = out / f"checkpoint-{FIRST}" / "trainer_state.json"
    state = json.loads(saved.read_text(encoding="utf-8"))
    kept = state["stateful_callbacks"]
    assert kept.pop("torchinstruments.HuggingFaceObserver") == {
        "run_directory": str(out / "torchinstruments")
    }
    saved.write_text(json.dumps(state), encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="names no run"):
        resumed = hf_fit(out, TOTAL, False, str(saved.parent))
    assert resumed.directory == later_run
    index = " ".join((later_run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"this fit resumed from the checkpoint of global step {FIRST}, which names no run"
    ) in index
    assert f"continued `{later_run}`, the last run under args.output_dir, which may not" in index


def test_an_hf_checkpoints_run_that_is_gone_is_named_in_index_md(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = out / "torchinstruments"
    assert hf_fit(out, FIRST, True, None).directory == run
    shutil.rmtree(run)
    with pytest.warns(RuntimeWarning, match="could not be continued"):
        resumed = hf_fit(out, TOTAL, False, str(out / f"checkpoint-{FIRST}"))
    assert resumed.directory == run  # a new run where the gone one was, said in index.md
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert (
        f"this fit resumed from the checkpoint of global step {FIRST}, whose run `{run}` could "
        f"not be continued (`{run}` holds no run)"
    ) in index
