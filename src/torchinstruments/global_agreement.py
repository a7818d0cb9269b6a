"""What the ranks agree on before a sample's global collectives (`global_statistics`).

Every rank must call the same collectives in the same order with the same sizes, or a rank
waits forever. So before measuring, the ranks all-gather a 6-integer header (did the forward
raise, which root forward the sample is, which kind of forward its root's call was (mode and
grad mode), how many tensors it claimed, a 64-bit hash of their names, order aside), over
the library's own group (`global_channel`). Ranks whose samples are different root forwards
(forward_index or step), or different kinds of forward (a training forward on one rank, an
evaluation forward under no_grad or in eval mode on another: a validation batch one rank ran
alone, paired with the others' next sample), are apart: a value combined from them would mix
two populations, and the ranks stay apart from there on (each later sample is another root
forward on some rank; where the program's own collectives, DDP's say, hold the others, the
rank ahead would wait in its next header). So every rank stops global statistics there,
together, read from the same gathered headers: null rows with the reason, and no rank waits in
the library's collectives again. Ranks that claimed different tensors (a branch
taken on one rank, a Mixture-of-Experts expert not routed to on every rank, a rank whose
forward raised before the others' last layers) take one more all-gather, of each tensor's
64-bit identity (8 bytes per tensor of the rank with the most), and then measure exactly the
tensors every rank of their group claimed, in one order (sorted by identity) on every rank;
each other tensor is null with a reason naming the ranks it ran on (and the ranks that
raised, when they are why). A raise thus costs only the tensors the raising rank never
produced: those it produced before the raise are the same tensors as on any other rank. The
decision to take that extra collective is read from the gathered headers, so it is the same
on every rank. A header exchange that fails (no other rank came within the wait: a sampled
forward some ranks ran alone, an evaluation batch on rank 0 only, whose extra sample the others,
held in the program's own collectives such as DDP's, never reach) raises `RanksApartError`, which
names this rank's sample and forward_index, so the stop's reason says where the ranks parted.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchinstruments import reasons
from torchinstruments.global_channel import gathered
from torchinstruments.notices import shown

# The header's fields that name the root forward a sample is, right after `raised` (`header`).
# Not sample_id: ranks whose earlier samples differ (a resumed run's recovered counts) may still
# be at the same root forward now.
_IDENTITY = ("forward_index", "step")
_KINDS = 1 + len(_IDENTITY)  # where the kinds of forward the claimed tensors came from sit
_COUNT = _KINDS + 1  # where the claimed tensors' count (then their hash) sits
_NO_STEP = -(1 << 63)  # a sample without a step (no int64 step is this)
DIFFERENT_FORWARDS = (
    "global_statistics: the ranks' samples are different root forwards (a rank ran a root "
    "forward the others did not, an extra evaluation batch say, or its step or kind of forward "
    "differs): global statistics stopped there on every rank together, for the rest of the run "
    "(null global rows with the reason; no rank waits in the library's collectives again). "
    "Every rank must run the same root forwards in the same order"
)


def identities(names: Sequence[str], groups: Sequence[tuple[int, ...]]) -> list[str]:
    """Each claimed tensor's identity: its name (`GlobalTensor.name`), its group's members (a
    tensor counts as run by a rank of the same group only) and, should a name repeat, which
    occurrence it is."""
    seen: dict[str, int] = {}
    out = []
    for name, group in zip(names, groups, strict=True):
        base = f"{name}|{','.join(map(str, group))}"
        seen[base] = seen.get(base, -1) + 1
        out.append(f"{base}#{seen[base]}")
    return out


def _hash(text: str) -> int:
    """A 64-bit hash, the same on every rank and process (unlike `hash`)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def kind_bit(mode: str, grad_enabled: bool) -> int:
    """The header's bit for a tensor of a forward in `mode` with grad `grad_enabled`."""
    return 1 << (2 * (mode == "eval") + (not grad_enabled))


def kind_of(sample: Any, items: Sequence[Any]) -> int:
    """The header's kind of `sample`: the `kind_bit` of its root forward (`Sample.kind`: the
    root's mode and grad mode as it began), 0 where it claimed no tensor (nothing to pair).
    The root's, not its tensors': a branch frozen in eval mode, or run under no_grad, that ran
    on some ranks only is one missing tensor (`not_everywhere`), never ranks apart."""
    kind = getattr(sample, "kind", None)
    if not items or kind is None:
        return 0
    return kind_bit(*kind)


def header(sample: Any, names: Sequence[str], kinds: int = 0) -> torch.Tensor:
    """This rank's view of a sample, all-gathered before its collectives: whether its forward
    raised, which root forward it is, the kind of forward it is (`kinds`: `kind_of`), and the
    tensors it claimed (count, hash of their names, order aside). The names leave out the
    groups' members: on a 2-D mesh each tensor-parallel group has its own, and the headers
    must agree all the same."""
    step = _NO_STEP if sample.step is None else sample.step
    raised = sample.interrupted is not None
    structure = _hash("\n".join(sorted(names)))
    return torch.tensor(
        [int(raised), sample.forward_index, step, kinds, len(names), structure],
        dtype=torch.int64,
    )


class RanksApartError(RuntimeError):
    """The ranks' agreement on a sample failed: no other rank came to it within the wait, or a
    rank left it. Its message names this rank's sample and root forward, and what makes ranks
    part (a sampled forward some ranks ran alone): the bare collective error (gloo's "Timed
    out waiting 60000ms") names neither, and the rows and index.md carry this message."""


def apart(sample: Any, wait: datetime.timedelta, error: BaseException) -> RanksApartError:
    """The `RanksApartError` of `sample`, whose header exchange failed with `error` after waiting at
    most `wait` (`global_statistics_timeout`)."""
    step = "" if sample.step is None else f", step {sample.step}"
    return RanksApartError(
        f"no other rank came within {wait.total_seconds():g} s (global_statistics_timeout) to "
        f"the agreement on this rank's sample {sample.sample_id} (forward_index "
        f"{sample.forward_index}{step}), or a rank left it: a sampled forward ran on some ranks "
        "only (an evaluation or validation batch one rank ran alone: every rank must run the same "
        "root forwards, and the program's own collectives, DDP's say, then hold the others), a "
        f"rank's data ran out, or a rank was later than that or gone ({shown(error)})"
    )


def _different_forwards(headers: list[torch.Tensor]) -> tuple[str, list[str]] | None:
    """The first of forward_index and step that differs across the ranks' headers, with
    each rank's value, or None where every rank's sample is the same root forward. A rank
    without a step differs from none (a loop may call set_step on rank 0 only)."""
    for position, field in enumerate(_IDENTITY, start=1):
        values = [int(h[position]) for h in headers]
        if len({v for v in values if v != _NO_STEP}) > 1:
            return field, ["none" if v == _NO_STEP else str(v) for v in values]
    return None


_KIND_WORDS = (
    "train/grad enabled",
    "train/grad disabled",
    "eval/grad enabled",
    "eval/grad disabled",
)


def _kinds_said(kinds: int) -> str:
    """The kind of forward of a header's `kinds` bit, as a row's reason names it."""
    return " and ".join(word for bit, word in enumerate(_KIND_WORDS) if kinds >> bit & 1)


def _different_kinds(headers: list[torch.Tensor]) -> list[str] | None:
    """Each rank's kind of forward, where they differ across the ranks that claimed tensors
    (a rank that claimed none has no kind: `not_everywhere` tells its tensors), else None."""
    kinds = [int(h[_KINDS]) for h in headers]
    if len({k for k in kinds if k}) < 2:
        return None
    return [_kinds_said(k) if k else "none claimed" for k in kinds]


def apart_reason(headers: list[torch.Tensor], warn: Callable[[str, str], None]) -> str | None:
    """Why the ranks are apart at this sample (different root forwards, or different kinds of
    forward), warned about once, or None. The same answer on every rank, read from the same
    gathered headers: each then stops global statistics, together (they stay apart until the
    run ends). A rank whose forward raised is not apart here: the tensors every rank produced
    before the raise are one tensor (`not_everywhere` nulls the others)."""
    # Ranks at different root forwards, or kinds of forward: their tensors are no one tensor
    # whatever else agrees (a training batch and a validation batch are two populations).
    different = _different_forwards(headers)
    kinds = _different_kinds(headers)
    if different is None and kinds is None:
        return None
    warn("global-forwards", DIFFERENT_FORWARDS)
    if different is not None:
        return reasons.different_forwards(*different)
    return reasons.different_forwards("kind of forward", kinds or [])


def not_everywhere(
    headers: list[torch.Tensor],
    ids: Sequence[str],
    groups: Sequence[tuple[int, ...]],
    agreement: Any,
) -> dict[int, str]:
    """The claimed tensors (by index) some rank of their group did not claim, each with its
    reason; empty when every rank claimed the same tensors (then no collective at all).

    Otherwise one all-gather (over `agreement`, the headers' group) of every rank's tensor
    hashes, padded to the longest list, whose length every rank reads from the headers."""
    if all(torch.equal(h[_COUNT:], headers[0][_COUNT:]) for h in headers):
        return {}
    counts = [int(h[_COUNT]) for h in headers]
    mine = torch.zeros(max(counts), dtype=torch.int64)
    mine[: len(ids)] = torch.tensor([_hash(i) for i in ids], dtype=torch.int64)
    hashes = gathered(mine, agreement).tolist()
    claimed = [set(g[:n]) for g, n in zip(hashes, counts, strict=True)]
    raisers = {r for r, h in enumerate(headers) if h[0].item()}
    out = {}
    for index, (identity, group) in enumerate(zip(ids, groups, strict=True)):
        ran = [r for r in group if _hash(identity) in claimed[r]]
        if len(ran) < len(group):
            raised = sorted(raisers.difference(ran).intersection(group))
            out[index] = (
                reasons.raised_on_ranks(raised, ran, group)
                if raised
                else reasons.not_on_all_ranks(ran, group)
            )
    return out


__all__ = [
    "DIFFERENT_FORWARDS",
    "RanksApartError",
    "apart",
    "apart_reason",
    "header",
    "identities",
    "kind_bit",
    "kind_of",
    "not_everywhere",
]
