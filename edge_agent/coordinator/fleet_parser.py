"""The argument parser of the fleet commands (`edge-coordinator serve|key [rotate]|devices|approve|
train|status|models|cancel` and `model register`): options, help texts with examples.
The commands themselves are in fleet_cli.py."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..protocol.facts import parse_broker
from ..protocol.finetune import MAX_DISTILL
from .fleet_cli import (
    cmd_approve,
    cmd_cancel,
    cmd_devices,
    cmd_key,
    cmd_models,
    cmd_register,
    cmd_serve,
    cmd_server_set,
    cmd_status,
    cmd_tag,
    cmd_train,
)
from .records import MAX_ROUNDS
from .strategies import AGGREGATORS

DEFAULT_STATE_DIR = "~/.local/share/edge-coordinator"
STATE_ENV = "EDGE_COORDINATOR_STATE_DIR"


def _duration(text: str) -> float:
    """90, 90s, 15m, 2h -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    scale = units.get(raw[-1:])
    try:
        value = float(raw[:-1] if scale else raw) * (scale or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90, 90s, 15m or 2h, got {text!r}") from None
    if not 0 < value <= 30 * 86400:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be between 1 s and 30 days")
    return value


def _number(kind: type, lo: float, hi: float) -> Any:
    """An argparse type: a finite int or float within lo..hi (a bad value is a usage error, 64)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not lo <= value <= hi:  # also refuses NaN and inf
            span = f"{lo}..{hi}" if kind is int else f"{lo:g}..{hi:g}"
            raise argparse.ArgumentTypeError(f"must be within {span}, got {text!r}")
        return value
    return parse


_COUNT = _number(int, 1, 1_000_000)  # the registry's limit on min_devices
_SECONDS = _number(float, 0.001, 86400)


def _depth(text: str) -> str | int:
    """--depth: auto, head or a number 0..8 (the agent's own parser says what is wrong)."""
    from ..errors import UsageError
    from ..train.depth_plan import parse_depth

    try:
        return parse_depth(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("depth: ")) from None


def _param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: Any = raw
    for cast in (int, float):
        try:
            value = cast(raw)
            break
        except ValueError:
            continue
    if raw in ("true", "false"):
        value = raw == "true"
    return key, value


SERVE_HELP = """\
Run the coordinator: connect to the MQTT broker, enrol devices from their signed hellos,
record their state, run the training jobs that `edge-coordinator train` queues (signed
finetune commands, collection until each round's deadline, dropouts recorded with their
reason, FedAvg or trimmed-mean aggregation), and publish every new model version (retained,
signed, chunked). Everything is kept in --state-dir (SQLite registry, keys, bundles): a
restarted coordinator resumes its rounds and loses no received update.

On first start it creates its Ed25519 key and prints the public key; give it to each
device (`edge-agent init --coordinator-key KEY`). SIGTERM or Ctrl-C stops it cleanly."""

SERVE_EPILOG = """\
examples:
  edge-coordinator serve --embedded-broker --auto-approve          # a laptop trial, the demo
  edge-coordinator serve --broker mqtt.example.net:8883 --tls --ca-file ca.pem \\
      --cert-file coordinator.pem --key-file coordinator.key --fleet farms \\
      --state-dir /var/lib/edge-coordinator --metrics-port 9466"""

TRAIN_HELP = """\
Queue a training job and follow it: R rounds; each round sends a signed finetune command
to the eligible devices (selector, approved, online, battery, energy for --budget-wh),
collects their compressed updates until --deadline (or until every device has reported
or dropped out), aggregates them into a new model version, and the next round trains
from that version. A device that refuses, fails or is silent is a dropout (listed with
its reason); a round with fewer than --min-devices accepted updates fails.

Before queueing, the devices matching --devices are checked now; if too few are eligible
each one's reason is printed and nothing is queued (unless --wait-for-devices).

Knowing when to stop. Each device measures the version it is sent on its own validation
split before training on it, so every round tells the coordinator the previous version's
global accuracy (weighted by samples, averaged over the last few versions to smooth out
which devices took part; `status JOB` names the best version).
With --patience N the job ends once N versions in a row did not beat the best by more
than --min-delta points, and its last version is the best one restored (the drift after
the peak is not what the fleet keeps); --on-plateau decay halves the server learning rate
instead (up to 3 times, then stops). Without --patience the job runs all its rounds.
`edge-coordinator models rollback NAME --to-best JOB` brings the best version back later.

The server optimiser turns the round's aggregate (the devices' mean update) into the step:
fedavg adds it as it is (times --server-lr, default 1); fedavgm keeps a momentum across
rounds (--momentum, default 0.9; smooths the round-to-round pull of non-IID devices);
fedadam (default --server-lr 0.01) scales each weight's step by its own recent size
(Reddi et al. 2021, "Adaptive Federated Optimization").

--async (FedBuff, Nguyen et al. 2022) suits fleets whose devices have energy at different
hours (solar): a round closes as soon as --buffer updates are accepted and the next starts at
once on the new version with the devices that are free; a device still training keeps its
version and its update joins whichever round is open when it arrives, weighed 1/sqrt(1+s)
for s versions of staleness, and refused beyond --max-staleness. Choosing K and S:
docs/solar-deployment.md."""

TRAIN_EPILOG = """\
examples:
  edge-coordinator train --model digits --devices all --rounds 3 --min-devices 2 \\
      --deadline 10m --budget-wh 0.5 --epochs 3
  edge-coordinator train --model birds@2 --devices tag:orchard --rounds 5 --min-devices 10 \\
      --deadline 2h --budget-wh 2 --aggregator trimmed_mean --devices-per-round 20 --detach
  edge-coordinator train --model digits --devices board:raspberry-pi-5 --param patience=2
  edge-coordinator train --model digits --rounds 300 --patience 20 --min-delta 0.2 \
      --server-opt fedavgm --server-lr 0.5 --momentum 0.5 --on-plateau decay --detach
  edge-coordinator train --model digits --devices tag:solar --async --buffer 10 --max-staleness 4 \
      --rounds 200 --deadline 6h --detach

Ctrl-C stops watching; the job keeps running (edge-coordinator status JOB / cancel JOB)."""


KEY_HELP = """\
Print the coordinator's Ed25519 public key (base64), creating the key pair in STATE_DIR/keys
on first use. Devices refuse commands not signed by it.

`key rotate` (with serve stopped) makes a new key and keeps the old one in keys/retired/;
serve then publishes the new key signed by the old one, and every device that trusts the old
key switches to the new one by itself. A lost key cannot sign that: restore it from a backup.
If it is gone for good, `key rotate --without-old-key` makes a key no device can verify, and
every device needs `edge-agent init --coordinator-key NEWKEY --force`."""

KEY_EPILOG = """\
examples:
  edge-agent init --coordinator-key "$(edge-coordinator key)" ...
  systemctl stop edge-coordinator && edge-coordinator key rotate && systemctl start edge-coordinator"""


def _key_command(args: argparse.Namespace) -> int:
    if args.action == "rotate":
        from .key_rotation import cmd_key_rotate

        return cmd_key_rotate(args)
    if args.without_old_key:
        from ..errors import UsageError

        raise UsageError("--without-old-key goes with `key rotate`")
    return cmd_key(args)


def _state_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=os.environ.get(STATE_ENV, DEFAULT_STATE_DIR), metavar="DIR",
                   help=f"the coordinator's registry, keys and bundles (default ${STATE_ENV} or {DEFAULT_STATE_DIR})")
    p.add_argument("--db", default=None, metavar="URL",
                   help="the registry in PostgreSQL (postgresql://USER@HOST[:PORT]/DB; the password from "
                        "~/.pgpass or $PGPASSWORD) instead of SQLite in --state-dir (default $EDGE_COORDINATOR_DB); "
                        "array files stay in --state-dir, which workers sharing a database must share too")


def add_fleet_commands(sub: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("serve", help="run the coordinator service (MQTT, rounds, publishing)",
                       description=SERVE_HELP, epilog=SERVE_EPILOG, formatter_class=fmt)
    _state_arg(s)
    s.add_argument("--broker", type=parse_broker, default=("127.0.0.1", None), metavar="HOST[:PORT]",
                   help="MQTT broker (default 127.0.0.1:1883; 8883 with --tls)")
    s.add_argument("--embedded-broker", action="store_true",
                   help="run an in-process MQTT broker (amqtt) on the --broker loopback address: trials, demo")
    s.add_argument("--fleet", default="default", help="fleet name, a topic level (default 'default')")
    s.add_argument("--topic-prefix", default="edgeft/v1", help="MQTT topic prefix (default edgeft/v1)")
    s.add_argument("--tls", action="store_true", help="connect with TLS")
    s.add_argument("--ca-file", help="CA certificate(s) for TLS (default: the system's); implies --tls")
    s.add_argument("--cert-file", help="client certificate for mutual TLS")
    s.add_argument("--key-file", help="client certificate's private key")
    s.add_argument("--username", help="broker user name")
    s.add_argument("--password-file", metavar="FILE", help="file holding the broker password")
    s.add_argument("--auto-approve", action="store_true",
                   help="approve every device that says hello (trials and the demo; otherwise `approve`)")
    s.add_argument("--metrics-port", type=_number(int, 0, 65535), default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: any free port; default: off)")
    s.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR", help="metrics address (default 127.0.0.1)")
    s.add_argument("--ui", default=None, metavar="ADDR:PORT",
                   help="serve the read-only web dashboard here, e.g. 127.0.0.1:8080 (default: off)")
    s.add_argument("--ui-token", default=None, metavar="FILE",
                   help="bearer token file the dashboard requires (needed for a non-loopback --ui)")
    s.add_argument("--online-within", type=_duration, default=300.0, metavar="DURATION",
                   help="a device is online if heard from within this (default 300 s)")
    s.add_argument("--offline-grace", type=_duration, default=30.0, metavar="DURATION",
                   help="a device whose broker will arrives mid-round is a dropout if it is not back within this "
                        "(default 30 s; a broker restart or a flapping link sends wills too)")
    s.add_argument("--min-battery", type=_number(float, 0, 100), default=30.0, metavar="PCT",
                   help="select devices with at least this battery, unless on power (default 30)")
    s.add_argument("--aggregator", choices=AGGREGATORS, default=None,
                   help="the aggregator of every job that names none (default: chosen per job by its fleet size "
                        "and whether the model has a server set: trust, median_trust or trimmed_mean; "
                        "docs/fleet.md has the table)")
    s.add_argument("--max-wait", type=_duration, default=None, metavar="DURATION",
                   help="how long a round waits for enough eligible devices (default: the job's deadline)")
    s.add_argument("--tick", type=_SECONDS, default=1.0, metavar="S", help="seconds between round steps (default 1)")
    s.add_argument("--silence-alert", type=_duration, default=600.0, metavar="DURATION",
                   help="connected this long without one message from any device: say so in `status` and the "
                        "log (a wrong --fleet, or a broker ACL for another fleet; default 10m)")
    s.add_argument("--ack-interval", type=_SECONDS, default=5.0, metavar="S",
                   help="at most one ack per repeated upload per S seconds (default 5)")
    s.add_argument("--workers-group", default=None, metavar="NAME",
                   help="one of several serve workers on one PostgreSQL registry (--db): devices' messages "
                        "arrive through the MQTT shared subscription $share/NAME/...; one worker (elected in "
                        "PostgreSQL) runs the rounds; workers on several hosts need one shared --state-dir "
                        "(docs/fleet.md, Several workers on PostgreSQL). Default: a lone serve")
    s.add_argument("--worker-id", default=None, metavar="ID",
                   help="this worker's id in its group (its MQTT client id suffix; default HOST-PID)")
    from .retention import add_retention_args

    add_retention_args(s, serve=True)  # what serve keeps (edge-coordinator prune explains)
    s.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser("key", help="print the coordinator's public key (created on first use), or `key rotate`",
                       description=KEY_HELP, epilog=KEY_EPILOG, formatter_class=fmt)
    _state_arg(k)
    k.add_argument("action", nargs="?", choices=("show", "rotate"), default="show",
                   help="show (default) or rotate: a new key, signed by the old one so devices follow")
    k.add_argument("--without-old-key", action="store_true",
                   help="with rotate: the old key is lost; make a new one no device can verify (re-enrol them all)")
    k.add_argument("-v", "--verbose", action="store_true", help="also say where the key is kept")
    k.set_defaults(func=_key_command)

    d = sub.add_parser("devices", help="list devices: approval, online, battery, board, engine, last seen",
                       description="List enrolled devices as the registry knows them (from their signed hello "
                                   "and state messages).",
                       epilog="examples:\n  edge-coordinator devices\n  edge-coordinator devices --json\n"
                              "  edge-coordinator devices --engine-choices > choices.json",
                       formatter_class=fmt)
    _state_arg(d)
    d.add_argument("--json", action="store_true", help="print JSON")
    d.add_argument("--engine-choices", action="store_true",
                   help="print the fleet's int8 engine choices as the JSON list every finetune command carries "
                        "(for `edge-agent finetune --engine-choices FILE` on a device by hand)")
    d.add_argument("--release", metavar="DEVICE", help="lift the quarantine of a device whose updates were "
                   "repeatedly screened out (it is selected for rounds again)")
    d.set_defaults(func=cmd_devices)

    a = sub.add_parser("approve", help="approve (or --revoke) devices so their messages are accepted",
                       description="A device enrols itself with a self-signed hello and waits for approval; only "
                                   "approved devices' states and updates are accepted. Compare the enrolment code "
                                   "(`edge-coordinator devices`, column CODE) with the one `edge-agent init` and `run` "
                                   "printed on the device.",
                       epilog="examples:\n  edge-coordinator approve 7kq3xw2mzp4v\n"
                              "  edge-coordinator approve ABCD-EFGH-IJKL\n  edge-coordinator approve barn-pi-1"
                              "          # the name its hello announced, if unique\n"
                              "  edge-coordinator approve --all-pending\n"
                              "  edge-coordinator approve --line 'edge-agent-enrol/1 fleet=farms id=... key=...'",
                       formatter_class=fmt)
    _state_arg(a)
    a.add_argument("devices", nargs="*", metavar="DEVICE", help="device id, unique id prefix (>= 4), enrolment code or unique name")
    a.add_argument("--all-pending", action="store_true", help="approve every device waiting for approval")
    a.add_argument("--line", action="append", metavar="LINE",
                   help="pre-enrol and approve from the line `edge-agent init` printed (repeatable)")
    a.add_argument("--revoke", action="store_true", help="withdraw approval instead")
    a.set_defaults(func=cmd_approve)

    g = sub.add_parser("tag", help="add (or --remove) tags on a device, for `train --devices tag:X`",
                       description="Tags group devices for `train --devices tag:NAME` (e.g. by site or crop).",
                       epilog="examples:\n  edge-coordinator tag 7kq3xw2m orchard north\n"
                              "  edge-coordinator tag 7kq3xw2m north --remove", formatter_class=fmt)
    _state_arg(g)
    g.add_argument("device", metavar="DEVICE", help="device id, unique id prefix (>= 4), enrolment code or unique name")
    g.add_argument("tags", nargs="+", metavar="TAG", help="tags ([A-Za-z0-9._-], up to 64 characters)")
    g.add_argument("--remove", action="store_true", help="remove these tags instead")
    g.set_defaults(func=cmd_tag)

    t = sub.add_parser("train", help="queue R fine-tune rounds on a set of devices and follow them",
                       description=TRAIN_HELP, epilog=TRAIN_EPILOG, formatter_class=fmt)
    _state_arg(t)
    t.add_argument("--model", required=True, metavar="NAME[@VERSION]", help="registered model (default: latest)")
    t.add_argument("--devices", default="all", metavar="all|tag:X|board:Y",
                   help="which devices (board: matches the board model or profile name); default all")
    t.add_argument("--rounds", type=_number(int, 1, MAX_ROUNDS), default=1, metavar="R", help="rounds (default 1)")
    t.add_argument("--min-devices", type=_COUNT, default=1, metavar="N",
                   help="accepted updates a round needs to produce a version (default 1)")
    t.add_argument("--deadline", type=_duration, default=600.0, metavar="DURATION",
                   help="per round: stop collecting after this (default 10m)")
    t.add_argument("--budget-wh", type=float, default=None, metavar="WH", help="energy each device may spend")
    t.add_argument("--power-cap-w", type=float, default=None, metavar="W", help="average power cap on devices")
    t.add_argument("--epochs", type=int, default=None, help="training epochs on each device")
    t.add_argument("--depth", type=_depth, default=None, metavar="auto|head|N",
                   help="how deep each device trains a multi-depth model (model create --depths): auto "
                        "(the device plans from its memory cap and budget; the agent's default), head, or "
                        "a depth N. A fleet at one fixed depth aggregates like-for-like updates")
    t.add_argument("--augment", type=_number(int, 0, 8), default=None, metavar="K",
                   help="K augmented views of each training image on the devices (crop, brightness)")
    t.add_argument("--distill", type=_number(float, 0, MAX_DISTILL), default=None, metavar="W",
                   help="weight of each device's pull towards the version it was sent, on the classes other "
                        "than each sample's own (not-true distillation; default 0, off, in a job): label-skewed "
                        "devices then keep what the fleet knew of the classes they seldom see, but in simulated "
                        "fleets it cost accuracy (README, 'Not forgetting what the fleet knew')")
    t.add_argument("--bn", choices=("frozen", "update"), default=None,
                   help="BatchNorm statistics in the trained tail (device default: update)")
    t.add_argument("--tail", choices=("full", "bias"), default=None,
                   help="train every tail parameter (device default) or only biases/BN and the classifier")
    t.add_argument("--batch-size", type=int, default=None, help="training batch size on each device")
    t.add_argument("--lr", type=float, default=None, help="learning rate")
    t.add_argument("--update-bytes", type=int, default=None, metavar="BYTES", help="byte budget of each update")
    t.add_argument("--validation", metavar="DIR|NPZ", default=None,
                   help="a server set for this job only (default: the model's, `model server-set`)")
    t.add_argument("--aggregator", choices=AGGREGATORS, default=None,
                   help="aggregation rule (default: serve's --aggregator if set, else chosen by the fleet's size "
                        "and whether the model has a server set -- trust with one, median_trust up to 100 "
                        "devices per round, trimmed_mean beyond; train prints which and why)")
    t.add_argument("--devices-per-round", type=_COUNT, default=None, metavar="K",
                   help="sample K of the eligible devices each round (default: all)")
    t.add_argument("--async", dest="async_mode", action="store_true",
                   help="asynchronous buffered rounds: devices train when their energy allows, each version "
                        "aggregates the next --buffer updates; --rounds counts versions (see below)")
    t.add_argument("--buffer", type=_number(int, 1, 100_000), default=None, metavar="K",
                   help="--async: publish a version every K accepted updates (default: --min-devices x 2)")
    t.add_argument("--max-staleness", type=_number(int, 0, 1_000), default=None, metavar="S",
                   help="--async: refuse updates trained on a version more than S versions old (default 4)")
    t.add_argument("--max-concurrency", type=_number(int, 1, 10_000_000), default=None, metavar="C",
                   help="--async: at most C devices training at once, in flight included (default: no cap; "
                        "the energy knob: more devices in flight publish faster and spend more)")
    t.add_argument("--server-opt", choices=("fedavg", "fedavgm", "fedadam"), default=None,
                   help="server optimiser applied to each round's aggregate (default fedavg)")
    t.add_argument("--server-lr", type=_number(float, 1e-6, 100.0), default=None, metavar="LR",
                   help="server learning rate (default 1; fedadam 0.01)")
    t.add_argument("--momentum", type=_number(float, 0.0, 0.999), default=None, metavar="B",
                   help="fedavgm's momentum, fedadam's beta1 (default 0.9)")
    t.add_argument("--patience", type=_number(int, 1, 10_000), default=None, metavar="N",
                   help="stop (or decay) after N versions without improving the global accuracy (default: off)")
    t.add_argument("--min-delta", type=_number(float, 0.0, 50.0), default=None, metavar="POINTS",
                   help="an improvement is a gain of more than this many accuracy points (default 0.2)")
    t.add_argument("--on-plateau", choices=("stop", "decay"), default=None,
                   help="at a plateau: stop and restore the best version (default), or halve the server lr")
    t.add_argument("--dp-clip", type=_number(float, 1e-9, 1e6), default=None, metavar="C",
                   help="a private job (user-level DP, DP-FedAvg): every update's L2 norm is clipped to C, on the "
                        "device and at the coordinator; needs --dp-noise. Aggregates with dp_fedavg")
    t.add_argument("--dp-noise", type=_number(float, 1e-6, 1e3), default=None, metavar="SIGMA",
                   help="the noise multiplier: Gaussian noise of std SIGMA x C on each round's clipped sum")
    t.add_argument("--dp-epsilon", type=_number(float, 1e-6, 1e4), default=None, metavar="EPS",
                   help="the job's privacy budget: it stops (done) before a round would spend more than EPS")
    t.add_argument("--dp-delta", type=_number(float, 1e-12, 0.1), default=None, metavar="D",
                   help="delta of the (epsilon, delta) guarantee (default 1e-5; keep it below 1 / devices)")
    t.add_argument("--secure-aggregation", dest="secure", action="store_true",
                   help="secure aggregation (SecAgg+): the coordinator learns only the sum of each round's updates, "
                        "never one; aggregates with the plain mean (dp_fedavg with --dp-*: each device adds its share "
                        "of the noise); devices must advertise it; not with --async or a robust --aggregator")
    t.add_argument("--secagg-phase", dest="secagg_phase_s", type=_duration, default=None, metavar="DURATION",
                   help="--secure-aggregation: each phase after training (shares, masked input, unmasking) closes "
                        "after DURATION at the latest; a device silent past it drops out (default 2m)")
    t.add_argument("--param", type=_param, action="append", metavar="KEY=VALUE",
                   help="any other job parameter passed to the devices (repeatable)")
    t.add_argument("--wait-for-devices", action="store_true",
                   help="queue the job even if too few devices are eligible now")
    t.add_argument("--detach", action="store_true", help="queue the job and return")
    t.add_argument("--poll", type=_SECONDS, default=1.0, metavar="S", help="progress polling interval (default 1 s)")
    t.set_defaults(func=cmd_train)

    st = sub.add_parser("status", help="jobs and their rounds (one job in detail with JOB)",
                        description="Jobs with their rounds: devices selected, updates accepted or rejected "
                                    "(and why), dropouts (and why), bytes, energy and the versions produced.",
                        epilog="examples:\n  edge-coordinator status\n  edge-coordinator status job-5f2c9a1b07de "
                               "--json", formatter_class=fmt)
    _state_arg(st)
    st.add_argument("job", nargs="?", help="a job id")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=cmd_status)

    m = sub.add_parser("models", help="list model versions; `models rollback` makes an earlier one current again",
                       description="Model versions: registered bundles and the head-only versions rounds produced.\n\n"
                                   "`models rollback NAME VERSION` (or `--to-best JOB`: the best version that job "
                                   "measured) registers a copy of that version's head as the newest version "
                                   "(VERSION-rbN, parent VERSION): the next job trains from it and devices fetch "
                                   "it with their next command. Nothing is deleted.",
                       epilog="examples:\n  edge-coordinator models\n  edge-coordinator models digits --json\n"
                              "  edge-coordinator models rollback digits job-5f2c9a1b07de-r41\n"
                              "  edge-coordinator models rollback digits --to-best job-5f2c9a1b07de",
                       formatter_class=fmt)
    _state_arg(m)
    m.add_argument("name", nargs="?", help="only this model (or `rollback`)")
    m.add_argument("rollback", nargs="*", metavar="NAME [VERSION]", help="with `rollback`: the model and version")
    m.add_argument("--to-best", metavar="JOB", default=None,
                   help="with `rollback`: the best version job JOB measured (its devices' validation accuracy)")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=cmd_models)

    c = sub.add_parser("cancel", help="cancel a job (its devices are told to stop)",
                       description="Cancel a job: its active round ends as cancelled and the running coordinator "
                                   "sends `cancel` to the devices still working on it.",
                       epilog="example:\n  edge-coordinator cancel job-5f2c9a1b07de --reason 'wrong model'",
                       formatter_class=fmt)
    _state_arg(c)
    c.add_argument("job", help="job id")
    c.add_argument("--reason", default="cancelled by operator", help="recorded with the job")
    c.set_defaults(func=cmd_cancel)


def add_register_command(msub: Any) -> None:
    """`edge-coordinator model register`: part of the `model` group."""
    r = msub.add_parser("register", help="register a bundle with the coordinator so devices can train it",
                        description="Store a bundle (directory or archive from `model create`) in the coordinator's "
                                    "state directory and register its head parameters as a model version. Rounds "
                                    "then produce head-only versions of it.",
                        epilog="examples:\n  edge-coordinator model register models/digits-1.tar.gz --name digits "
                               "--version 1\n  edge-coordinator model register bundle-dir/   # name and version "
                               "from its manifest", formatter_class=argparse.RawDescriptionHelpFormatter)
    _state_arg(r)
    r.add_argument("bundle", metavar="BUNDLE", help="bundle directory or .tar.gz archive")
    r.add_argument("--name", help="model name (default: the manifest's)")
    r.add_argument("--version", help="version (default: the manifest's)")
    r.add_argument("--parent", help="a registered version this one derives from")
    r.add_argument("--validation", metavar="DIR|NPZ", default=None,
                   help="the model's server set: labelled samples (image folders, CSV or NPZ; 100-500, 200+ resolve "
                        "half a point) that score every version and judge every update (default: BUNDLE.server-set"
                        ".npz from `model create --validation`, when there is one)")
    r.set_defaults(func=cmd_register)
    ss = msub.add_parser("server-set", help="attach (or show) a model's server set",
                         description="The server set is a small labelled data set the coordinator keeps: 60 % of it "
                                     "(by content hash) scores every candidate version before it is published (the "
                                     "validation gate, and the version's accuracy in status, the dashboard, the "
                                     "plateau rule and rollback), the rest trains the coordinator's own update that "
                                     "the trust aggregator compares every device update with.",
                         epilog="examples:\n  edge-coordinator model server-set digits labelled/      # one folder per "
                                "label\n  edge-coordinator model server-set digits             # show it",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    _state_arg(ss)
    ss.add_argument("model", metavar="NAME[@VERSION]", help="registered model")
    ss.add_argument("path", nargs="?", metavar="DIR|NPZ", help="labelled samples to attach (none: show the current)")
    ss.set_defaults(func=cmd_server_set)
