"""A Hugging Face script whose `train()` raised outside the training step and then ended (the
exception uncaught, caught, or `sys.exit` in a callback): the run is finished at the process's
exit with the note that the fit ended there, naming the exception where Python kept it.

Importing transformers' Trainer takes seconds, so one interpreter imports it and then forks one
child per ending, all at once: the child runs the rest of the script (the model, the
fit, its end) as its own and ends as that script would, through the interpreter's exit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from conftest import run_status

SCRIPT = textwrap.dedent(
    """
    import gc
    import json
    import os
    import sys
    import torch
    from transformers import (
        BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments,
    )
    from torchinstruments import EveryNForwardsSampler
    from torchinstruments.integrations import HuggingFaceObserver

    def forked_ending(root):
        # Each ending in a child forked from here, all at once, its stderr in a file: the child
        # returns its ending; this process writes each child's exit status and ends at once.
        # The objects imported so far are frozen (`_forked.before_forking` says why).
        pids = {}
        for ending in sys.argv[2:]:
            os.makedirs(os.path.join(root, ending))
            sys.stdout.flush()
            sys.stderr.flush()
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                err = os.open(os.path.join(root, ending, "stderr"), os.O_WRONLY | os.O_CREAT)
                os.dup2(err, 2)
                return ending
            pids[ending] = pid
        codes = {e: os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for e, p in pids.items()}
        with open(os.path.join(root, "codes.json"), "w") as out:
            json.dump(codes, out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # without the teardown (`_forked.ended`)

    ending = forked_ending(sys.argv[1])
    output_dir = os.path.join(sys.argv[1], ending, "out")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, num_labels=2,
    ))
    data = [
        {"input_ids": torch.randint(0, 32, (6,)), "labels": torch.tensor(i % 2)}
        for i in range(12)
    ]

    class BoomSGD(torch.optim.SGD):  # the second optimizer step raises: global step 1
        steps = 0

        def step(self, closure=None):
            BoomSGD.steps += 1
            if BoomSGD.steps == 2:
                raise RuntimeError("boom in the optimizer step")
            return super().step(closure)

    class ExitAtStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                sys.exit(3)

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=output_dir, max_steps=3, per_device_train_batch_size=4,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        ),
        train_dataset=data,
        callbacks=[HuggingFaceObserver(sampler=EveryNForwardsSampler(1))]
        + ([ExitAtStepEnd()] if ending == "sys.exit" else []),
        optimizers=(BoomSGD(model.parameters(), lr=1e-3), None),
    )
    if ending == "caught":
        try:
            trainer.train()
        except RuntimeError:
            pass
        raise ValueError("after the fit")  # not the fit's: never named as its end
    trainer.train()
    """
)

RAISED = (
    "the fit ended at global step 1 without on_train_end: train() raised outside the training step"
)


ENDINGS = [
    ("uncaught", 1, ": RuntimeError: boom in the optimizer step;"),
    ("caught", 1, None),
    ("sys.exit", 3, None),
]


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """Every ending's script run once, each in `root/<ending>`; their exit statuses."""
    root = tmp_path_factory.mktemp("endings")
    endings = [ending for ending, _, _ in ENDINGS]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), *endings],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return root, json.loads((root / "codes.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(("ending", "code", "named"), ENDINGS)
def test_a_script_that_ended_after_train_raised_says_so_at_its_exit(
    ended: tuple[Path, dict[str, int]], ending: str, code: int, named: str | None
) -> None:
    root, codes = ended
    assert codes[ending] == code, (root / ending / "stderr").read_text(encoding="utf-8")
    run = root / ending / "out" / "torchinstruments"
    assert run_status(run) == "complete"  # every row it recorded is in history.parquet
    index = " ".join((run / "index.md").read_text(encoding="utf-8").split())
    assert RAISED in index
    assert "HuggingFaceObserver saw it at the process's exit and finished the run then" in index
    if named is not None:
        assert RAISED + " (in an evaluation" in index
        assert named in index
    else:  # nothing Python kept came out of train(): no exception is named, none is blamed
        assert "step (in an evaluation, another callback, the data collator or the optimizer " \
            "step, of which transformers tells callbacks nothing); HuggingFaceObserver" in index  # fmt: skip
        assert "ValueError" not in index
    notes = json.loads((run / ".state.json").read_text(encoding="utf-8"))["notes"]
    assert sum(RAISED in note for note in notes) == 1
    assert not any("remove_observer was not called" in note for note in notes)  # the fit's note
    # the samples before the exception, and no other: steps 0 and 1 (sys.exit: step 0 only)
    steps = pl.read_parquet(run / "history.parquet")["forward_index"].unique().sort()
    assert steps.to_list() == ([0] if ending == "sys.exit" else [0, 1])
