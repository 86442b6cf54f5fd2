"""`edge-agent predict` and `edge-agent serve`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..errors import EXIT_DATAERR, EXIT_OK, InputError, UsageError

log = logging.getLogger(__name__)
MAX_STDIN_BYTES = 64 << 20

PREDICT_DESCRIPTION = """\
Classify images or arrays with a model bundle: the int8 backbone on the engine this device
selected for it (the same decision `finetune` uses, cached in STATE_DIR/cache) and the
trained tail -- in numpy when it is one dense layer or a tail numpy computes, so MXNet is
not even imported. Inputs: image files (PNG, JPEG, BMP, PGM/PPM; resized down to the
model's input as training reads them), folders of them (recursively), .npy arrays (one
sample or a batch (N, C, H, W)), .npz files with an array `x`, or `-` for standard input.
A bad input is reported on stderr and skipped; the exit code is then 65."""

PREDICT_EPILOG = """\
examples:
  edge-agent predict --model /var/lib/edge-agent/models/digits-cnn/current photo.png
  edge-agent predict --model digits-cnn --state-dir /var/lib/edge-agent captures/ --json
  edge-agent predict --model bundle/ --head job/head.params --depth 2 samples.npz -k 3
  cat photo.jpg | edge-agent predict --model bundle/ -"""


def _resolve_model(text: str, state_dir: Path, tmp: Path) -> Any:
    from ..int8.bundle import load_bundle
    from ..int8.bundle_files import unpack_bundle

    p = Path(text)
    if p.is_file():
        return unpack_bundle(p, tmp / "bundle")
    if p.is_dir():
        return load_bundle(p)
    installed = state_dir / "models" / text / "current"
    if installed.is_dir():
        return load_bundle(installed.resolve())
    raise UsageError(f"--model {text}: not a bundle directory, archive, or a model installed in {state_dir / 'models'}")


def _inputs(paths: list[str], spec: Any, max_pixels: int) -> Any:
    """(name, raw (N, C, H, W)) per input, or (name, InputError) for one that is unusable."""
    from .inputs import decode, expand_paths

    for path in expand_paths(paths):
        name = "-" if path is None else str(path)
        try:
            if path is None:
                data = sys.stdin.buffer.read(MAX_STDIN_BYTES + 1)
                if len(data) > MAX_STDIN_BYTES:
                    raise InputError(f"-: standard input is over {MAX_STDIN_BYTES} bytes")
            else:
                from ..atomic import read_limited

                data = read_limited(path, MAX_STDIN_BYTES)
            yield name, decode(data, spec, where=name, max_pixels=max_pixels, max_samples=1 << 20)
        except (InputError, OSError) as exc:
            yield name, exc


def _cmd_predict(args: argparse.Namespace) -> int:
    from ..int8.cli import default_state_dir
    from .predictor import open_predictor, tail_params, top_k

    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    if args.depth and not args.head:
        raise UsageError("--depth needs --head: the tail trained at that depth")
    with tempfile.TemporaryDirectory(prefix="edge-agent-predict-") as tmp:
        bundle = _resolve_model(args.model, state_dir, Path(tmp))
        params = tail_params(bundle.at_depth(args.depth), args.head) if args.head else None
        predictor = open_predictor(bundle, depth=args.depth, params=params, engine=args.engine,
                                   state_dir=state_dir / "cache")
        version = f"{bundle.manifest.name}/{bundle.manifest.version}" + (f"+{Path(args.head).name}" if args.head else "")
        log.debug("predict: %s on engine %s, tail %s", version, predictor.engine, predictor.tail_kind)
        failed = 0
        out = sys.stdout
        if not args.json:
            out.write(f"# model {version}, depth {args.depth}, engine {predictor.engine}, tail {predictor.tail_kind}\n")
        try:
            for name, raw in _inputs(args.inputs, predictor.spec, args.max_pixels):
                if isinstance(raw, Exception):
                    failed += 1
                    print(f"edge-agent predict: {raw}", file=sys.stderr)
                    continue
                for i, ranked in enumerate(top_k(predictor.logits(raw), predictor.labels, args.k)):
                    where = name if len(raw) == 1 else f"{name}[{i}]"
                    if args.json:
                        out.write(json.dumps({"input": where, **ranked.to_json(), "model": version}) + "\n")
                    else:
                        rest = "  ".join(f"{lab} {score:.3f}" for lab, score in zip(ranked.labels[1:], ranked.scores[1:],
                                                                                    strict=True))
                        out.write(f"{where}\t{ranked.labels[0]}\t{ranked.scores[0]:.3f}" + (f"\t{rest}" if rest else "") + "\n")
                out.flush()
        finally:
            predictor.close()
    return EXIT_DATAERR if failed else EXIT_OK


SERVE_DESCRIPTION = """\
Run the local inference service alone (what `edge-agent run` starts when agent.toml has
[serve] enabled = true), for a device that predicts and learns without a coordinator, or to
try the service. It serves the model installed under the state directory (models/NAME/
current) and stores labelled samples into [data] dir. See docs/deployment.md, "Local
inference", for the endpoints and curl examples."""


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..config import load_config
    from .server import InferenceServer

    config = load_config(args.config)
    server = InferenceServer.from_config(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, frame: stop.set())
    server.start()
    print(f"serving on {server.options.socket_path}" + (f" and 127.0.0.1:{server.port}" if server.port else ""),
          file=sys.stderr, flush=True)
    try:
        stop.wait()
    finally:
        server.stop()
    return EXIT_OK


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1")
    return int(text)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("predict", help="classify images or arrays with a model bundle (top-k labels)",
                              description=PREDICT_DESCRIPTION, epilog=PREDICT_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders, .npy/.npz files, or - (stdin)")
    p.add_argument("--model", required=True, metavar="BUNDLE",
                   help="a bundle directory or archive, or the name of a model installed in --state-dir")
    p.add_argument("--head", metavar="FILE", help="a trained head.params (a fine-tune's) instead of the bundle's")
    p.add_argument("--depth", type=int, default=0, metavar="N", help="the depth --head was trained at (default 0)")
    p.add_argument("-k", "--top-k", dest="k", type=_positive_int, default=3, metavar="K", help="labels per input (default 3)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--engine", help="force an int8 engine (default: this device's cached selection)")
    p.add_argument("--state-dir", metavar="DIR", help="state directory (selection cache, installed models)")
    p.add_argument("--max-pixels", type=_positive_int, default=40_000_000, metavar="N",
                   help="refuse images with more pixels than this (decompression bombs)")
    p.set_defaults(func=_cmd_predict)

    s = subparsers.add_parser("serve", help="run the local inference service alone (HTTP on a Unix socket)",
                              description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--config", default="/etc/edge-agent/agent.toml", metavar="FILE", help="agent.toml ([serve], [data])")
    s.set_defaults(func=_cmd_serve)
