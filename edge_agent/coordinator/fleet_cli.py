"""The fleet commands of `edge-coordinator`: serve, key, devices, approve, train, status,
models, cancel (and `model register`, added to the `model` group by cli.py).

`serve` is the only long-running process. Every other command opens the same SQLite
registry (WAL: reads never block the service) and either reads it or writes a row the
running `serve` acts on at its next tick (about a second): a new job, a cancelled job, an
approval. `train` then follows the job by polling the registry until it ends; Ctrl-C only
stops watching.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import EXIT_OK, EXIT_UNAVAILABLE, ConfigError, EdgeAgentError, InputError, UsageError
from .fleet_views import (
    device_rows,
    devices_json,
    engine_choice_lines,
    job_detail,
    job_json,
    jobs_table,
    model_rows,
    progress_line,
    refusal_lines,
    table,
)
from .registry_choices import MAX_KINDS
from .server_set import StoredServerSets, attach, packed_for
from .train_params import job_params, privacy_forecast


class Unavailable(EdgeAgentError):
    """Nothing to run on: no eligible device, no coordinator serving."""

    exit_code = EXIT_UNAVAILABLE


def state_dir(args: argparse.Namespace) -> Path:
    return Path(os.path.expanduser(args.state_dir)).resolve()


def open_registry(args: argparse.Namespace, *, create: bool = False) -> Any:
    """The registry every command opens: SQLite in --state-dir, or --db (default
    $EDGE_COORDINATOR_DB) in PostgreSQL. Without `create`, a missing SQLite file is an error
    (a PostgreSQL registry is created, or migrated, by whoever opens it first)."""
    from .db import resolve
    from .registry import DB_NAME, Registry

    root = state_dir(args)
    url = resolve(getattr(args, "db", None))
    if url is None and not create and not (root / DB_NAME).exists():
        raise InputError(f"{root}: no coordinator registry here (run `edge-coordinator serve --state-dir {root}` "
                         "first, or pass the right --state-dir or --db)")
    return Registry(state_dir=root, db=url or "sqlite")


_registry = open_registry


# ---------------------------------------------------------------- serve
def _check_tls_files(args: argparse.Namespace) -> bool:
    """Whether to use TLS (--tls, or any TLS file); the files are loaded now as the MQTT client
    will load them, so a bad one is one line and exit 64, not a traceback."""
    from ..config import tls_file_problems

    if bool(args.cert_file) != bool(args.key_file):
        raise UsageError("--cert-file and --key-file go together (the coordinator's client certificate)")
    for which, why in tls_file_problems(args.ca_file, args.cert_file, args.key_file):
        raise UsageError(f"--{which.replace('_', '-')} {why}")
    return bool(args.tls or args.ca_file or args.cert_file)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..transport.mqtt import TlsConfig
    from .retention import policy_from_args
    from .rounds import RoundPolicy
    from .service import Coordinator, ServeOptions

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("edge_agent.transport.mqtt.paho", "amqtt", "transitions"):  # the embedded broker is chatty
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tls_on = _check_tls_files(args)
    host, port = args.broker
    port = port or (8883 if tls_on else 1883)
    tls = TlsConfig(ca_certs=args.ca_file, certfile=args.cert_file, keyfile=args.key_file) if tls_on else None
    password = None
    if args.password_file:
        try:
            password = Path(args.password_file).read_text(encoding="utf-8")[:4096].strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--password-file {args.password_file}: {getattr(exc, 'strerror', None) or exc}") from None
    policy = RoundPolicy(online_within_s=args.online_within, offline_grace_s=args.offline_grace,
                         min_battery_pct=args.min_battery,
                         aggregator=args.aggregator, max_wait_s=args.max_wait)
    from .db import resolve

    options = ServeOptions(state_dir=state_dir(args), db=resolve(args.db), host=host, port=port, fleet=args.fleet,
                           topic_prefix=args.topic_prefix, tls=tls, username=args.username, password=password,
                           auto_approve=args.auto_approve, tick_s=args.tick, policy=policy,
                           metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                           ack_interval=args.ack_interval, retention=policy_from_args(args),
                           workers_group=args.workers_group, worker_id=args.worker_id,
                           silence_s=args.silence_alert)
    if args.workers_group and args.embedded_broker:  # amqtt has no $share/ subscriptions
        raise UsageError("--workers-group needs a broker with MQTT shared subscriptions (mosquitto 2, EMQX, "
                         "HiveMQ, VerneMQ), not --embedded-broker")
    if args.ui_token and not args.ui:
        raise UsageError("--ui-token needs --ui ADDR:PORT")
    if args.ui:
        from ..dashboard.server import check_ui_options

        check_ui_options(args.ui, args.ui_token)  # a bad address or a missing token: exit 64 before starting
    broker = None
    if args.embedded_broker:
        from ..transport.broker import BrokerError, EmbeddedBroker

        if host not in ("127.0.0.1", "localhost", "::1"):
            raise UsageError(f"--embedded-broker listens on loopback only; --broker {host} is not loopback")
        bind = "127.0.0.1" if host == "localhost" else host
        _check_port_free(bind, port, f"--embedded-broker on --broker {host}:{port}",
                         "another broker (or serve) listens there: pick another --broker port, or drop "
                         "--embedded-broker to use that broker")
        broker = EmbeddedBroker(port=port, host=bind)
        try:
            broker.start()
        except BrokerError as exc:
            raise ConfigError(f"--embedded-broker on --broker {host}:{port}: {exc}") from None
        logging.getLogger(__name__).info("embedded MQTT broker (amqtt) on %s:%d: for trials and the demo, "
                                         "not for production", host, port)
    metrics = server = None
    stop, signals = threading.Event(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, _: (signals.append(num), stop.set()))
    try:
        if args.metrics_port is not None:
            from .metrics import CoordinatorMetrics  # prometheus-client: only when asked for

            metrics = CoordinatorMetrics()
            try:
                server = metrics.serve(port=args.metrics_port, address=args.metrics_addr)
            except OSError as exc:
                raise ConfigError(f"--metrics-port {args.metrics_port} (--metrics-addr {args.metrics_addr}): cannot "
                                  f"listen there: {exc.strerror or exc}; another process uses it? pick another "
                                  "port (0: any free one)") from None
            logging.getLogger(__name__).info("Prometheus metrics on %s", server.url)
        coordinator = Coordinator(options, metrics=metrics)
        ui = None
        try:
            if args.ui:
                from ..dashboard.server import start_ui  # starlette, uvicorn: only when asked for

                ui = start_ui(options.state_dir, address=args.ui, token_file=args.ui_token, policy=policy,
                              db=options.db)
                logging.getLogger(__name__).info("dashboard on %s", ui.url)
            code = coordinator.run(stop)
            return 130 if signal.SIGINT in signals else code  # Ctrl-C: EXIT_INTERRUPTED; SIGTERM: 0
        finally:
            if ui is not None:
                ui.close()
            coordinator.close()
    finally:
        if server is not None:
            server.close()
        if broker is not None:
            broker.stop()


def _check_port_free(host: str, port: int, what: str, hint: str) -> None:
    """A TCP port someone already listens on is a ConfigError naming the flag, before a
    library (amqtt) fails on it with a traceback."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{what}: cannot listen there: {exc.strerror or exc}; {hint}") from None


def cmd_key(args: argparse.Namespace) -> int:
    from .service_files import PUBLIC_KEY_FILE, coordinator_key

    _, text = coordinator_key(state_dir(args))
    print(text)
    if args.verbose:
        print(f"(also in {state_dir(args) / PUBLIC_KEY_FILE}; give it to `edge-agent init --coordinator-key`)",
              file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------- devices and approval
def cmd_devices(args: argparse.Namespace) -> int:
    if getattr(args, "release", None):
        with _registry(args) as reg:
            dev = _resolve(reg.list_devices(), args.release)
            was = dev.quarantine_reason or "not quarantined"
            reg.release_device(dev.id)
        print(f"released {dev.id} ({was}): it is selected for rounds again")
        return EXIT_OK
    with _registry(args) as reg:
        if getattr(args, "engine_choices", False):
            print(json.dumps([c.choice.to_json() for c in reg.engine_choices()], indent=2))
            return EXIT_OK
        devices = reg.list_devices()
        policy = _policy(args)
        if args.json:
            print(json.dumps(devices_json(devices, policy, time.time()), indent=2))
            return EXIT_OK
        shared = reg.engine_choices(limit=MAX_KINDS)
        problems = _serve_problems(args)
        if not devices:
            print("no devices yet: start an agent (`edge-agent run`) pointed at this coordinator's broker"
                  + ("" if problems else ", on the same fleet"))
            for problem in problems:
                print(f"PROBLEM: {problem}")
            return EXIT_OK
        print(table(device_rows(devices, policy, time.time())))
        if shared:
            print("\nint8 engines the fleet shares (a device of the kind re-checks it instead of measuring):\n"
                  + "\n".join(engine_choice_lines(shared, devices, time.time())))
        refusing = refusal_lines(devices, time.time())
        if refusing:
            print("\nnot taking jobs now:\n" + "\n".join(refusing))
        for d in devices:
            if d.quarantined:
                print(f"\nQUARANTINED {d.id}: {d.quarantine_reason} -- not selected; "
                      f"edge-coordinator devices --release {d.id}")
        pending = [d.id for d in devices if not d.approved]
        if pending:
            print(f"\n{len(pending)} waiting for approval: edge-coordinator approve {' '.join(pending[:3])}"
                  + (" ..." if len(pending) > 3 else ""))
        for problem in problems:
            print(f"\nPROBLEM: {problem}")
    return EXIT_OK


def _link_line(info: dict[str, Any]) -> str:
    """serve's loopback check (link_health.py), as `status` shows it."""
    link = info.get("link") if isinstance(info.get("link"), dict) else {}
    ok_at, failed = link.get("loopback_ok_at"), link.get("loopback_failed_since")
    if isinstance(failed, int | float):
        return "link: the broker drops this coordinator's messages (see PROBLEM)"
    if isinstance(ok_at, int | float):
        return (f"link: the broker delivers this coordinator's messages (checked "
                f"{time.strftime('%H:%M:%S', time.localtime(ok_at))})")
    return "link: not checked yet (serve checks within 30 s of connecting)"


def _serve_problems(args: argparse.Namespace) -> list[str]:
    """What the running serve reports as wrong (serve.json): its link silent, its counter behind..."""
    from .service_files import read_serve_file, serving

    info = read_serve_file(state_dir(args))
    if not serving(info):
        return []
    return [str(p)[:1000] for p in (info.get("problems") or [])[:10]]


def _resolve(devices: list[Any], ref: str) -> Any:
    """A device by id, enrolment code (ABCD-EFGH-IJKL), unique id prefix (>= 4 characters)
    or unique name (the one its hello announced). Several matches: UsageError naming them."""
    want = ref.strip()
    exact = [d for d in devices if d.id == want.lower()]
    if exact:
        return exact[0]
    parts = want.split("-")
    code = "".join(parts).lower() if len(parts) == 3 and all(len(p) == 4 for p in parts) else None
    matches = {d.id: d for d in devices
               if (code is not None and d.id.startswith(code))
               or (len(want) >= 4 and d.id.startswith(want.lower()))
               or (want and str(d.state.get("name") or "") == want)}
    if not matches:
        raise InputError(f"no enrolled device matches {ref!r}: give its id, id prefix, enrolment code or name "
                         "(see `edge-coordinator devices`)")
    if len(matches) > 1:
        listed = "; ".join(f"{d.id} ({d.state.get('name') or 'no name'}, {'approved' if d.approved else 'pending'})"
                           for d in list(matches.values())[:10])
        raise UsageError(f"{ref!r} matches {len(matches)} devices: {listed}; give the id or a longer prefix")
    return next(iter(matches.values()))


def _enrolment_line(line: str) -> dict[str, str]:
    words = line.split()
    if not words or not words[0].startswith("edge-agent-enrol/"):
        raise InputError("an enrolment line starts with edge-agent-enrol/1 (printed by `edge-agent init`)")
    fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    missing = [k for k in ("fleet", "id", "key") if k not in fields]
    if missing:
        raise InputError(f"enrolment line lacks {', '.join(missing)}")
    return fields


def cmd_approve(args: argparse.Namespace) -> int:
    with _registry(args, create=bool(args.line)) as reg:
        targets = []
        for line in args.line or []:
            fields = _enrolment_line(line)
            dev = reg.enrol_device(device_id=fields["id"], public_key=fields["key"], fleet=fields["fleet"],
                                   profile=fields.get("profile", "")[:128] if fields.get("profile") != "none" else "")
            targets.append(dev)
        devices = reg.list_devices()
        targets += [_resolve(devices, ref) for ref in args.devices]
        if args.all_pending:
            targets += [d for d in devices if not d.approved]
        if not targets:
            raise InputError("name devices to approve (id, id prefix, enrolment code or name), --line, or --all-pending")
        from ..keys import enrolment_code, public_key_from_bytes

        for dev in {d.id: d for d in targets}.values():
            reg.set_approved(dev.id, not args.revoke)
            code = enrolment_code(public_key_from_bytes(base64.b64decode(dev.public_key)))
            print(f"{'revoked' if args.revoke else 'approved'} {dev.id} (enrolment code {code}, "
                  f"{dev.board or 'board not reported yet'})")
    return EXIT_OK


def cmd_tag(args: argparse.Namespace) -> int:
    with _registry(args) as reg:
        dev = _resolve(reg.list_devices(), args.device)
        tags = set(dev.tags)
        tags = tags - set(args.tags) if args.remove else tags | set(args.tags)
        dev = reg.set_tags(dev.id, sorted(tags))
        print(f"{dev.id}: tags {', '.join(dev.tags) or '(none)'}")
    return EXIT_OK


# ---------------------------------------------------------------- models
def cmd_register(args: argparse.Namespace) -> int:
    from .artefacts import ModelArtefacts

    with _registry(args, create=True) as reg:
        mv = ModelArtefacts(reg).register_bundle(args.bundle, name=args.name, version=args.version,
                                                 parent=args.parent)
        art = ModelArtefacts(reg).archive_for(mv)
        print(f"registered {mv.name} {mv.version}: head tensors {', '.join(reg.load_head(mv))}; archive "
              f"{art.path} ({art.size} bytes, sha256 {art.sha256[:16]}...)")
        side = packed_for(Path(args.bundle))
        validation = args.validation or (side if side.is_file() else None)
        if validation is not None:
            _attach_server_set(reg, mv, validation)
        print(f"train it: edge-coordinator train --model {mv.name} --devices all --rounds 3")
    return EXIT_OK


def _attach_server_set(reg: Any, mv: Any, path: str | Path) -> None:
    sha, n, summary = attach(reg, mv, path)
    reg.set_model_server_set(mv.name, sha, n)
    print(f"server set of {mv.name}: {summary} (id {sha[:16]}); every version is scored on it and jobs "
          "aggregate with the trust rule by default")


def cmd_server_set(args: argparse.Namespace) -> int:
    with _registry(args) as reg:
        mv = _model(reg, args.model)
        if args.path is None:
            found = reg.model_server_set(mv.name)
            print(f"{mv.name}: " + (f"server set {found[0][:16]}, {found[1]} samples" if found else
                                    "no server set (attach one: edge-coordinator model server-set NAME DIR|NPZ)"))
            return EXIT_OK
        _attach_server_set(reg, mv, args.path)
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    if args.name == "rollback" or args.rollback or args.to_best:
        return _rollback(args)
    with _registry(args) as reg:
        models = reg.list_models(args.name)
        if args.json:
            print(json.dumps([{**m.__dict__} for m in models], indent=2, default=str))
            return EXIT_OK
        if not models:
            print("no models registered: edge-coordinator model register BUNDLE --name NAME --version 1")
            return EXIT_OK
        print(table(model_rows(models)))
    return EXIT_OK


def _rollback(args: argparse.Namespace) -> int:
    from .plateau import rollback

    rest = list(args.rollback or [])
    if args.name != "rollback" or not 1 <= len(rest) <= 2 or (len(rest) == 2) == bool(args.to_best):
        raise UsageError("usage: edge-coordinator models rollback NAME VERSION | models rollback NAME --to-best JOB")
    with _registry(args) as reg:
        mv = rollback(reg, rest[0], rest[1] if len(rest) == 2 else None, best_of=args.to_best)
        print(f"{mv.name} {mv.version} (the head of {mv.parent}) is now the current version: the next job "
              f"trains from it, devices fetch it with their next command")
    return EXIT_OK


# ---------------------------------------------------------------- jobs
def _policy(args: argparse.Namespace) -> Any:
    """The running serve's round policy (serve.json), else the defaults."""
    from .rounds import RoundPolicy
    from .service_files import read_serve_file

    info = read_serve_file(state_dir(args)) or {}
    raw = info.get("policy") if isinstance(info.get("policy"), dict) else {}
    try:
        return RoundPolicy(**{k: v for k, v in raw.items() if k in RoundPolicy.__dataclass_fields__})
    except (TypeError, ValueError, EdgeAgentError):
        return RoundPolicy()


def _model(reg: Any, ref: str) -> Any:
    name, _, version = ref.partition("@")
    from .records import check_id

    check_id(name, "model name")
    versions = reg.list_models(name)
    if not versions:
        known = sorted({m.name for m in reg.list_models()})
        raise InputError(f"unknown model {name!r}; registered: {', '.join(known) or 'none'} "
                         "(edge-coordinator model register BUNDLE --name NAME)")
    if not version:
        return versions[-1]
    for mv in versions:
        if mv.version == version:
            return mv
    raise InputError(f"model {name} has no version {version!r}; it has {', '.join(m.version for m in versions)}")


def cmd_train(args: argparse.Namespace) -> int:
    from .records import parse_selector
    from .rounds import RoundEngine
    from .selection import select_devices
    from .service_files import read_serve_file, serving

    params = job_params(args)
    with _registry(args) as reg:
        mv = _model(reg, args.model)
        if args.validation:
            sha, n, summary = attach(reg, mv, args.validation)
            params["server_set"] = sha
            print(f"server set for this job: {summary} (id {sha[:16]})")
        parse_selector(args.devices)
        policy = _policy(args)
        sel = select_devices(reg.list_devices(), args.devices, now=time.time(), online_within_s=policy.online_within_s,
                             min_battery_pct=float(params.get("min_battery_pct", policy.min_battery_pct)),
                             budget_wh=args.budget_wh, allow_unknown_power=policy.allow_unknown_power,
                             needs=frozenset({"secagg"}) if params.get("secagg") else frozenset())  # (their hello's)
        if not sel.eligible and not sel.ineligible:
            raise Unavailable(f"no enrolled device matches {args.devices!r} "
                              f"({len(reg.list_devices())} enrolled; see `edge-coordinator devices`)")
        if len(sel.eligible) < args.min_devices:
            why = "\n".join(f"  {d}: {r}" for d, r in sel.ineligible.items())
            msg = (f"{len(sel.eligible)} eligible device(s) for {args.devices}, --min-devices is {args.min_devices}:\n"
                   f"{why}")
            if not args.wait_for_devices:
                raise Unavailable(msg + "\n(--wait-for-devices queues the job anyway; it starts when enough "
                                        "devices are eligible, or fails after --deadline)")
            print(msg)
        job = RoundEngine(registry=reg, policy=policy, evidence=StoredServerSets(reg)).start_job(
            model_name=mv.name, model_version=mv.version, selector=args.devices, rounds=args.rounds,
            min_devices=args.min_devices, deadline_s=args.deadline, budget_wh=args.budget_wh, params=params)
        print(f"job {job.id}: {args.rounds} round(s) of {mv.name} {mv.version} on {args.devices} "
              f"(>= {args.min_devices} device(s), {args.deadline:.0f} s per round"
              + (f", {args.budget_wh:g} Wh per device" if args.budget_wh else "") + ")")
        why = job.params.get("aggregator_default")
        print(f"aggregator: {job.params['aggregator']}" + (f" (the default: {why})" if why else " (as asked)"))
        if "dp_clip" in job.params:
            print(privacy_forecast(job.params, args.rounds, len(sel.eligible) + len(sel.ineligible)))
        if job.params.get("mode") == "async":
            print(f"asynchronous: a version every {job.params['buffer']} accepted update(s), updates at most "
                  f"{job.params['max_staleness']} version(s) stale; --rounds {args.rounds} counts versions")
        if not serving(read_serve_file(state_dir(args))):
            print("warning: no `edge-coordinator serve` is running on this state directory; the job starts "
                  "when it does", file=sys.stderr)
        if args.detach:
            print(f"follow it: edge-coordinator status {job.id}")
            return EXIT_OK
        return _follow(reg, job.id, interval=args.poll)


def _follow(reg: Any, job_id: str, *, interval: float) -> int:
    """Print a line whenever the job's progress changes, until it ends (or Ctrl-C)."""
    from .records import JobStatus

    last = ""
    try:
        while True:
            line, job = progress_line(reg, job_id, time.time())
            if line != last:
                print(line, flush=True)
                last = line
            if job.status.terminal:
                print(job_detail(reg, job_id), flush=True)
                return EXIT_OK if job.status is JobStatus.DONE else 1
            time.sleep(interval)
    except KeyboardInterrupt:
        print(f"\nstopped watching; job {job_id} keeps running (edge-coordinator status {job_id}, "
              f"edge-coordinator cancel {job_id})")
        return 130


def cmd_status(args: argparse.Namespace) -> int:
    with _registry(args) as reg:
        if args.job:
            reg.get_job(args.job)
            if args.json:
                print(json.dumps(job_json(reg, args.job), indent=2))
            else:
                print(job_detail(reg, args.job))
            return EXIT_OK
        jobs = reg.list_jobs()
        if args.json:
            print(json.dumps([job_json(reg, j.id) for j in jobs], indent=2))
            return EXIT_OK
        from .service_files import read_serve_file, serving

        info = read_serve_file(state_dir(args))
        print(f"coordinator: {'serving ' + str(info.get('broker')) if serving(info) else 'not running'}"
              + (f", fleet {info.get('fleet')}" if info else ""))
        if serving(info):
            print(_link_line(info))
        for problem in (info.get("problems") or [])[:10] if serving(info) else []:
            print(f"PROBLEM: {str(problem)[:1000]}")
        print(table(jobs_table(reg, jobs)) if jobs else "no jobs yet: edge-coordinator train --model NAME ...")
        refusing = refusal_lines(reg.list_devices(), time.time())
        if refusing:
            print("devices not taking jobs now (skipped by round selection):\n" + "\n".join(refusing))
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from .records import JobStatus

    with _registry(args) as reg:
        job = reg.get_job(args.job)
        if job.status.terminal:
            raise InputError(f"job {job.id} is already {job.status} ({job.reason or 'no reason recorded'})")
        reg.set_job_status(job.id, JobStatus.CANCELLED, args.reason)
        print(f"job {job.id} cancelled; the coordinator tells its devices to stop at its next tick")
    return EXIT_OK
