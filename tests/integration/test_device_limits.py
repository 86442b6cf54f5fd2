"""A device at its daily job limit (issue 20), end to end: real `edge-agent run` processes,
a real `edge-coordinator serve`, real mosquitto. The agent reports its allowance in its
signed state; once it is used up the coordinator stops selecting it (no refusal, no
dropout) and `status` / `devices` say why."""

from __future__ import annotations

import pytest

from edge_agent.coordinator.records import JobStatus, RoundState
from tests.integration.agents import SHORT_ROUND, device_rows, logs, wait_online
from tests.integration.conftest import board_tree, device_data, register_digits, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real agents train


def test_a_device_at_its_daily_limit_is_not_selected_and_status_says_why(mosquitto, agents, serve, tmp_path,
                                                                          digits_bundle):
    coordinator = serve(mosquitto.port).start()
    agents_ = []
    for i, limit in enumerate((1, None)):  # agent0 takes one job a day; agent1 the default
        agent = agents(tmp_path, mosquitto.port, name=f"agent{i}", sysfs_root=board_tree(tmp_path / f"board{i}"),
                       data_dir=device_data(tmp_path / f"data{i}", device=i))
        if limit is not None:
            text = agent.config.read_text()
            assert "max_jobs_per_day = 48" in text  # the default: headroom over an hourly schedule
            agent.config.write_text(text.replace("max_jobs_per_day = 48", f"max_jobs_per_day = {limit}", 1))
        agents_.append(agent.start())
    limited, other = agents_
    register_digits(coordinator, digits_bundle[1], tmp_path)
    wait_online(coordinator, agents_)
    assert wait_for(lambda: device_rows(coordinator)[limited.id].state.get("jobs_left") == 1, 60), \
        logs(coordinator, agents_)

    def train():
        return coordinator.cli("train", "--model", "digits", "--devices", "all", "--deadline", "600s",
                               *SHORT_ROUND, check=False, timeout=900)

    first = train()
    assert first.returncode == 0, f"{first.stdout}\n{first.stderr}\n{logs(coordinator, agents_)}"
    assert wait_for(lambda: device_rows(coordinator)[limited.id].state.get("refuse") == "daily_limit", 60), \
        logs(coordinator, agents_)
    status = coordinator.cli("status").stdout
    assert f"{limited.id} (agent0): refuses jobs: daily limit 1/1, resets " in status, status
    assert "0/1 (refuses)" in coordinator.cli("devices").stdout

    second = train()
    assert second.returncode == 0, f"{second.stdout}\n{second.stderr}\n{logs(coordinator, agents_)}"
    with coordinator.registry() as reg:
        job1, job2 = reg.list_jobs()
        assert job1.status is job2.status is JobStatus.DONE
        (r1,), (r2,) = reg.list_rounds(job1.id), reg.list_rounds(job2.id)
        assert sorted(r1.participants) == sorted(a.id for a in agents_)
        assert list(r2.participants) == [other.id] and r2.state is RoundState.AGGREGATED and r2.dropouts == {}
    # never asked, so never refused: no daily_limit warning on the limited device
    assert "daily_limit" not in limited.log_tail(10**7), limited.log_tail()
    assert limited.alive and other.alive and coordinator.alive
