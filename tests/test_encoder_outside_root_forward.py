"""An encoder-decoder's `generate()` (T5 from a tiny config) runs its encoder once through
`model.get_encoder()`, outside any root forward, then one root forward per token handed the
encoder's outputs (`encoder_outputs=`). That encoder call is not observed, so the encoder's
layers have no rows in the token samples: the run says so (a warning, and a note in index.md
with how many sampled forwards were handed encoder outputs), never silently.

The reference is the test's own forward pre-hooks on the model and on its encoder: the encoder
ran outside the root forwards, and the root forwards of the tokens did not run it."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import polars as pl
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer

from conftest import read_history

TOKENS = 3


def test_generate_says_its_encoder_ran_outside_the_root_forwards(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=20,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=1,
    )
    config.decoder_start_token_id = 0  # generate()'s first decoder token
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(2, 20, (2, 6))
    calls: list[str] = []

    def seen(name: str) -> object:
        return lambda module, args: calls.append(name)

    model.register_forward_pre_hook(seen("root"))  # type: ignore[arg-type]
    model.encoder.register_forward_pre_hook(seen("encoder"))  # type: ignore[arg-type]
    run = tmp_path / "run"
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()  # the encoder runs inside: no note
        model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS)
        remove_observer(model)
    # training forward (with its encoder), then generate's encoder alone, then one per token
    assert calls == ["root", "encoder", "encoder", *["root"] * TOKENS]
    history = read_history(run)
    encoder = history.filter(pl.col("layer").str.starts_with("encoder."))
    assert set(encoder["sample_id"]) == {0}  # the training sample only
    assert set(history["sample_id"]) == set(range(1 + TOKENS))
    said = [str(w.message) for w in warned if "encoder_outputs" in str(w.message)]
    assert len(said) == 1
    index = (run / "index.md").read_text(encoding="utf-8")
    assert f"{TOKENS} sampled root forwards (sample_id 1 .. {TOKENS}) were called with" in index
    assert "`encoder_outputs`" in index


def test_a_model_called_without_encoder_outputs_says_nothing_of_them(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    model(torch.randn(3, 4))
    remove_observer(model)
    assert "encoder_outputs" not in (tmp_path / "run" / "index.md").read_text(encoding="utf-8")


def test_encoder_outputs_handed_positionally_are_said_as_when_handed_by_keyword(
    tmp_path: Path,
) -> None:
    """A decoder step called with the encoder's outputs as a positional argument (where the
    forward's signature puts `encoder_outputs`) is the same case as the keyword: said."""
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=20, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, pad_token_id=0
    )
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(2, 20, (2, 6))
    names = list(inspect.signature(model.forward).parameters)
    at = names.index("encoder_outputs")
    run = tmp_path / "run"
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        encoded = model.get_encoder()(input_ids=ids)  # outside any root forward
        args: list[object] = [None] * (at + 1)
        args[at] = encoded
        args[names.index("decoder_input_ids")] = torch.zeros(2, 1, dtype=torch.long)
        model(*args)
        remove_observer(model)
    history = read_history(run)
    assert not history.filter(pl.col("layer").str.starts_with("encoder.")).height
    said = [str(w.message) for w in warned if "encoder_outputs" in str(w.message)]
    assert len(said) == 1
    index = (run / "index.md").read_text(encoding="utf-8")
    assert "1 sampled root forward (sample_id 0 .. 0) was called with" in index


class Concatenating(nn.Module):
    """A forward of `*inputs`: no argument has a fixed position, whatever its name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat(inputs))


def test_positional_inputs_of_a_forward_without_an_encoder_outputs_parameter_say_nothing(
    tmp_path: Path,
) -> None:
    model = Concatenating()
    inject_observer(model, output_dir=tmp_path / "run", sampler=EveryNForwardsSampler(1))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model(torch.randn(3, 4), torch.randn(2, 4))
        remove_observer(model)
    assert not [w for w in warned if "encoder_outputs" in str(w.message)]
    assert "encoder_outputs" not in (tmp_path / "run" / "index.md").read_text(encoding="utf-8")
