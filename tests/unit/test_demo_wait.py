"""The demo's wait for a device's local fine-tune: it says why when the job is slow
(idle priority under other load), once, and nothing when the job is quick."""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent.sim.application import wait_for_finetune


class _Device:
    """The local service's /model answers (LocalClient.model): running for `polls` polls, then done."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def model(self) -> dict[str, Any]:
        if self.polls > 0:
            self.polls -= 1
            return {"finetune": {"running": True, "last": None}}
        return {"finetune": {"running": False, "last": {"status": "installed"}},
                "personal": {"held_out_accuracy": 0.9}, "samples": {"total": 10}}


def test_a_slow_fine_tune_is_explained_once() -> None:
    heard: list[str] = []
    info = wait_for_finetune(_Device(5), poll_s=0.0, say=heard.append, notice_after_s=0.0)  # type: ignore[arg-type]
    assert info["personal"]["held_out_accuracy"] == 0.9
    assert len(heard) == 1 and "idle priority" in heard[0] and "training_priority" in heard[0]


def test_a_quick_fine_tune_says_nothing() -> None:
    heard: list[str] = []
    wait_for_finetune(_Device(3), poll_s=0.0, say=heard.append, notice_after_s=60.0)  # type: ignore[arg-type]
    assert heard == []


def test_a_fine_tune_that_never_ends_times_out() -> None:
    with pytest.raises(TimeoutError, match="did not finish"):
        wait_for_finetune(_Device(10**9), timeout_s=0.05, poll_s=0.0)  # type: ignore[arg-type]
