"""agent.toml: merged over the board profile, validated with file:line errors; the device
id is the key's fingerprint, never chosen."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent import keys
from edge_agent.config import (
    load_config,
    load_identity,
    parse_public_key,
    public_key_text,
    render_config,
)
from edge_agent.errors import EXIT_CONFIG, ConfigError

BOARDS = Path(__file__).resolve().parents[1] / "fixtures" / "boards"
KEY = "MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE="  # base64 DER (SubjectPublicKeyInfo)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def _rendered(tmp_path: Path, **kw: object) -> str:
    args = dict(device_name="pi-farm-07", fleet="farms", broker_host="127.0.0.1", broker_port=1883,
                coordinator_public_key=KEY, state_dir=tmp_path / "state",
                sysfs_root=str(BOARDS / "raspberry-pi-4"))
    args.update(kw)
    return render_config(**args)  # type: ignore[arg-type]


def test_rendered_config_loads_and_merges_over_the_matched_profile(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, _rendered(tmp_path)))
    assert config.device_name == "pi-farm-07" and config.fleet == "farms"
    assert config.configured_device_id is None  # derived from the key, not configured
    assert config.profile is not None and config.profile.name == "raspberry-pi-4"
    assert config.get("power", "idle_w") == 2.7  # from the profile
    assert config.get("budget", "energy_wh") == 3.0  # the profile's own budget
    assert config.get("broker", "max_message_bytes") == 128 * 1024  # agent default
    assert config.topic_prefix == "edgeft/v1"
    assert config.key_file == tmp_path / "state" / "keys" / "device.key"
    assert public_key_text(config.coordinator_public_key) == public_key_text(parse_public_key(KEY))


def test_the_device_id_is_the_key_fingerprint_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    key = keys.generate_private_key()
    keys.save_private_key(tmp_path / "state" / "keys" / "device.key", key)
    config = load_config(_write(tmp_path, _rendered(tmp_path)))
    loaded, device_id = load_identity(config)
    assert device_id == keys.fingerprint(key) and keys.fingerprint(loaded) == device_id
    # init writes the id down for the operator; it must agree with the key
    config = load_config(_write(tmp_path, _rendered(tmp_path, device_id=device_id)))
    assert load_identity(config)[1] == device_id
    other = keys.fingerprint(keys.generate_private_key())
    config = load_config(_write(tmp_path, _rendered(tmp_path, device_id=other)))
    with pytest.raises(ConfigError, match=rf"device.id: '{other}' is not the fingerprint") as info:
        load_identity(config)
    assert info.value.exit_code == EXIT_CONFIG
    (tmp_path / "state" / "keys" / "device.key").unlink()
    with pytest.raises(ConfigError, match="key file not found"):
        load_identity(load_config(_write(tmp_path, _rendered(tmp_path))))


def test_coordinator_key_forms(tmp_path: Path) -> None:
    coord = keys.generate_private_key()
    raw = public_key_text(coord)
    pem = (tmp_path / "c.pem")
    keys.save_public_key(pem, coord)
    for form in (raw, pem.read_text()):
        assert keys.fingerprint(parse_public_key(form)) == keys.fingerprint(coord)
    for bad in ("not base64!", "AAAA", raw[:-4]):
        with pytest.raises(ValueError, match="Ed25519 public key"):
            parse_public_key(bad)
    text = _rendered(tmp_path, coordinator_public_key="c2hvcnQ=")
    with pytest.raises(ConfigError, match=r":\d+: coordinator.public_key: not a base64 or PEM Ed25519"):
        load_config(_write(tmp_path, text))


def test_agent_toml_overrides_profile_budget(tmp_path: Path) -> None:
    text = _rendered(tmp_path) + "\n[budget]\nenergy_wh = 0.5\n"
    config = load_config(_write(tmp_path, text))
    assert config.get("budget", "energy_wh") == 0.5
    assert config.get("budget", "battery_floor_pct") == 30.0  # still from base


def test_named_profile_instead_of_auto(tmp_path: Path) -> None:
    text = _rendered(tmp_path, profile="raspberry-pi-zero-2w")
    assert load_config(_write(tmp_path, text)).get("power", "idle_w") == 0.6
    with pytest.raises(ConfigError, match=r"agent.toml:\d+: device.profile: no profile named 'pi-9'"):
        load_config(_write(tmp_path, _rendered(tmp_path, profile="pi-9")))


@pytest.mark.parametrize(("edit", "message"), [
    (('name = "pi-farm-07"', 'name = "pi/farm#7"'), r":6: device.name: use letters"),
    (("# id = (the", 'id = "a/b" # (the'), r":5: device.id: use letters"),
    (("port = 1883", "port = 70000"), r":\d+: broker.port: 70000 is above the maximum"),
    (("port = 1883", 'port = "1883"'), r":\d+: broker.port: must be an integer, got str"),
    (("tls = false", "tls = 1"), r":\d+: broker.tls: must be a boolean"),
    (('topic_prefix = "edgeft/v1"', 'topic_prefix = "a/+/b"'), r":\d+: broker.topic_prefix: '/'-separated"),
    (("[policy]", "[polcy]"), r":\d+: polcy: unknown table"),
    (("min_battery_pct = 40", "min_battery_pct = 140"), r"policy.min_battery_pct: 140 is above"),
])
def test_bad_values_are_reported_with_file_and_line(tmp_path: Path, edit: tuple[str, str], message: str) -> None:
    text = _rendered(tmp_path).replace(*edit, 1)
    assert text != _rendered(tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(_write(tmp_path, text))
    assert info.value.exit_code == EXIT_CONFIG
    assert str(info.value).startswith(str(tmp_path / "agent.toml"))


def test_missing_required_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"coordinator.public_key is required"):
        load_config(_write(tmp_path, '[device]\nname = "a"\n[broker]\nhost = "h"\n'))
    with pytest.raises(ConfigError, match=r":1: cannot read"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"TOML syntax"):
        load_config(_write(tmp_path, "[device\n"))
    client_cert_without_key = _rendered(tmp_path, tls=True).replace(
        '# cert_file = "/etc/edge-agent/device.pem"', 'cert_file = "/etc/edge-agent/device.pem"')
    with pytest.raises(ConfigError, match=r"cert_file and key_file go together"):
        load_config(_write(tmp_path, client_cert_without_key))
    missing_ca = _rendered(tmp_path, tls=True).replace('# ca_file = "/etc/edge-agent/ca.pem"',
                                                       f'ca_file = "{tmp_path}/none.pem"')
    with pytest.raises(ConfigError, match=r":\d+: broker.ca_file: .*none.pem: no such file"):
        load_config(_write(tmp_path, missing_ca))


def test_tls_needs_a_usable_ca_and_client_certificate(tmp_path: Path) -> None:
    from edge_agent import certs

    ca = certs.create_ca(tmp_path / "certs")
    device = certs.issue(tmp_path / "certs", "pi-farm-07")
    no_ca = _rendered(tmp_path, tls=True)
    with pytest.raises(ConfigError, match=r":\d+: broker.tls: tls = true needs ca_file") as info:
        load_config(_write(tmp_path, no_ca))
    assert info.value.exit_code == EXIT_CONFIG
    not_pem = _rendered(tmp_path, tls=True, ca_file=str(device.key))
    with pytest.raises(ConfigError, match=r"broker.ca_file: .*pi-farm-07.key: not a PEM CA certificate"):
        load_config(_write(tmp_path, not_pem))
    mismatched = _rendered(tmp_path, tls=True, ca_file=str(ca.cert), cert_file=str(device.cert), key_file=str(ca.key))
    with pytest.raises(ConfigError, match=r"broker.cert_file: .*not a PEM certificate and its unencrypted"):
        load_config(_write(tmp_path, mismatched))
    good = load_config(_write(tmp_path, _rendered(tmp_path, tls=True, ca_file=str(ca.cert),
                                                  cert_file=str(device.cert), key_file=str(device.key))))
    assert good.get("broker", "tls") is True and good.get("broker", "cert_file") == str(device.cert)


def test_serve_table_defaults_and_errors_name_the_key(tmp_path: Path) -> None:
    from edge_agent.inference.server import ServeOptions

    config = load_config(_write(tmp_path, _rendered(tmp_path) + '\n[serve]\nenabled = true\n'))
    opts = ServeOptions.from_config(config, probe={})
    assert opts.socket_path == tmp_path / "state" / "inference.sock" and opts.port == 0 and opts.token is None
    assert opts.limits.max_inflight == 16 and opts.training_priority == "idle" and opts.guard_tolerance == 0.02
    for extra, words in (("port = 8765", "serve.port: a TCP port needs token_file"),
                         ('socket_group = "no-such-group-xyz"', "no group named 'no-such-group-xyz'"),
                         ('training_priority = "fast"', "training_priority"),
                         ("max_inflight = 0", "max_inflight")):
        with pytest.raises(ConfigError, match=words.replace(".", r"\W")):
            load_config(_write(tmp_path, _rendered(tmp_path) + f"\n[serve]\nenabled = true\n{extra}\n"))
