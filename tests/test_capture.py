"""Which calls are captured, and under which names, call indices and tensor paths."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import namedtuple
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
from torch import nn

from torchinstruments import EveryNForwardsSampler, remove_observer
from torchinstruments._torch_internals import (
    called_through_module_call,
    is_tracing,
    queue_at_backward_end,
)

from conftest import mlp, observe, read_history, values

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    extra: dict


class Shared(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Structured(nn.Module):
    """A leaf returning a nested structure of tensors and non-tensors."""

    def forward(self, x: torch.Tensor) -> tuple:
        return (
            x * 2,
            {"logits": x + 1, "name": "not a tensor", "k": [x - 1, 3]},
            Pair(x.sum(), x.mean()),
            Output(hidden=x * 3, extra={"k": x * 4}),
        )


class Holder(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child

    def forward(self, x: torch.Tensor) -> object:
        return self.child(x)


def test_shared_module_gets_call_index_per_invocation(run_dir: Path) -> None:
    model = Shared()
    x = torch.randn(3, 4)
    observe(model, run_dir)
    model(x)
    remove_observer(model)
    first = model.lin(x)
    second = model.lin(torch.tanh(first))
    history = read_history(run_dir).filter(pl.col("metric") == "mean")
    assert sorted(history["call_index"].to_list()) == [0, 1]
    assert values(history, call_index=0) == [pytest.approx(first.mean().item(), rel=1e-6)]
    assert values(history, call_index=1) == [pytest.approx(second.mean().item(), rel=1e-6)]


def test_nested_outputs_get_distinct_tensor_paths(run_dir: Path) -> None:
    model = Holder(Structured())
    x = torch.randn(2, 3)
    observe(model, run_dir)
    model(x)
    remove_observer(model)
    history = read_history(run_dir).filter(pl.col("metric") == "mean")
    means = dict(zip(history["tensor_path"], history["value"], strict=True))
    expected = {
        "[0]": (x * 2).mean(),
        "[1]['logits']": (x + 1).mean(),
        "[1]['k'][0]": (x - 1).mean(),
        "[2].left": x.sum(),
        "[2].right": x.mean(),
        "[3].hidden": (x * 3).mean(),
        "[3].extra['k']": (x * 4).mean(),
    }
    assert set(means) == set(expected)
    for path, value in expected.items():
        assert means[path] == pytest.approx(value.item(), rel=1e-6), path
    assert set(history["layer"]) == {"child"}


def test_direct_forward_calls_are_root_forwards_and_measured(run_dir: Path) -> None:
    model = mlp()
    observe(model, run_dir)
    model.forward(torch.randn(2, 8))
    model[0].forward(torch.randn(2, 8))  # outside a root forward: not observed
    remove_observer(model)
    history = read_history(run_dir)
    assert history["forward_index"].unique().to_list() == [0]
    assert set(history["layer"]) == {str(i) for i in range(6)}


def test_capture_direct_forwards_false_ignores_calls_that_bypass_module_call(
    run_dir: Path,
) -> None:
    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b.forward(self.a(x))

    model = Direct()
    observe(model, run_dir, capture_direct_forwards=False)
    model.forward(torch.randn(2, 4))  # bypasses __call__: not a root forward
    model(torch.randn(2, 4))
    remove_observer(model)
    history = read_history(run_dir)
    assert history["forward_index"].unique().to_list() == [0]
    assert set(history["layer"]) == {"a"}


def test_a_root_forward_wrapped_after_inject_is_told_from_a_direct_call(run_dir: Path) -> None:
    """capture_direct_forwards=False with the root's forward wrapped after inject: the proxy's
    caller is the wrapper, whose own caller tells `model(x)` from `model.forward(x)` (every call
    was taken as direct: a run of no rows)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    observe(model, run_dir, capture_direct_forwards=False)
    inner = model.forward

    @functools.wraps(inner)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    model.forward = logged
    model(torch.randn(2, 4))  # through nn.Module.__call__: a root forward
    model.forward(torch.randn(2, 4))  # direct: passed through
    with pytest.warns(RuntimeWarning, match="replaced or wrapped after inject_observer"):
        remove_observer(model)
    history = read_history(run_dir)
    assert history["forward_index"].unique().to_list() == [0]
    assert set(history["layer"]) == {"0", "1"}


def test_child_called_outside_a_root_forward_is_not_observed(run_dir: Path) -> None:
    model = Holder(nn.Linear(4, 4))
    observe(model, run_dir)
    model.child(torch.randn(2, 4))  # Lightning's `self.encoder(x)` shape
    model(torch.randn(2, 4))
    model.child(torch.randn(2, 4))
    remove_observer(model)
    history = read_history(run_dir)
    assert history["sample_id"].unique().to_list() == [0]
    assert history["forward_index"].unique().to_list() == [0]


def test_reentrant_root_call_belongs_to_the_enclosing_root_forward(run_dir: Path) -> None:
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            y = self.lin(x)
            return self(y, depth - 1) if depth > 0 else y

    model = Recursive()
    observe(model, run_dir)
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    remove_observer(model)
    history = read_history(run_dir).filter(pl.col("metric") == "mean")
    assert history["forward_index"].unique().sort().to_list() == [0, 1]
    per_sample = history.group_by("sample_id").agg(pl.col("call_index").sort())
    assert per_sample.sort("sample_id")["call_index"].to_list() == [[0, 1, 2], [0, 1, 2]]


def test_root_that_is_a_leaf_is_measured_as_layer_root(run_dir: Path) -> None:
    model = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    observe(model, run_dir)
    y = model(x)
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history["layer"]) == {""}
    assert values(history, metric="max", signal="output") == [
        pytest.approx(y.max().item(), rel=1e-6)
    ]


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


class StaticForward(nn.Module):
    """A class `forward` that takes no `self`: a staticmethod of a Python function."""

    forward = staticmethod(tanh)


class ClassForward(nn.Module):
    """A class `forward` bound to the class: a classmethod."""

    @classmethod
    def forward(cls, x: torch.Tensor) -> torch.Tensor:
        return x * 3


@pytest.mark.parametrize(
    "root", [None, StaticForward, ClassForward], ids=["layers", "static", "class"]
)
def test_staticmethod_and_classmethod_forwards_run_as_unobserved_and_are_measured(
    run_dir: Path, root: type[nn.Module] | None
) -> None:
    """The proxy took the class's forward as `type(module).forward`, a staticmethod's bare
    function, and bound it to the module: every sampled call raised TypeError in the step. A
    root with a classmethod forward raised AttributeError at every call (its proxy's instance
    is the class), and read a changed class forward in each new bound method it looked up."""
    model = root() if root else nn.Sequential(StaticForward(), ClassForward())
    x = torch.randn(5, 3)
    expected = model(x)
    proxies: list[list[object]] = []  # the layers' proxies in each sampled forward
    if not root:
        list(model.children())[-1].register_forward_pre_hook(
            lambda module, args: proxies.append(
                [m.__dict__.get("forward") for m in model.children()]
            )
        )
    observe(model, run_dir)
    wrapped = model.__dict__["forward"].__wrapped__ if root else None
    assert torch.equal(model(x), expected)
    assert torch.equal(model(x), expected)
    if root:  # the class's forward is the one wrapped at inject: not followed again
        assert model.__dict__["forward"].__wrapped__ is wrapped
    else:  # each layer's proxy is made once and put back on in each sample, not made anew
        assert None not in proxies[0]
        assert [a is b for a, b in zip(*proxies, strict=True)] == [True, True]
    remove_observer(model)
    assert [m for m in model.modules() if "forward" in m.__dict__] == []
    history = read_history(run_dir)
    assert set(history["layer"]) == ({""} if root else {"0", "1"})
    assert values(history, metric="max", signal="output", sample_id=0) == [
        pytest.approx(output.max().item(), rel=1e-6)
        for output in ([expected] if root else [torch.tanh(x), expected])
    ]


def test_no_grad_and_inference_mode_are_measured_without_gradients(run_dir: Path) -> None:
    model = mlp()
    observe(model, run_dir)
    with torch.no_grad():
        model(torch.randn(2, 8))
    with torch.inference_mode():
        model(torch.randn(2, 8))
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history["signal"]) == {"output"}
    assert history["grad_enabled"].unique().to_list() == [False]
    assert history["sample_id"].unique().sort().to_list() == [0, 1]


def test_mode_column_follows_module_training_flag(run_dir: Path) -> None:
    model = mlp()
    observe(model, run_dir)
    model(torch.randn(2, 8))
    model.eval()
    model(torch.randn(2, 8))
    remove_observer(model)
    history = read_history(run_dir)
    modes = history.group_by("sample_id").agg(pl.col("mode").unique()).sort("sample_id")
    assert modes["mode"].to_list() == [["train"], ["eval"]]


def test_inplace_relu_after_observed_linear_measures_the_pre_activation(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 1))
    x = torch.randn(16, 6)
    reference = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1))
    reference.load_state_dict(model.state_dict())
    pre = reference[0](x)
    observe(model, run_dir)
    out = model(x)
    out.sum().backward()
    remove_observer(model)
    history = read_history(run_dir)
    assert values(history, layer="0", signal="output", metric="min") == [
        pytest.approx(pre.min().item(), rel=1e-6)
    ]
    assert values(history, layer="1", signal="output", metric="min") == [0.0]
    assert len(values(history, layer="0", signal="output_gradient", metric="mean")) == 1


def test_user_hooks_fire_exactly_once_per_call(run_dir: Path) -> None:
    model = mlp()
    calls = {"pre": 0, "fwd": 0, "bwd": 0}
    model[0].register_forward_pre_hook(lambda m, a: calls.__setitem__("pre", calls["pre"] + 1))
    model[0].register_forward_hook(lambda m, a, o: calls.__setitem__("fwd", calls["fwd"] + 1))
    model[0].register_full_backward_hook(
        lambda m, gi, go: calls.__setitem__("bwd", calls["bwd"] + 1)
    )
    observe(model, run_dir)
    for _ in range(3):
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    remove_observer(model)
    assert calls == {"pre": 3, "fwd": 3, "bwd": 3}
    history = read_history(run_dir)
    assert history.filter(pl.col("layer") == "0")["sample_id"].unique().len() == 3


def test_parent_wrapper_calling_self_module_is_observed_through_the_wrapper(
    run_dir: Path, tmp_path: Path
) -> None:
    class DDPShaped(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: object, **kwargs: object) -> object:
            return self.module(*args, **kwargs)

    inner = mlp()
    wrapper = DDPShaped(inner)
    observe(wrapper, run_dir)
    wrapper(torch.randn(2, 8)).sum().backward()
    remove_observer(wrapper)
    assert set(read_history(run_dir)["layer"]) == {f"module.{i}" for i in range(6)}

    inner_dir = tmp_path / "inner"
    observe(inner, inner_dir)
    wrapper(torch.randn(2, 8))
    remove_observer(inner)
    assert set(read_history(inner_dir)["layer"]) == {str(i) for i in range(6)}


def test_selector_chooses_layers_and_sampler_chooses_forwards(run_dir: Path) -> None:
    model = mlp()
    observe(
        model,
        run_dir,
        selector=lambda name, module: isinstance(module, nn.Linear),
        sampler=EveryNForwardsSampler(3),
    )
    for _ in range(7):
        model(torch.randn(2, 8))
    remove_observer(model)
    history = read_history(run_dir)
    assert set(history["layer"]) == {"0", "2", "4"}
    assert history["forward_index"].unique().sort().to_list() == [0, 3, 6]
    assert history["sample_id"].unique().sort().to_list() == [0, 1, 2]


def test_a_parametrized_module_is_one_layer_and_a_selector_may_choose_its_weight_module(
    tmp_path: Path,
) -> None:
    """weight_norm (torch.nn.utils.parametrize) puts a module that computes the weight under
    the Linear: by default the Linear is the layer; a selector can still pick that module, whose
    output is then the weight."""
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 3)), nn.ReLU())
    observe(model, tmp_path / "default")
    model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    assert set(read_history(tmp_path / "default")["layer"]) == {"0", "1"}

    observe(model, tmp_path / "chosen", selector=lambda name, _: name.endswith("weight.0"))
    model(torch.randn(2, 4)).sum().backward()
    remove_observer(model)
    history = read_history(tmp_path / "chosen")
    assert set(history["layer"]) == {"0.parametrizations.weight.0"}
    linear = model[0]
    assert isinstance(linear, nn.Linear)  # ParametrizedLinear, a subclass
    weight = linear.weight.detach().double()
    row = history.filter(pl.col("signal") == "output", pl.col("metric") == "max")
    assert row["value"].item() == weight.max().item()


def test_exception_inside_forward_propagates_and_closes_the_sample(run_dir: Path) -> None:
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
            y = self.lin(x)
            if fail:
                raise KeyError("boom")
            return y

    model = Failing()
    observe(model, run_dir)
    with pytest.raises(KeyError, match="boom"):
        model(torch.randn(1, 2), fail=True)
    model(torch.randn(1, 2))
    remove_observer(model)
    history = read_history(run_dir)
    assert history["sample_id"].unique().sort().to_list() == [0, 1]


def test_tracing_an_observed_model_passes_through_untouched(run_dir: Path) -> None:
    model = mlp()
    x = torch.randn(2, 8)
    observe(model, run_dir)
    traced = torch.jit.trace(model, x, check_trace=False)
    graph = torch.fx.symbolic_trace(model)
    model(x)
    remove_observer(model)
    assert torch.equal(traced(x), model(x))  # type: ignore[not-callable]
    assert torch.equal(graph(x), model(x))
    history = read_history(run_dir)
    assert history["forward_index"].unique().to_list() == [0]  # tracing counted no forward


def test_export_passes_through_untouched_and_strict_export_traces_the_plain_forward(
    run_dir: Path,
) -> None:
    """torch.export (non-strict, its default) traces an observed model as the plain one and counts
    no forward. Strict export traces from the top, where dynamo may not break the graph: it
    traces the root proxy through to the model's forward, as for a `fullgraph=True` compiled
    function that calls the model (docs/design-notes.md), counts no forward, and is said."""
    model = mlp()
    x = torch.randn(2, 8)
    plain = torch.export.export(copy.deepcopy(model), (x,))
    observe(model, run_dir)
    exported = torch.export.export(model, (x,))
    with pytest.warns(RuntimeWarning, match="strict torch.export"):
        strict = torch.export.export(model, (x,), strict=True)
    assert torch.equal(strict.module()(x), plain.module()(x))
    model(x)
    remove_observer(model)
    assert exported.graph_module.code == plain.graph_module.code
    assert torch.equal(exported.module()(x), model(x))
    assert torch.equal(torch.export.export(model, (x,), strict=True).module()(x), model(x))
    history = read_history(run_dir)
    assert history["forward_index"].unique().to_list() == [0]  # exporting counted no forward


def test_forwards_from_several_threads_keep_their_samples_apart(run_dir: Path) -> None:
    import threading

    model = mlp()
    observe(model, run_dir, sampler=EveryNForwardsSampler(2))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                for _ in range(50):
                    model(torch.randn(4, 8))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    remove_observer(model)
    assert not errors
    history = read_history(run_dir).filter(pl.col("metric") == "mean")
    assert history["call_index"].unique().to_list() == [0]
    per_sample = history.group_by("sample_id").agg(pl.len().alias("tensors"))
    assert per_sample.height == 75  # 150 root forwards, every second one sampled
    assert per_sample["tensors"].unique().to_list() == [6]
    assert sorted(history["forward_index"].unique().to_list()) == list(range(0, 150, 2))


def test_direct_forward_detection_works_without_wrapts_c_extension(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import wrapt, torch
        from torch import nn
        from torchinstruments import EveryNForwardsSampler, inject_observer, remove_observer
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        inject_observer(model, output_dir={str(tmp_path / "s")!r},
                        sampler=EveryNForwardsSampler(1), capture_direct_forwards=False)
        model(torch.randn(1, 2))
        model.forward(torch.randn(1, 2))
        remove_observer(model)
        """
    )
    env = {**os.environ, "WRAPT_DISABLE_EXTENSIONS": "true"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    history = read_history(tmp_path / "s")
    assert history["forward_index"].unique().to_list() == [0]
    assert set(history["layer"]) == {"0", "1"}


# --- the private torch internals, one test each (the _torch_internals package keeps them) ---


def test_called_through_module_call_tells_module_call_from_direct_forward() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(called_through_module_call(depth=2))
            return x

    probe = Probe()
    probe(torch.ones(1))  # nn.Module._call_impl calls forward
    probe.forward(torch.ones(1))  # called directly
    assert seen == [True, False]


def test_is_tracing_is_true_only_inside_a_trace() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_tracing())
            return x + 1

    probe = Probe()
    probe(torch.ones(1))
    torch.fx.symbolic_trace(probe)
    assert seen == [False, True]


def test_queue_at_backward_end_runs_after_the_pass_and_refuses_outside_one() -> None:
    order: list[str] = []
    assert not queue_at_backward_end(lambda: order.append("never"))
    x = torch.ones(2, requires_grad=True)
    y = x * 3

    def hook(grad: torch.Tensor) -> None:
        order.append("hook")
        assert queue_at_backward_end(lambda: order.append("end"))

    y.register_hook(hook)
    (y * 2).sum().backward()
    order.append("after")
    assert order == ["hook", "end", "after"]
