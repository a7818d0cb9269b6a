"""A job restarted many times: where its next attempt starts is planned from the attempts'
counts, and the job's TensorBoard events are read only from the first attempt whose counts
are lower bounds (killed) on."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from torchinstruments.rundir import attempts as attempts_module
from torchinstruments.rundir.attempts import KILLED, REMOVED, AttemptCounts, plan_continuation
from torchinstruments.rundir.event_steps import event_steps

ATTEMPTS = 50
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
    """A scalar at each attempt's sampled forwards, in an event file of its own in the run's
    tensorboard/ (TensorBoard's own writer), as the run's focus layers' histograms are."""
    for n in range(ATTEMPTS):
        with SummaryWriter(str(directory / "tensorboard")) as writer:
            for k in range(SAMPLES):
                writer.add_scalar("x", 1.0, n * FORWARDS + k)


def reads_counted(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The directories whose events the plan reads, one entry a read."""
    reads: list[Path] = []
    real = attempts_module.event_steps

    def counted(directory: Path, since: int = 0) -> set[int]:
        reads.append(directory)
        return real(directory, since)

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
        ATTEMPTS * SAMPLES,  # its first sample_id + its 3 steps
        (ATTEMPTS - 1) * FORWARDS + SAMPLES,  # after its last sampled forward
    )
    assert reads == [tmp_path]


def test_the_events_are_read_from_the_first_killed_attempts_file_on(tmp_path: Path) -> None:
    """Asked from a step on, each file whose first summary is before it (an earlier attempt's)
    is left after that record: a step written there later is not seen, which no run writes
    (the next attempt's steps follow), and here shows the rest of the file went unread."""
    write_sampled_steps(tmp_path)
    first, *_ = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with SummaryWriter(str(tmp_path / "extra")) as appended:
        appended.add_scalar("x", 1.0, ATTEMPTS * FORWARDS + 7)
    extra = next((tmp_path / "extra").glob("events.out.tfevents.*"))
    with first.open("ab") as file:  # attempt 0's file, a step past every attempt's at its end
        file.write(extra.read_bytes())
    since = 40 * FORWARDS
    every = event_steps(tmp_path)
    assert ATTEMPTS * FORWARDS + 7 in every
    assert event_steps(tmp_path, since=since) == {s for s in every if s >= since} - {
        ATTEMPTS * FORWARDS + 7
    }
