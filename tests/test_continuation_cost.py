"""A job restarted many times: where its next attempt starts is planned from the attempts'
counts, and the job's TensorBoard events are read only where those counts are lower bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from torchinstruments.rundir import attempts as attempts_module
from torchinstruments.rundir.attempts import KILLED, REMOVED, AttemptCounts, plan_continuation

ATTEMPTS = 200
SAMPLES = 3  # each attempt's, at its first three forwards
FORWARDS = 5  # each attempt's root forwards


def finished_attempts() -> list[AttemptCounts]:
    """`ATTEMPTS` removed attempts, back to back, with exact counts."""
    return [
        AttemptCounts(
            n,
            "2026-01-01T00:00:00+00:00",
            first_sample_id=n * SAMPLES,
            first_forward_index=n * FORWARDS,
            root_forwards=FORWARDS,
            samples=SAMPLES,
            backward_samples=SAMPLES,
            ended=REMOVED,
        )
        for n in range(ATTEMPTS)
    ]


def write_sampled_steps(directory: Path) -> None:
    """A scalar at each attempt's sampled forwards, in the run's tensorboard/ (TensorBoard's
    own writer), as the run's focus layers' histograms are."""
    with SummaryWriter(str(directory / "tensorboard")) as writer:
        for n in range(ATTEMPTS):
            for k in range(SAMPLES):
                writer.add_scalar("x", 1.0, n * FORWARDS + k)


def reads_counted(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories whose events the plan reads, one entry a read."""
    reads: list[Path] = []
    real = attempts_module.event_steps

    def counted(directory: Path) -> set[int]:
        reads.append(directory)
        return real(directory)

    monkeypatch.setattr(attempts_module, "event_steps", counted)
    return reads


def test_a_job_of_finished_attempts_continues_after_their_counts_without_reading_its_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_sampled_steps(tmp_path)
    reads = reads_counted(monkeypatch)
    plan = plan_continuation(
        tmp_path, tuple(finished_attempts()), tmp_path / "history.parquet", first_part=0
    )
    assert (plan.attempt, plan.first_sample_id, plan.first_forward_index) == (
        ATTEMPTS,
        ATTEMPTS * SAMPLES,
        ATTEMPTS * FORWARDS,
    )
    assert reads == []


def test_a_killed_last_attempt_is_raised_to_its_own_steps_among_many_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last attempt died having counted 1 sample in 2 forwards from its rows; the events
    hold its 3 sampled forwards, so the next attempt starts after them. Each attempt's steps
    are counted apart (the earlier ones' do not raise it), and the events are read once."""
    write_sampled_steps(tmp_path)
    reads = reads_counted(monkeypatch)
    *earlier, last = finished_attempts()
    killed = AttemptCounts(
        last.attempt,
        last.started_at,
        first_sample_id=last.first_sample_id,
        first_forward_index=last.first_forward_index,
        root_forwards=2,
        samples=1,
        ended=KILLED,
    )
    plan = plan_continuation(
        tmp_path, (*earlier, killed), tmp_path / "history.parquet", first_part=0
    )
    assert (plan.first_sample_id, plan.first_forward_index) == (
        ATTEMPTS * SAMPLES,  # 597 + its 3 steps
        (ATTEMPTS - 1) * FORWARDS + SAMPLES,  # after its last sampled forward, 997
    )
    assert reads == [tmp_path]
