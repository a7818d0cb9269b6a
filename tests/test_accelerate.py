"""Hugging Face accelerate's own loop on the CPU: `Accelerator.prepare` before or after
inject_observer, mixed precision, `accumulate`, `backward`, `unwrap_model`, and
`save_state`/`load_state` into a continued run.

With mixed precision, `prepare` rebuilds the model's `forward` from `model.forward.__func__`
(autocast around it, the outputs converted to float32); the proxy's `__func__` calls the proxy,
so a model prepared after injection is observed (rebuilt_forwards.py), and removal leaves
accelerate's wrapper in place with no proxy in it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import MethodType
from typing import Any

import polars as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from torch import nn

from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
from torchinstruments.capture import ForwardProxy

from hook_reference import run_both

STEPS = 4  # even: two accumulation windows of 2 steps on both sides of run_both


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    """A bf16 Accelerator on the CPU; accelerate's state is process-wide, so it is reset around
    the test (another test of the worker may have made one with other settings)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    AcceleratorState._reset_state(reset_partial_state=True)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


class Loop:
    """accelerate's documented training step: `accumulate`, `backward`, a prepared optimizer.
    `prepare_at_first_step`: the model is prepared at its first step (after injection)."""

    def __init__(self, accelerator: Accelerator, prepare_at_first_step: bool) -> None:
        self.accelerator = accelerator
        self.prepare_at_first_step = prepare_at_first_step
        self.optimizers: dict[int, Any] = {}

    def __call__(self, model: nn.Module, i: int) -> torch.Tensor:
        acc = self.accelerator
        if id(model) not in self.optimizers:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            if self.prepare_at_first_step:
                prepared, optimizer = acc.prepare(model, optimizer)
                assert prepared is model
            else:
                optimizer = acc.prepare(optimizer)
            self.optimizers[id(model)] = optimizer
        optimizer = self.optimizers[id(model)]
        with acc.accumulate(model):
            out = model(torch.randn(5, 6))
            acc.backward(out.pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        return out.detach()


def holds_a_proxy(forward: object) -> bool:
    """Whether a forward, or anything its `__func__`/`__wrapped__`/closure chain reaches, is a
    proxy of ours."""
    seen = 0
    while forward is not None and seen < 32:
        if isinstance(forward, ForwardProxy):
            return True
        cells = getattr(forward, "__closure__", None) or ()
        if any(isinstance(cell.cell_contents, ForwardProxy) for cell in cells):
            return True
        inner = getattr(forward, "__func__", None)
        forward = inner if inner is not None else getattr(forward, "__wrapped__", None)
        seen += 1
    return False


def test_prepared_after_inject_with_bf16_rows_equal_plain_hooks_and_removal_leaves_accelerate_wrapper(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """`prepare(model, optimizer)` after inject_observer, bf16 autocast: every step is observed,
    rows equal plain hooks on a copy prepared the same way, removal warns nothing and says no
    forward was left in place; the model keeps accelerate's float32-converting wrapper with no
    proxy in it, `_original_forward` holds the model's own bound forward, and
    `unwrap_model(keep_fp32_wrapper=False)` gives back the class's forward, as without us."""
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run_both(
            model, Loop(accelerator, prepare_at_first_step=True), tmp_path / "s", steps=STEPS
        )
    result.assert_conforms()
    assert result.history["sample_id"].unique().sort().to_list() == [0, 1, 2, 3]
    dtypes = result.history.filter(pl.col("layer") == "0")["dtype"].unique().to_list()
    assert dtypes == ["bfloat16"]  # measured inside accelerate's autocast
    for observed, reference in zip(result.observed_outputs, result.reference_outputs, strict=True):
        assert observed.dtype == torch.float32  # accelerate's conversion of the outputs
        assert torch.equal(observed, reference)

    forward = model.__dict__["forward"]
    assert isinstance(forward, MethodType)
    assert forward.__self__ is model
    assert forward.__func__.__module__ == "accelerate.utils.operations"
    assert not holds_a_proxy(forward)
    original = model.__dict__["_original_forward"]
    assert isinstance(original, MethodType)
    assert original.__func__ is nn.Sequential.forward
    index = (tmp_path / "s" / "index.md").read_text("utf-8")
    assert "replaced or wrapped after inject_observer" not in index
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert unwrapped.__dict__["forward"].__func__ is nn.Sequential.forward


def test_prepared_before_inject_rows_equal_plain_hooks_and_removal_puts_back_its_forward(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """`prepare` before inject_observer (the order the Trainer callbacks see): the proxy wraps
    accelerate's forward, rows equal plain hooks, and removal puts that very object back."""
    model = net()
    prepared: dict[int, object] = {}

    def prepare(module: nn.Module) -> None:
        accelerator.prepare(module)
        prepared[id(module)] = module.__dict__["forward"]

    result = run_both(
        model,
        Loop(accelerator, prepare_at_first_step=False),
        tmp_path / "s",
        steps=STEPS,
        prepare_both=prepare,
    )
    result.assert_conforms()
    assert result.history["sample_id"].unique().sort().to_list() == [0, 1, 2, 3]
    assert model.__dict__["forward"] is prepared[id(model)]


def test_unwrap_model_without_the_fp32_wrapper_during_the_run_stays_observed(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """`unwrap_model(keep_fp32_wrapper=False)` during the run unwraps the forward down to the
    function the proxy handed out, which still calls it: the next forwards are sampled; after
    removal the model's forward is the class's, bound to it, as unwrapping gives without us."""
    model = net()
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    model = accelerator.prepare(model)
    model(torch.randn(2, 6))
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert unwrapped is model
    assert "_original_forward" not in model.__dict__
    model(torch.randn(2, 6))  # neither autocast nor the conversion any more: float32 rows
    model.forward(torch.randn(2, 6))  # a direct call goes through it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remove_observer(model)
    history = pl.read_parquet(tmp_path / "s" / "history.parquet")
    assert history["forward_index"].unique().sort().to_list() == [0, 1, 2]
    layer = history.filter(pl.col("layer") == "0")
    dtypes = layer.group_by("forward_index").agg(pl.col("dtype").unique()).sort("forward_index")
    assert dtypes["dtype"].to_list() == [["bfloat16"], ["float32"], ["float32"]]
    forward = model.__dict__["forward"]
    assert forward.__func__ is nn.Sequential.forward
    assert forward.__self__ is model


def test_save_state_and_load_state_into_a_continued_run(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """`save_state` of an observed, prepared model and `load_state` into a fresh model whose run
    continues (resume=True): the weights come back, and the continued attempt's samples follow
    the earlier ones in the same run."""
    run, checkpoint = tmp_path / "s", tmp_path / "ckpt"
    loop = Loop(accelerator, prepare_at_first_step=True)
    model = net()
    inject_observer(model, output_dir=run, sampler=EveryNForwardsSampler(1))
    for i in range(2):
        loop(model, i)
    accelerator.save_state(str(checkpoint))
    remove_observer(model)

    restarted = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    inject_observer(restarted, output_dir=run, sampler=EveryNForwardsSampler(1), resume=True)
    again = Accelerator(mixed_precision="bf16", cpu=True, gradient_accumulation_steps=2)
    loop = Loop(again, prepare_at_first_step=True)  # the restarted job's own
    loop(restarted, 0)  # prepares it
    again.load_state(str(checkpoint))
    for name, tensor in model.state_dict().items():
        assert torch.equal(restarted.state_dict()[name], tensor)
    loop(restarted, 1)
    remove_observer(restarted)
    history = pl.read_parquet(run / "history.parquet")
    attempts = history.group_by("attempt").agg(pl.col("sample_id").unique().sort()).sort("attempt")
    assert attempts["sample_id"].to_list() == [[0, 1], [2, 3]]
    assert not holds_a_proxy(restarted.__dict__["forward"])


def test_compiled_by_prepare_after_inject_is_recorded_and_its_extra_graph_break_said(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """`prepare` with a dynamo plugin after inject_observer: torch.compile traces accelerate's
    rebuilt forward into the proxy, one graph break per compiled root forward; every sample is
    still recorded, and a warning and index.md say so, naming the order without it."""
    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = TorchDynamoPlugin(backend=DynamoBackend.EAGER)
    compiling = Accelerator(mixed_precision="bf16", cpu=True, dynamo_plugin=plugin)
    model = net()
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(2))
    compiled = compiling.prepare(model)
    assert compiled is not model  # torch.compile's wrapper
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                compiling.backward(compiled(torch.randn(2, 6)).sum())
            remove_observer(model)
    finally:
        torch._dynamo.reset()  # no compiled code of this test left for the worker's next one
    said = [str(w.message) for w in caught if "traces that rebuilt forward" in str(w.message)]
    assert len(said) == 1
    history = pl.read_parquet(tmp_path / "s" / "history.parquet")
    assert history["forward_index"].unique().sort().to_list() == [0, 2]
    assert set(history["signal"]) == {"output", "output_gradient"}
    index = (tmp_path / "s" / "index.md").read_text("utf-8")
    assert "call inject_observer after accelerator.prepare, on the module it returns" in index


class ReadsItsFunction(nn.Linear):
    """Records, at each call, the function its `forward` hands out as `__func__`."""

    seen: list[object]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.forward.__func__)
        return super().forward(input)


def test_only_the_root_proxy_hands_out_a_function_that_calls_it(tmp_path: Path) -> None:
    """A layer's proxy lives for one sampled forward: its `__func__` is the layer's function, so
    a forward rebuilt from it during a sampled forward is never measured twice later."""
    layer = ReadsItsFunction(6, 6)
    layer.seen = []
    model = nn.Sequential(layer, nn.ReLU())
    inject_observer(model, output_dir=tmp_path / "s", sampler=EveryNForwardsSampler(1))
    model(torch.randn(2, 6))
    root_function = model.forward.__func__
    remove_observer(model)
    assert layer.seen == [ReadsItsFunction.forward]  # under its proxy, in the sampled forward
    assert root_function is not nn.Sequential.forward
    assert inspect.unwrap(root_function) is nn.Sequential.forward  # released at removal


def test_without_direct_forwards_a_prepared_model_call_is_observed_and_a_direct_one_is_not(
    tmp_path: Path, accelerator: Accelerator
) -> None:
    """capture_direct_forwards=False after a mixed-precision `prepare`: the proxy's caller is
    accelerate's wrapper, so the rebuilt forward's own caller decides: `model(x)` is a root
    forward, `model.forward(x)` passes through uncounted."""
    model = net()
    run = tmp_path / "s"
    sampler = EveryNForwardsSampler(1)
    inject_observer(model, output_dir=run, sampler=sampler, capture_direct_forwards=False)
    accelerator.prepare(model)
    model(torch.randn(2, 6))
    model.forward(torch.randn(2, 6))
    model(torch.randn(2, 6))
    remove_observer(model)
    history = pl.read_parquet(run / "history.parquet")
    assert history["forward_index"].unique().sort().to_list() == [0, 1]
    assert history["sample_id"].unique().sort().to_list() == [0, 1]
