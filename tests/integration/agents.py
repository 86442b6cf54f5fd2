"""Helpers for fleet tests that drive real `edge-agent run` processes against a real
`edge-coordinator serve`: start agents with their own data, read what the coordinator
recorded, and read what each agent did from its own state directory and log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge_agent.agent.jobs import Job, JobStore
from tests.integration.conftest import (
    AgentProcess,
    ServeProcess,
    board_tree,
    device_data,
    online_devices,
    wait_for,
)

# A round that cannot finish before the test has acted on it, on any machine: the test
# reacts to the job's own progress (a phase, a step count), never to the clock.
LONG_TRAINING = ("--epochs", "10000", "--batch-size", "8", "--param", "patience=10000", "--budget-wh", "1")
# A short round for tests that only need one to finish ("--poll" last: drop it for --detach).
SHORT_ROUND = ("--epochs", "1", "--batch-size", "16", "--budget-wh", "1", "--poll", "0.3")


def start_agents(agents: Any, tmp: Path, port: int, n: int, *, battery: int = 90, **kw: Any) -> list[AgentProcess]:
    """`n` enrolled-on-hello agents, each with its own device's digits and a charged battery."""
    made = []
    for i in range(n):
        agent = agents(tmp, port, name=f"agent{i}", sysfs_root=board_tree(tmp / f"board{i}", battery_pct=battery),
                       data_dir=device_data(tmp / f"data{i}", device=i), **kw)
        made.append(agent.start())
    return made


def logs(coordinator: ServeProcess | None, agents_: list[AgentProcess], n: int = 2500) -> str:
    """Everything worth reading when an assertion fails."""
    parts = [coordinator.log_tail(n)] if coordinator else []
    return "\n".join(parts + [f"--- {a.home.name}\n{a.log_tail(n)}" for a in agents_])


def wait_online(coordinator: ServeProcess, agents_: list[AgentProcess], timeout: float = 90) -> None:
    want = sorted(a.id for a in agents_)
    assert wait_for(lambda: sorted(online_devices(coordinator)) == want, timeout), logs(coordinator, agents_)


def device_rows(coordinator: ServeProcess) -> dict[str, Any]:
    with coordinator.registry() as reg:
        return {d.id: d for d in reg.list_devices()}


def phases(coordinator: ServeProcess, agents_: list[AgentProcess]) -> list[str]:
    """Each agent's last job phase as the coordinator recorded it from its progress messages."""
    rows = device_rows(coordinator)
    return [str(rows[a.id].state.get("job_phase")) if a.id in rows else "" for a in agents_]


def jobs(agent: AgentProcess) -> list[Job]:
    """The agent's own job records (the daemon persists them before every step)."""
    return JobStore(agent.state_dir / "jobs").all()


def log_lines(agent: AgentProcess, level: str) -> list[str]:
    """The agent's log lines at `level` (its format: `<time> LEVEL logger: message`)."""
    text = agent.log_path.read_text(errors="replace") if agent.log_path.exists() else ""
    return [line for line in text.splitlines() if f" {level} " in line[:40]]


def job_id_of(stdout: str) -> str:
    """The job id `edge-coordinator train --detach` prints (`job <id>: ...`)."""
    return stdout.split()[1].rstrip(":")

