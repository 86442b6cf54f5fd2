"""Issue 35, items 1 and 2, against a real mosquitto and a real `edge-coordinator serve`: one
device's stolen key sends numbers no field can hold -- `pct` of 10**400 written out (signed
with its key, and with a key nobody enrolled), and states with battery_pct = 2**64 (in
`info` and in the `detail` text). serve refuses them at the protocol edge, keeps taking
everyone else's messages, never fails a loop step, and logs no traceback: a few lines and
summaries, not one per message."""

from __future__ import annotations

import pytest

from edge_agent import keys
from tests.integration.conftest import Side, announce, wait_for
from tests.unit.test_protocol_numbers import sign_exactly

pytestmark = pytest.mark.integration
HOSTILE = 100


def signed_raw(fleet, side: Side, channel: str, kind: str, body_json: str, *, key=None) -> tuple[str, bytes]:  # noqa: ANN001
    """A message signed over exactly `body_json` (a body our own Signer refuses to make)."""
    topic = fleet.topics.device(side.id, channel)
    return topic, sign_exactly(fleet.topics, topic, kind, body_json, key=key or side.key, seq=side.signer.sequence.next())


def test_hostile_numbers_are_refused_at_the_edge_and_never_stall_serve(mosquitto, fleet, serve) -> None:  # noqa: ANN001
    from edge_agent.coordinator.service_files import read_serve_file

    coordinator = serve(mosquitto.port).start()  # --auto-approve: the stolen key's device is approved
    thief = fleet.device(mosquitto.port, name="thief")
    honest = fleet.device(mosquitto.port, name="honest")
    announce(fleet, thief, battery=50, name="thief")
    def approved() -> set[str]:
        with coordinator.registry() as reg:
            return {d.id for d in reg.list_devices() if d.approved}

    assert wait_for(lambda: thief.id in approved(), 60), coordinator.log_tail()

    huge = "1" + "0" * 400
    payloads = []
    for i in range(HOSTILE):
        payloads.append(signed_raw(fleet, thief, "progress", "progress",
                                   f'{{"detail":"x","pct":{huge},"phase":"training"}}',
                                   key=thief.key if i % 2 else keys.generate_private_key()))
        payloads.append(signed_raw(fleet, thief, "state", "state",
                                   '{"info":{"battery_pct":18446744073709551616},"status":"idle"}'))
        payloads.append(signed_raw(fleet, thief, "state", "state",
                                   '{"detail":"status=idle battery_pct=18446744073709551616 power_w=1e999",'
                                   '"status":"idle"}'))
    for topic, payload in payloads:
        assert thief.client.publish(topic, payload) is not None
    assert thief.client.publish_wait(*payloads[-1], timeout=60)
    announce(fleet, honest, battery=77, name="honest")  # after all of them: its state is taken at once

    def honest_recorded() -> bool:
        with coordinator.registry() as reg:
            rows = {d.id: d for d in reg.list_devices()}
        return honest.id in rows and rows[honest.id].battery_pct == 77

    assert wait_for(honest_recorded, 120), coordinator.log_tail()
    with coordinator.registry() as reg:
        assert reg.get_device(thief.id).state.get("battery_pct") in (50, None)  # never 2**64
    assert wait_for(lambda: (read_serve_file(coordinator.state_dir) or {}).get("errors") == 0, 30)
    log = coordinator.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "OverflowError" not in log
    assert "bad_schema" in log
    dropped = [line for line in log.splitlines() if "dropped" in line]
    assert len(dropped) <= 30, f"{len(dropped)} lines for {len(payloads)} messages"
    assert coordinator.alive
