"""Exact statistics of a tensor spread over ranks (opt-in: `inject_observer(global_statistics=)`).

What it measures: a DTensor output with a Shard placement stands for the concatenation of its
shards, one with Partial(sum) for the elementwise sum of its partials; with a process group
named, any other output stands for the union of every group rank's tensor (data parallel: the
global batch). Such an output gets rows of the whole tensor, exact: the nine default metrics
equal those of the full tensor gathered in one place (the quartiles select the very elements
and interpolate as the measurement folder does), labelled
`population = "global:ranks=..."`. Its local rows are not written: a series has one population
for the whole run, so no summary mixes them.

The cost, per sampled forward (never on unsampled ones, nothing at all without the option, nor
with `True` on a model that held no DTensor at inject: `global_channel.open_run`), a fixed
number of collectives whatever the number of layers:

1. one `all_gather` of a 6-integer header over the library's own group (`global_agreement`,
   `global_channel`: never paired with the user's collectives, a bounded wait): did a
   rank's forward raise, which root forward the sample is (forward_index, step), which kind
   of forward the root's call was (mode and grad mode), how many tensors, a hash of their
   names, modes and grad modes. Ranks whose k-th samples are different root forwards, or
   different kinds (one ran a forward the others did not, an extra evaluation batch say,
   paired with the others' next sample), all stop global statistics there together: its
   global rows and every later sample's are null with the reason, never a value combined
   from different steps or from a training and an evaluation batch, and no rank waits again. Ranks that ran different layers (a branch on one rank, a
   Mixture-of-Experts expert not routed to on every rank, a rank whose forward raised before
   the last layers) take one more `all_gather`, of their tensors' hashes, and measure the
   tensors every rank of their group ran; only the others are null, with a reason naming the
   ranks they ran on (and those that raised). Every rank reaches this point (it runs when the
   root forward ends, raised or not), so a rank that raises never leaves the others waiting; a
   rank that takes a sample the others never take waits at most `global_statistics_timeout`
   (60 s by default), then global statistics stop for the rest of the run (null rows with the reason, warned);
2. per process group in the sample (sorted by ranks; ranks outside it skip it), in one packed
   tensor each: one `all_reduce` of the Partial outputs' values in float64 (only when the sample
   has some; each rank then keeps its 1/W slice of the sums), one `all_gather` of 8 float64
   moments and counts per tensor (counts, a power-of-two scale, local mean and M2 of the values
   so scaled, combined by Chan's formula, min, max), and `RADIX_PASSES` `all_reduce`s of int64
   histograms: a radix select on the 64 bits of each finite value's order-preserving key, 8 bits
   a pass, for the 6 order statistics the quartiles need (each quartile's two neighbours),
   `6 x 256` counts per tensor per pass.

Bytes sent per rank and sample: 48 per rank of the header (and where the ranks ran different
layers 8 per tensor of the rank with the most), 8 per Partial element,
`64 x world` per tensor of moments, `8 x 12288` per tensor of histograms (8 passes x 6 x 256
int64); the data itself is never gathered.

Safety: only samplers that decide the same on every rank are accepted (the default
`TimeIntervalSampler` reads each rank's clock: refused at inject); every rank must observe
(`rank_policy="all"`). Gradients (`output_gradient` rows) stay this rank's local tensor.
It reuses the measurement folder's key transform (`order.sortable_keys`), quantile routine
(`numerics.quartile_positions`, `numerics.lerp`) and `numerics.derived`; its histogram
passes are its own (`order.on_device` counts 16-bit digits of one tensor on one device; here
the counts of every tensor of a sample travel in one packed all-reduce, so 8-bit digits keep
the packet small).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchinstruments import global_agreement as agreement
from torchinstruments import reasons
from torchinstruments._torch_internals import is_functorch_wrapped
from torchinstruments.global_channel import GlobalRun, close_run, gathered, open_run, summed
from torchinstruments.global_option import LOCAL_DTENSOR
from torchinstruments.measurement.numerics import (
    PROFILE,
    QUARTILES,
    derived,
    lerp,
    quartile_positions,
)
from torchinstruments.measurement.order import sortable_keys
from torchinstruments.measurement.tensors import (
    TORCH_FUNC_NOTE,
    dtensor_class,
    dtype_name,
    is_real_dtype,
    measured_form,
)
from torchinstruments.notices import shown
from torchinstruments.records import OUTPUT, MetricValue
from torchinstruments.rundir.shell import layer_span, literal_span

RADIX_BITS = 8
RADIX_PASSES = 64 // RADIX_BITS
_BINS = 1 << RADIX_BITS
_TARGETS = 2 * len(QUARTILES)  # each quartile's lower and upper neighbour
_SIGN = -(1 << 63)


@dataclass
class GlobalTensor:
    """One output to be measured over its group, kept until the sampled forward ends."""

    key: Any  # measurement.transfer.TensorKey
    values: torch.Tensor  # this rank's part, detached (a copy: later in-place ops cannot reach it)
    partial: bool
    ranks: tuple[int, ...]
    group: Any
    shape: tuple[int, ...] | None  # None: a nested tensor's (no fixed shape)
    dtype: str
    placement: str | None
    coordinate: tuple[int, ...] | None
    timestamp_us: int

    @property
    def label(self) -> str:
        """The population column's value."""
        return "global:ranks=" + ",".join(map(str, self.ranks))

    def name(self) -> str:
        """What every rank must agree on: not the local shape (shards may be uneven), nor the
        group's members (on a 2-D mesh each tensor-parallel group, or each data-parallel group
        named, has its own), only the group's size."""
        k = self.key
        group = len(self.ranks)
        kind = f"{k.mode}|{k.grad_enabled}"
        return f"{k.layer.name}|{k.call_index}|{k.tensor_path}|{kind}|{self.partial}|{group}"


def claim(option: GlobalRun, key: Any, tensor: torch.Tensor) -> GlobalTensor | None:
    """The GlobalTensor for `tensor` if it is measured over a group, else None (local rows).

    A DTensor on a 1-D mesh with a Shard or Partial(sum) placement is measured over the mesh's
    group; with a group named, so is every plain floating tensor, in the form its local rows
    would measure (`measured_form`: a sparse tensor as the dense one it stands for, a nested
    one's component entries with a null shape, a torch.func wrapper's underlying values: under
    vmap the whole batch, which vmap's own ops could not reduce). Anything else (Replicate, multi-dimensional
    meshes, integer tensors, tensor subclasses, meta tensors, which have no values) keeps its
    local rows, so a tensor that cannot be measured globally never costs the others theirs.
    """
    dtensor = dtensor_class()
    if dtensor is not None and isinstance(tensor, dtensor):
        mesh = tensor.device_mesh
        if mesh.ndim != 1:
            return None
        placement = tensor.placements[0]
        partial = placement.is_partial()
        if partial and getattr(placement, "reduce_op", "sum") != "sum":
            return None
        if not (partial or placement.is_shard()):
            return None
        group = mesh.get_group(0)
        local = tensor.to_local()
        shape = tuple(tensor.shape)
        name = type(placement).__name__.lstrip("_")
        label = f"{name}({placement.reduce_op if partial else placement.dim})"
        coordinate = tuple(mesh.get_coordinate() or ())
    elif option.group is not None and isinstance(tensor, torch.Tensor):
        if type(tensor) is not torch.Tensor or tensor.is_meta:
            return None  # a meta tensor has no values: its local rows say so
        # What the local rows measure: sparse densified, nested entries, torch.func unwrapped.
        form = measured_form(tensor)
        if form.values is None:
            return None  # too large to densify: its local rows say so
        group, local, partial, label, coordinate = option.group, form.values, False, None, None
        shape = form.shape
    else:
        return None
    if not (local.is_floating_point() and is_real_dtype(local.dtype)):
        return None  # integer, bool, or packed float4 (its local rows say why)
    return GlobalTensor(
        key,
        local.detach().clone(),
        partial,
        tuple(dist.get_process_group_ranks(group)),
        group,
        shape,
        dtype_name(tensor.dtype),
        label,
        coordinate or None,
        time.time_ns() // 1000,
    )


def _keys(values: torch.Tensor) -> torch.Tensor:
    """Finite float64 values -> `order.sortable_keys` offset by 2**63 (unsigned order), so the
    digits of a pass are plain bit fields."""
    return sortable_keys(values) ^ _SIGN


def _value(keys: torch.Tensor) -> torch.Tensor:
    """`_keys` inverted (`sortable_keys` is its own inverse on the bits)."""
    return sortable_keys((keys ^ _SIGN).view(torch.float64)).view(torch.float64)


def _moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's [numel, finite, zeros, exponent, mean, M2, min, max], and its finite values:
    the mean and M2 are those of the finite values divided by 2**exponent (`_exponent`)."""
    flat = values.reshape(-1).to(torch.float64)
    finite = flat[torch.isfinite(flat)]
    n = finite.numel()
    exponent = _exponent(finite)
    scaled = finite * math.ldexp(1.0, -exponent) if exponent else finite  # exact
    mean = scaled.mean() if n else flat.new_tensor(0.0)  # every entry on the values' device
    m2 = ((scaled - mean) ** 2).sum() if n else flat.new_tensor(0.0)
    row = torch.stack(
        [
            flat.new_tensor(float(flat.numel())),
            flat.new_tensor(float(n)),
            (flat == 0).sum().to(torch.float64),
            flat.new_tensor(float(exponent)),
            mean,
            m2,
            finite.min() if n else flat.new_tensor(math.inf),
            finite.max() if n else flat.new_tensor(-math.inf),
        ]
    )
    return row, finite


def _exponent(finite: torch.Tensor) -> int:
    """The power of two a rank's finite float64 values are divided by for their moments, as
    `numerics.segment_sums` scales them: 0 for ordinary magnitudes, else (beyond 2**+-400) the
    largest's, within +-1000. Unscaled, squares beyond 1e154 overflow (a null std), below 1e-154
    underflow (a std of 0, silently wrong), and sums near float64 max overflow (a null mean)."""
    top = float(finite.abs().max()) if finite.numel() else 0.0
    if top == 0.0 or 2.0**-400 <= top <= 2.0**400:
        return 0
    return max(-1000, min(1000, math.frexp(top)[1]))


def _combined(rows: list[torch.Tensor]) -> dict[str, float]:
    """Chan's combination of the ranks' moment rows, in rank order (the same on every rank), in
    units of the largest rank's scale (each rank's mean and M2 rescaled to it by `math.ldexp`)."""
    numel = finite = zeros = 0.0
    mean = m2 = 0.0
    low, high = math.inf, -math.inf
    values = [row.tolist() for row in rows]
    top = int(max((value[3] for value in values if value[1]), default=0.0))
    for r_numel, r_n, r_zeros, r_exponent, r_mean, r_m2, r_min, r_max in values:
        numel += r_numel
        zeros += r_zeros
        if r_n:
            shift = int(r_exponent) - top  # <= 0
            r_mean, r_m2 = math.ldexp(r_mean, shift), math.ldexp(r_m2, 2 * shift)
            total = finite + r_n
            delta = r_mean - mean
            mean += delta * r_n / total
            m2 += r_m2 + delta * delta * finite * r_n / total
            finite = total
        low, high = min(low, r_min), max(high, r_max)
    scale = math.ldexp(1.0, top)  # a std rounded up to inf at the float64 limit: `derived` caps it
    return {
        "numel": numel,
        "finite": finite,
        "zeros": zeros,
        "mean": mean * scale,
        "std": math.sqrt(m2 / finite) * scale if finite else math.nan,
        "min": low,
        "max": high,
    }


def _targets(finite: float) -> list[int]:
    """The 0-based ranks of each quartile's two neighbours among `finite` sorted values
    (`numerics.quartile_positions`, the measurement folder's one quantile routine)."""
    last = max(int(finite) - 1, 0)
    out = []
    for q in QUARTILES.values():
        low, _ = quartile_positions(np.float64(last), q)
        out += [int(low), min(int(low) + 1, last)]
    return out


def _select(finite_parts: list[torch.Tensor], targets: torch.Tensor, group: Any) -> torch.Tensor:
    """The order statistics `targets[t, j]` of each tensor t over the group, by radix select.

    One packed all_reduce of `[T, 6, 256]` counts per pass; the same result on every rank.
    """
    keys = [_keys(part) for part in finite_parts]
    t, home = len(keys), targets.device  # each tensor counted on its own device
    prefix = torch.zeros((t, _TARGETS), dtype=torch.int64, device=home)
    remaining = targets.clone()
    offsets = torch.arange(_TARGETS, dtype=torch.int64)[:, None] * _BINS
    for p in range(RADIX_PASSES):
        shift = 64 - RADIX_BITS * (p + 1)
        counts = torch.zeros((t, _TARGETS * _BINS), dtype=torch.int64, device=home)
        for i, k in enumerate(keys):
            if not k.numel():
                continue
            digit = (k >> shift) & (_BINS - 1)
            if p == 0:
                match = torch.ones((_TARGETS, k.numel()), dtype=torch.bool, device=k.device)
            else:
                high = (k >> (shift + RADIX_BITS)) & ((1 << (RADIX_BITS * p)) - 1)
                match = high[None, :] == prefix[i].to(k.device)[:, None]
            index = (digit[None, :] + offsets.to(k.device)).masked_select(match)
            counts[i] = torch.bincount(index, minlength=_TARGETS * _BINS).to(home)
        counts = summed(counts, group)
        cum = counts.reshape(t, _TARGETS, _BINS).cumsum(-1)
        chosen = (cum <= remaining[..., None]).sum(-1).clamp(max=_BINS - 1)
        below = torch.where(
            chosen > 0, cum.gather(-1, (chosen - 1).clamp(min=0)[..., None])[..., 0], 0
        )
        remaining = remaining - below
        prefix = (prefix << RADIX_BITS) | chosen
    return _value(prefix)


def _group_rows(
    items: list[GlobalTensor], metrics: tuple[str, ...], group: Any
) -> list[tuple[MetricValue, ...]]:
    """Every item's metric values over their (shared) ranks, by the packed collectives over
    `group` (the library's own over those ranks where it has one)."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    parts = [item.values for item in items]
    partial = [i for i, item in enumerate(items) if item.partial]
    if partial:
        home = parts[partial[0]].device
        flat = torch.cat([parts[i].reshape(-1).to(home, torch.float64) for i in partial])
        sums = summed(flat, group).split([parts[i].numel() for i in partial])
        for i, whole in zip(partial, sums, strict=True):  # the output's own dtype, rounded once
            parts[i] = torch.tensor_split(whole.to(parts[i].device, parts[i].dtype), world)[me]
    rows, finite_parts = zip(*(_moments(part) for part in parts), strict=True)
    home = parts[0].device  # where the sample's packets are built (one move per collective)
    every = gathered(torch.stack([row.to(home) for row in rows]), group).cpu()
    combined = [_combined(list(every[:, i])) for i in range(len(items))]
    targets = torch.tensor([_targets(c["finite"]) for c in combined], dtype=torch.int64)
    selected = _select(list(finite_parts), targets.to(home), group).tolist()
    wanted = tuple(m for m in metrics if m in PROFILE)
    out = []
    for c, picks in zip(combined, selected, strict=True):
        raw: dict[str, float] = dict(c)
        last = np.float64(max(c["finite"] - 1, 0))
        for j, (name, q) in enumerate(QUARTILES.items()):
            _, weight = quartile_positions(last, q)
            low, high = np.float64(picks[2 * j]), np.float64(picks[2 * j + 1])
            raw[name] = float(lerp(low, high, weight))
        profile = derived(raw, int(c["numel"]), wanted) if c["numel"] else {}
        out.append(
            tuple(
                profile.get(m, MetricValue(None, reasons.EMPTY_GLOBAL))
                if m in PROFILE
                else MetricValue(None, reasons.NOT_GLOBAL_CUSTOM)
                for m in metrics
            )
        )
    return out


def measure(
    run: GlobalRun,
    sample: Any,
    *,
    metrics: tuple[str, ...],
    rank: int | None,
    warn: Callable[[str, str], None],
) -> list[Any]:
    """The global rows of one sampled forward (`Measurement`s of its `global_pending`); every
    rank calls it once per sampled forward, raised or not, with whatever it claimed. What the
    ranks agree to measure (`global_agreement`, over the library's own group): the whole
    sample, none of it, or the tensors every rank of their group claimed, in one order on every
    rank. A failed collective stops global statistics (`GlobalRun.stop`): that group's tensors
    and every later group's are null with the reason, and no further collective is taken."""
    items: list[GlobalTensor] = sample.global_pending
    names = [item.name() for item in items]
    ids = agreement.identities(names, [item.ranks for item in items])
    mine = agreement.header(sample, names, agreement.kind_of(sample, items))
    try:
        headers = list(gathered(mine, run.agreement).cpu())
    except Exception as error:  # the ranks are apart: say at which sample, and why they part
        raise agreement.apart(sample, run.option.wait, error) from error
    apart = agreement.apart_reason(headers, warn)
    if apart is not None:  # every rank stops here, together: no rank waits again
        stopped = run.stop(sample.sample_id, agreement.RanksApartError(apart))
        return rows_of(items, {}, stopped, metrics=metrics, rank=rank)
    absent = agreement.not_everywhere(headers, ids, [item.ranks for item in items], run.agreement)
    values: dict[int, tuple[MetricValue, ...]] = {
        i: (MetricValue(None, why),) * len(metrics) for i, why in absent.items()
    }
    by_group: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(range(len(items)), key=ids.__getitem__):
        if i not in absent:
            by_group.setdefault(items[i].ranks, []).append(i)
    for ranks in sorted(by_group):
        chosen = by_group[ranks]
        if run.stopped is None:
            try:
                group = run.group_for(ranks, items[chosen[0]].group)
                rows = _group_rows([items[i] for i in chosen], metrics, group)
                values.update(zip(chosen, rows, strict=True))
                continue
            except Exception as error:  # a failed collective: null + reason, never the step
                _stopped(run, sample.sample_id, error, warn)
        values.update((i, (MetricValue(None, run.stopped),) * len(metrics)) for i in chosen)
    return rows_of(items, values, None, metrics=metrics, rank=rank)


def _stopped(
    run: GlobalRun, sample_id: int | None, error: BaseException, warn: Callable[[str, str], None]
) -> str:
    """Stop `run`'s global statistics after `error` in sample `sample_id`, warned once."""
    reason = run.stop(sample_id, error)
    warn(
        "global",
        f"global statistics of a sample failed: {shown(error)}; they stopped (from sample "
        f"{sample_id} on, every globally measured tensor's rows are null with the reason, and no "
        "rank waits in the library's collectives again): a collective of the library failed, "
        "or no other rank came to it within its wait (a rank whose data ran out, or that met "
        "its own barrier or collective while this one took a sample, or a sampled forward that "
        "ran on some ranks only, an evaluation batch one rank ran alone)",
    )
    return reason


def rows_of(
    items: Sequence[GlobalTensor],
    values: dict[int, tuple[MetricValue, ...]],
    reason: str | None,
    *,
    metrics: tuple[str, ...],
    rank: int | None,
) -> list[Any]:
    """The global rows of a sample's claimed tensors: `values[i]` for the i-th, null with
    `reason` for any other (each claimed tensor has its rows, measured or null + reason)."""
    from torchinstruments.records import Measurement

    out = []
    for i, item in enumerate(items):
        k = item.key
        row = values.get(i) or (MetricValue(None, reason or "not measured"),) * len(metrics)
        out.append(
            Measurement(
                sample_id=k.sample_id,
                forward_index=k.forward_index,
                timestamp_us=item.timestamp_us,
                rank=rank,
                layer=k.layer.name,
                module_type=k.layer.module_type,
                call_index=k.call_index,
                signal=OUTPUT,
                tensor_path=k.tensor_path,
                shape=item.shape,
                dtype=item.dtype,
                mode=k.mode,
                grad_enabled=k.grad_enabled,
                metrics=metrics,
                values=row,
                placement=item.placement,
                mesh_coordinate=item.coordinate,
                step=k.step,
                population=item.label,
            )
        )
    return out


def keep(
    option: GlobalRun | None,
    pending: list[GlobalTensor],
    key: Any,
    tensor: torch.Tensor,
    warn: Callable[[str, str, str], None],
) -> bool:
    """Append `tensor` to the sample's `pending` if it is measured over its ranks (never
    without the option).

    A failure here writes no row for this tensor in this sample (warned once): a local row would
    put two populations into one series. A `local` run (no DTensor in the model at inject)
    keeps none: a DTensor met there keeps its local rows (`kept_note` says so).
    """
    if option is None or option.local:
        return False
    try:
        claimed = claim(option, key, tensor)
    except Exception as error:
        warn(
            "global-claim",
            *(
                f"global statistics of {_tensor_named(key, note)} failed: {shown(error)}; its "
                "rows of this sample are not written (a local row would mix populations)"
                for note in (False, True)
            ),
        )
        return True
    if claimed is not None:
        pending.append(claimed)
    return claimed is not None


def kept_note(tensor: torch.Tensor) -> str | None:
    """What the run should say about a tensor `keep` took: that a torch.func wrapper's global
    rows are of its unwrapped values (`TORCH_FUNC_NOTE`), as its local rows would say."""
    return TORCH_FUNC_NOTE if is_functorch_wrapped(tensor) else None


def local_note(option: GlobalRun | None, tensor: torch.Tensor) -> str | None:
    """What the run should say about a tensor `keep` left to the local path: in a `local` run, a
    DTensor's rows are this rank's own (`LOCAL_DTENSOR`). A note of what the run records, not a
    failure: index.md says it once, as it is."""
    if option is None or not option.local:
        return None
    dtensor = dtensor_class()
    return LOCAL_DTENSOR if dtensor is not None and isinstance(tensor, dtensor) else None


def sample_rows(
    run: GlobalRun | None,
    sample: Any,
    measurer: Any,
    rank: int | None,
    warn: Callable[[str, str], None],
) -> tuple[Any, ...]:
    """`measure` of the sampled forward `sample` (its `global_pending`; `interrupted` when it
    raised), called on every rank once per sampled forward, raised or not, so the collectives
    meet. A failure (the header's collective timing out, a rank gone) is warned once, never
    raises in the step, and stops global statistics (`global_channel`); every tensor the sample
    claimed still gets its rows, null with the reason, in this sample and in each later one:
    the claimed tensors have no local rows, so without them the stop would be silent. Nothing
    without the option, nor in a `local` run (no collective: it claims no tensor)."""
    if run is None or run.local:
        return ()
    metrics = measurer.metrics
    try:
        if run.stopped is None:
            return tuple(measure(run, sample, metrics=metrics, rank=rank, warn=warn))
        reason = run.stopped  # a stop at inject is warned here, at its first sample
        warn("global", f"{reason}; every globally measured tensor's rows are null with it")
    except Exception as error:
        reason = _stopped(run, sample.sample_id, error, warn)
    try:
        return tuple(rows_of(sample.global_pending, {}, reason, metrics=metrics, rank=rank))
    except Exception:  # the rows themselves could not be built: the warning said it failed
        return ()


__all__ = [
    "RADIX_PASSES",
    "GlobalTensor",
    "claim",
    "close_run",
    "keep",
    "kept_note",
    "measure",
    "open_run",
    "rows_of",
    "sample_rows",
]


def _tensor_named(key: Any, note: bool) -> str:
    """A tensor as a warning names it (`'layer'.path`) or index.md's note (a code span of the
    layer's literal, then one of its path): Markdown in a name renders outside code."""
    if not note:
        return f"{key.layer.name!r}{key.tensor_path}"
    path = key.tensor_path
    return layer_span(key.layer.name) + (literal_span(path) if path else "")
