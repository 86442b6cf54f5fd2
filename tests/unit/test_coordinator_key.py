"""The coordinator's key (issue 35, item 3): a lost key is never silently replaced once
devices may trust it (exit 78, naming the ways back); `key rotate` makes a new key that
devices accept only because the old key signed it; and devices refusing the coordinator's
commands as signed by an unknown key show as a fleet-wide problem in `status`.
Real registry, keys, signatures and files; no broker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.agent.coordinator_trust import ROTATION_FILE, CoordinatorTrust
from edge_agent.config import parse_public_key, public_key_text
from edge_agent.coordinator.cli import main
from edge_agent.coordinator.key_rotation import RETIRED_DIR, rotation_messages
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.service import Coordinator, ServeOptions
from edge_agent.coordinator.service_files import lock_state_dir
from edge_agent.errors import ConfigError
from edge_agent.protocol import (
    Kind,
    Message,
    Reason,
    Rejection,
    ReplayWindow,
    SequenceCounter,
    Signer,
    Topics,
    TrustStore,
    Verifier,
)

FLEET = "farm"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def fleet_dir(tmp_path: Path, capsys) -> Path:
    """A coordinator state dir with its key and one approved device (a fleet in use)."""
    state = tmp_path / "coord"
    assert run(capsys, "key", "--state-dir", str(state))[0] == 0
    dev = keys.generate_private_key()
    with Registry(state_dir=state) as reg:
        reg.enrol_device(device_id=keys.fingerprint(dev), public_key=public_key_text(dev), fleet=FLEET, approved=True)
    return state


def test_a_lost_key_with_devices_enrolled_refuses_to_start_and_names_the_recovery(fleet_dir: Path, capsys) -> None:
    """Before: serve (and `key`) made a new key, overwrote coordinator.pub, and every device
    refused every command as unknown_key while `status` showed nothing."""
    pub = (fleet_dir / "coordinator.pub").read_text()
    (fleet_dir / "keys" / "coordinator.key").unlink()
    with pytest.raises(ConfigError, match="is missing, but 1 enrolled device"):
        Coordinator(ServeOptions(state_dir=fleet_dir, fleet=FLEET))
    code, out, err = run(capsys, "key", "--state-dir", str(fleet_dir))
    assert code == 78 and out == ""
    for words in ("Restore the file from a backup", "edge-coordinator key rotate", "--without-old-key"):
        assert words in err, err
    proc = subprocess.run([sys.executable, "-m", "edge_agent.coordinator.cli", "serve", "--state-dir", str(fleet_dir),
                           "--broker", "127.0.0.1:9", "--fleet", FLEET], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "Restore the file from a backup" in proc.stderr and "Traceback" not in proc.stderr
    assert not (fleet_dir / "keys" / "coordinator.key").exists()  # no new trust anchor was made
    assert (fleet_dir / "coordinator.pub").read_text() == pub
    # coordinator.pub gone too: the registry's enrolled devices still say a key was in use
    (fleet_dir / "coordinator.pub").unlink()
    with pytest.raises(ConfigError, match="1 enrolled device"):
        Coordinator(ServeOptions(state_dir=fleet_dir, fleet=FLEET))
    # the explicit way out when it is lost for good
    code, out, _ = run(capsys, "key", "rotate", "--without-old-key", "--state-dir", str(fleet_dir))
    assert code == 0 and "NOT signed by the old one" in out and "edge-agent init --coordinator-key" in out
    Coordinator(ServeOptions(state_dir=fleet_dir, fleet=FLEET)).close()


def test_a_first_start_still_makes_its_key(tmp_path: Path) -> None:
    c = Coordinator(ServeOptions(state_dir=tmp_path / "new", fleet=FLEET))
    c.close()
    assert (tmp_path / "new" / "keys" / "coordinator.key").exists()


@pytest.fixture
def device(tmp_path: Path):
    """A device's verifier as the agent builds it, trusting the coordinator key of `fleet_dir`."""
    class Device:
        pass

    d = Device()
    d.topics = Topics(fleet=FLEET)
    d.key = keys.generate_private_key()
    d.id = keys.fingerprint(d.key)
    d.state = tmp_path / "device"
    d.window = ReplayWindow(directory=d.state / "replay", strict_missing=True)

    def trusting(public: object) -> None:
        d.trust = TrustStore()
        d.trust.add(public, role="coordinator")
        d.verifier = Verifier(topics=d.topics, trust=d.trust, replay=d.window)

    d.trusting = trusting
    return d


def test_key_rotate_is_signed_by_the_old_key_and_devices_follow_only_that(fleet_dir: Path, device, tmp_path,
                                                                             capsys) -> None:
    old = keys.load_private_key(fleet_dir / "keys" / "coordinator.key")
    device.trusting(old.public_key())
    trust = CoordinatorTrust(state_dir=device.state, configured=old.public_key())

    locks = lock_state_dir(fleet_dir)  # a running serve holds the key: no rotation under it
    try:
        code, _, err = run(capsys, "key", "rotate", "--state-dir", str(fleet_dir))
        assert code == 69 and "another edge-coordinator serve" in err
    finally:
        for fd in locks:
            __import__("os").close(fd)
    code, out, _ = run(capsys, "key", "rotate", "--state-dir", str(fleet_dir))
    assert code == 0 and f"rotated: coordinator key {keys.fingerprint(old)} ->" in out
    new = keys.load_private_key(fleet_dir / "keys" / "coordinator.key")
    assert keys.fingerprint(new) != keys.fingerprint(old)
    assert out.splitlines()[0] == public_key_text(new) == (fleet_dir / "coordinator.pub").read_text().strip()
    assert keys.fingerprint(keys.load_private_key(fleet_dir / RETIRED_DIR / f"{keys.fingerprint(old)}.key")) == \
        keys.fingerprint(old)

    # what serve publishes: the new key, signed by the old one, on the old key's topic
    (topic, payload), = rotation_messages(fleet_dir, device.topics, SequenceCounter(path=tmp_path / "s"),
                                          public_key_text(new))
    assert topic == device.topics.coordinator_key(keys.fingerprint(old))
    msg = device.verifier.open(topic, payload)
    assert isinstance(msg, Message) and msg.kind is Kind.KEY_ROTATION and msg.sender == keys.fingerprint(old)
    assert trust.rotate(msg) is not None and trust.key_id == keys.fingerprint(new)

    # a restart trusts the new key (persisted), and only while agent.toml names the key it came from
    assert CoordinatorTrust(state_dir=device.state, configured=old.public_key()).key_id == keys.fingerprint(new)
    saved = json.loads((device.state / ROTATION_FILE).read_text())
    assert saved["chain"] == [keys.fingerprint(old), keys.fingerprint(new)]
    other = keys.generate_private_key()  # re-enrolled with `init --coordinator-key OTHER --force`
    assert CoordinatorTrust(state_dir=device.state, configured=other.public_key()).key_id == keys.fingerprint(other)

    # a second rotation: both retired keys point at the newest; an unreadable one is left out, logged
    assert run(capsys, "key", "rotate", "--state-dir", str(fleet_dir))[0] == 0
    newest = public_key_text(keys.load_private_key(fleet_dir / "keys" / "coordinator.key"))
    signed = rotation_messages(fleet_dir, device.topics, SequenceCounter(path=tmp_path / "s"), newest)
    assert sorted(t.rsplit("/", 1)[1] for t, _ in signed) == sorted([keys.fingerprint(old), keys.fingerprint(new)])
    (fleet_dir / RETIRED_DIR / f"{keys.fingerprint(old)}.key").chmod(0o644)
    (topic, _), = rotation_messages(fleet_dir, device.topics, SequenceCounter(path=tmp_path / "s"), newest)
    assert topic.endswith(keys.fingerprint(new))


def test_a_rotation_not_signed_by_the_trusted_key_is_refused(device, tmp_path) -> None:
    trusted, rogue, new = (keys.generate_private_key() for _ in range(3))
    device.trusting(trusted.public_key())
    body = {"public_key": public_key_text(new), "rotated_at": int(time.time())}
    seq = SequenceCounter(path=tmp_path / "seq")
    rogue_signer = Signer(key=rogue, topics=device.topics, sequence=seq)
    # on the rogue key's own topic: a key the device does not trust
    topic = device.topics.coordinator_key(keys.fingerprint(rogue))
    result = device.verifier.open(topic, rogue_signer.control(topic, Kind.KEY_ROTATION, body, ttl=600))
    assert isinstance(result, Rejection) and result.reason is Reason.UNKNOWN_KEY
    # on the trusted key's topic, signed by another key: refused before any key is looked up
    topic = device.topics.coordinator_key(keys.fingerprint(trusted))
    with pytest.raises(ValueError):  # our own Signer will not even make it
        rogue_signer.control(topic, Kind.KEY_ROTATION, body, ttl=600)
    # a device key cannot rotate the coordinator's key even if the device trusts it as a device
    device.trust.add(rogue.public_key(), role="device")
    from edge_agent.protocol import canonical_json
    from edge_agent.protocol.envelope import _signing_input

    env = {"v": 1, "kind": "key_rotation", "from": keys.fingerprint(rogue), "seq": seq.next(),
           "iat": int(time.time()), "exp": int(time.time()) + 600, "body": body}
    env["sig"] = __import__("base64").b64encode(rogue.sign(_signing_input(
        f"{FLEET}/coordinator/key/{keys.fingerprint(trusted)}", b"J", canonical_json(env)))).decode()
    result = device.verifier.open(topic, canonical_json(env))
    assert isinstance(result, Rejection) and result.reason is Reason.WRONG_SIGNER


def test_devices_refusing_commands_as_unknown_key_show_in_status(fleet_dir: Path, tmp_path, capsys) -> None:
    coord = Coordinator(ServeOptions(state_dir=fleet_dir, fleet=FLEET))
    try:
        with Registry(state_dir=fleet_dir) as reg:
            (dev,) = reg.list_devices()
        device_key = keys.generate_private_key()  # a second approved device, to sign its refusal
        coord.registry.enrol_device(device_id=keys.fingerprint(device_key), public_key=public_key_text(device_key),
                                    fleet=FLEET, approved=True)
        coord.device_trust.sync()
        signer = Signer(key=device_key, topics=coord.topics, sequence=SequenceCounter(path=tmp_path / "seq"))
        topic = coord.topics.device(keys.fingerprint(device_key), "progress")
        refusal = {"reason": "unknown_key", "detail": f"key {coord.key_id} is not enrolled", "ref_kind": "cmd",
                   "ref_cmd_id": "job-1-r1", "ref_topic": coord.topics.device(keys.fingerprint(device_key), "cmd")}
        result = coord.pending.open(topic, signer.control(topic, Kind.REFUSAL, refusal, ttl=600))
        assert isinstance(result, Message)
        coord.handle(result)
        assert not [p for p in coord.problems if p.startswith("unknown_key")]  # 1 of 2 devices: not fleet-wide yet
        coord.refusals.unknown_key[dev.id] = time.time()  # the other device said the same a moment ago
        coord.handle(coord.pending.open(topic, signer.control(topic, Kind.REFUSAL, refusal, ttl=600)))
        coord._heartbeat()
        code, out, _ = run(capsys, "status", "--state-dir", str(fleet_dir))
        assert code == 0
        line = next(ln for ln in out.splitlines() if ln.startswith("PROBLEM: unknown_key"))
        assert "2 device(s) refuse this coordinator's commands as signed by a key they do not know" in line
        assert coord.key_id in line and "edge-coordinator key rotate" in line
        # the device takes a command again (its progress names one): the problem goes
        progress = {"phase": "accepted", "cmd_id": "job-2-r1", "detail": "ok"}
        coord.handle(coord.pending.open(topic, signer.control(topic, Kind.PROGRESS, progress, ttl=600)))
        assert not [p for p in coord.problems if p.startswith("unknown_key")]
    finally:
        coord.close()


def test_parse_public_key_round_trip() -> None:  # (the form the rotation carries)
    key = keys.generate_private_key()
    assert keys.fingerprint(parse_public_key(public_key_text(key))) == keys.fingerprint(key)
