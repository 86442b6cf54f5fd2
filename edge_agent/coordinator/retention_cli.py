"""`edge-coordinator prune`: the retention policy (retention.py) from the command line."""

from __future__ import annotations

import json
from typing import Any

from ..errors import InputError
from .records import check_id
from .retention import (
    RetractQueue,
    add_retention_args,
    apply,
    plan,
    policy_from_args,
    set_tag,
    truncate_wal,
)

PRUNE_HELP = """\
Apply the retention policy to the coordinator's state directory: keep the current version of
each model, the versions devices report running, tagged versions and registered bundles,
and the newest --keep-versions; delete every other version's head, patch and archive and
retract its retained messages from the broker (the serving coordinator does that: the
retractions are queued in STATE_DIR/retention/retract.json); delete the stored update
payloads of rounds that ended more than --keep-update-days ago (rejected ones at once).

A dry run unless --apply: it prints what it would keep (and why) and delete (and the bytes).
`serve` applies the same policy by itself (--keep-versions, --keep-update-days, --prune-every)."""

PRUNE_EPILOG = """\
examples:
  edge-coordinator prune                          # what would go, and why the rest stays
  edge-coordinator prune --apply --keep-versions 48
  edge-coordinator prune --tag digits@job-5f2c9a1b07de-r12   # always keep this version"""


def _model_ref(text: str) -> tuple[str, str]:
    name, sep, version = text.partition("@")
    if not sep:
        raise InputError(f"{text!r}: expected NAME@VERSION")
    return check_id(name, "model name"), check_id(version, "model version")


def cmd_prune(args: Any) -> int:
    from .fleet_cli import open_registry

    with open_registry(args, create=True) as reg:
        for ref, on in [(t, True) for t in args.tag or []] + [(t, False) for t in args.untag or []]:
            name, version = _model_ref(ref)
            set_tag(reg, name, version, tagged=on)
            print(f"{'tagged' if on else 'untagged'} {name} {version}")
        if args.tag or args.untag:
            return 0
        result = plan(reg, policy_from_args(args))
        freed = apply(reg, result) if args.apply else 0
        if args.apply:
            truncate_wal(reg)
        if args.json:
            print(json.dumps({**result.to_json(), "applied": bool(args.apply), "freed": freed}, indent=2))
            return 0
        for line in result.lines():
            print(line)
        verb = "pruned" if args.apply else "would prune (dry run; --apply to delete)"
        print(f"{verb}: {result.summary()}")
        queued = len(RetractQueue(reg).pending())
        if args.apply and queued:
            print(f"{queued} retained publication(s) queued for retraction: the serving coordinator clears them")
    return 0


def add_prune_command(sub: Any) -> None:
    import argparse

    from .fleet_parser import _state_arg

    p = sub.add_parser("prune", help="delete old model versions and update payloads (dry run unless --apply)",
                       description=PRUNE_HELP, epilog=PRUNE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _state_arg(p)
    add_retention_args(p)
    p.add_argument("--apply", action="store_true", help="delete (default: only print what would go)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--tag", action="append", metavar="NAME@VERSION", help="always keep this version (repeatable)")
    p.add_argument("--untag", action="append", metavar="NAME@VERSION", help="remove a tag (repeatable)")
    p.set_defaults(func=cmd_prune)
