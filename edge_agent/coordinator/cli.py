"""`edge-coordinator`: the fleet-side command line.

Command groups register themselves like the agent's plugins: each entry of `_GROUPS` is a
function adding one subcommand group to the parser, so the fleet commands (enrol, train,
publish...) slot in next to `model` without touching the others. Handlers return an exit
code; an EdgeAgentError becomes one clear line on stderr and its documented exit code.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import EXIT_CODES, EXIT_OK, EXIT_USAGE, CliParser, InputError, run_command

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {what}" for code, what in EXIT_CODES.items())

CREATE_HELP = """\
Build a model bundle from a trained network: the frozen backbone (input -> SPLIT) as fp32
ONNX and as int8 TFLite (post-training quantisation on the calibration data), the head
(SPLIT -> output) as MXNet symbol + params, the calibration samples, and a manifest with
every file's sha256. The bundle is written to a temp directory, verified, then renamed,
so a failure never leaves a half-written bundle.

Training depths (--depths N, default 3): below the split the bundle also records up to N
block boundaries (the last 1x1 conv's input, then residual / concat block boundaries, or
each conv of a plain chain), each with its own int8 prefix and fp32 tail. A device then
trains as deep as its memory cap and energy budget allow (`edge-agent finetune --depth
auto`): the last block or two trained over cached int8 activations beats the head alone
by 5-15 points of held-out accuracy (BENCHMARKS.md, bench_depth).

Sources (one of):
  --onnx FILE                    an ONNX model (opset as exported by MXNet or PyTorch)
  --mxnet PREFIX                 an exported Gluon HybridBlock: PREFIX-symbol.json and
                                 PREFIX-0000.params (what HybridBlock.export(PREFIX) writes)
  --example                      a starter model for a first real round: the demo's digits
                                 CNN (labels 0-9, 8x8 grey), trained here in seconds on
                                 scikit-learn's bundled digits (the [demo] extra); with
                                 --example-data DIR, each example device's own digits
                                 (DIR/device-N/digits.npz, through its own simulated camera)
                                 to copy to a device's data folder

Calibration (--calib): an .npz holding an (N, C, H, W) float array named x, data or images
(already normalised), or a folder of .npy arrays (normalised) and/or images (.png/.jpg:
raw pixels, resized and normalised with --scale/--mean/--std), directly in it or in its
sub-folders (one level: a labelled data folder calibrates with every class).
"""

CREATE_EPILOG = """\
examples:
  edge-coordinator model create --onnx digits.onnx --split features_gap_fwd \\
      --calib calib.npz --labels 0,1,2,3,4,5,6,7,8,9 --name digits --version 1 \\
      --scale 0.0625 --output models/digits-1 --archive models/digits-1.tar.gz
  edge-coordinator model create --mxnet exported/net --split features_gap_fwd \\
      --calib images/ --labels labels.txt --name birds --version 2 --parent-version 1 \\
      --scale 0.00392157 --mean 0.485,0.456,0.406 --std 0.229,0.224,0.225 --output birds-2
  edge-coordinator model create --example --output models/digits-1 --example-data example-data
  edge-coordinator model nodes resnet18.onnx     # where to --split
  edge-coordinator model inspect models/digits-1.tar.gz
"""


def _depth_count(text: str) -> int:
    from ..int8.bundle import MAX_DEPTH

    if not text.isdigit() or not 0 <= int(text) <= MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"expected a whole number 0..{MAX_DEPTH}, got {text!r}")
    return int(text)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _shape(text: str) -> tuple[int, int, int]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"expected C,H,W (three positive integers), got {text!r}")
    return dims  # type: ignore[return-value]


def _labels(value: str) -> list[str]:
    """A file with one label per line, or a comma-separated list."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a long comma-separated list is not a file name (ENAMETOOLONG)
        is_file = False
    if is_file:
        from ..atomic import read_limited

        try:
            text = read_limited(path, 4 << 20).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}: labels file is not UTF-8 text") from None
        labels = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        labels = [v.strip() for v in value.split(",") if v.strip()]
    if not labels:
        raise InputError(f"--labels {value!r}: no labels")
    return labels


def _mxnet_block(prefix: str, input_name: str) -> Any:
    import warnings

    import mxnet as mx

    symbol, params = Path(f"{prefix}-symbol.json"), Path(f"{prefix}-0000.params")
    for path in (symbol, params):
        if not path.is_file():
            raise InputError(f"--mxnet {prefix}: {path} not found (HybridBlock.export writes both files)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return mx.gluon.SymbolBlock.imports(str(symbol), [input_name], str(params))
    except Exception as exc:  # MXNetError / JSON errors from a corrupt export
        raise InputError(f"--mxnet {prefix}: cannot load the exported block: {str(exc).strip()[:300]}") from None


def _mxnet_input_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """--input-shape, else the calibration arrays' (C, H, W)."""
    from ..int8.calibration_input import calibration_shape

    shape = args.input_shape or (calibration_shape(args.calib) if getattr(args, "calib", None) else None)
    if shape is None:
        raise InputError("--mxnet needs --input-shape C,H,W (or --calib with .npz/.npy arrays to take it from)")
    return shape


def _cmd_model_create(args: argparse.Namespace) -> int:
    from ..int8.bundle import pack_bundle
    from ..int8.bundle_create import create_bundle

    if args.example:
        return _cmd_model_example(args)
    missing = [f"--{n}" for n in ("calib", "labels", "name", "version") if not getattr(args, n)]
    if missing:
        from ..errors import UsageError

        raise UsageError(f"model create --onnx/--mxnet needs {', '.join(missing)}")
    if args.example_data:
        from ..errors import UsageError

        raise UsageError("--example-data goes with --example")
    if args.mxnet:
        source: Any = _mxnet_block(args.mxnet, args.input_name)
        args.input_shape = _mxnet_input_shape(args)
    else:
        source = Path(args.onnx)
    bundle = create_bundle(
        source, args.output, calibration=args.calib, labels=_labels(args.labels), name=args.name,
        version=args.version, split=args.split, input_shape=args.input_shape, scale=args.scale,
        mean=args.mean or (), std=args.std or (), parent_version=args.parent_version,
        method=args.method, edgetpu_model=args.edgetpu_model, overwrite=args.overwrite, depths=args.depths,
        bias_correction=args.bias_correction)
    print(f"bundle {bundle.path}: {bundle.manifest.name} {bundle.manifest.version} "
          f"(sha256 {bundle.sha256[:16]}...), split at {bundle.manifest.split_tensor!r}, "
          f"features {tuple(bundle.manifest.feature_shape)}")
    for line in _depth_lines(bundle.manifest):
        print(line)
    if args.archive:
        archive = pack_bundle(bundle.path, args.archive)
        print(f"archive {archive} ({archive.stat().st_size} bytes)")
    if args.validation:
        from ..atomic import atomic_write_bytes
        from .server_set import pack_server_set, packed_for, read_server_set

        data = read_server_set(args.validation, bundle)
        side = packed_for(Path(bundle.path))
        atomic_write_bytes(side, pack_server_set(data))
        print(f"server set {side}: {len(data)} labelled samples (kept beside the bundle, not in it); "
              "`model register` takes it with the bundle")
    return EXIT_OK


EXAMPLE_DEPTHS = 2  # the digits CNN's two convs below its pool (the demo's depths)


def _cmd_model_example(args: argparse.Namespace) -> int:
    """The demo's base bundle (edge_agent/sim/scenario.py): the digits CNN trained on clean
    digits no example device holds; and, with --example-data, each device's own share."""
    from ..errors import ConfigError, UsageError
    from ..int8.bundle import pack_bundle

    for flag, value in (("--calib", args.calib), ("--labels", args.labels), ("--split", args.split),
                        ("--parent-version", args.parent_version), ("--input-shape", args.input_shape)):
        if value:
            raise UsageError(f"--example builds its own model: drop {flag}")
    try:
        import sklearn  # noqa: F401 - the digits live in scikit-learn

        from ..sim import scenario as demo  # the simulation's room: imported only for --example
    except ImportError as exc:
        raise ConfigError(f"--example needs the [demo] extra ({exc.name}): pip install '/path/to/checkout[demo]'") from None
    scenario = demo.scenario()  # the base model's digits and three example devices' (none in common)
    bundle = demo.build_bundle(args.output, scenario.base_x, scenario.base_y, name=args.name or "digits",
                               version=args.version or "1", overwrite=args.overwrite,
                               depths=min(args.depths, EXAMPLE_DEPTHS))
    m = bundle.manifest
    print(f"bundle {bundle.path}: {m.name} {m.version} (sha256 {bundle.sha256[:16]}...), the example digits CNN "
          f"trained on {len(scenario.base_y)} clean digits; labels {','.join(m.labels)}, input 1x8x8 grey")
    for line in _depth_lines(m):
        print(line)
    if args.archive:
        archive = pack_bundle(bundle.path, args.archive)
        print(f"archive {archive} ({archive.stat().st_size} bytes)")
    if args.example_data:
        root = Path(args.example_data)
        for i, dev in enumerate(scenario.devices, 1):
            written = demo.write_data(root / f"device-{i}", dev.images, dev.labels, "npz")
            written.rename(written.with_name("digits.npz"))
            print(f"example data for a device: {written.with_name('digits.npz')} ({len(dev.labels)} digits through "
                  "its own simulated camera)")
    print(f"register it: edge-coordinator model register {bundle.path} --name {m.name} --version {m.version}")
    return EXIT_OK


def _depth_lines(m: Any) -> list[str]:
    """One line per training depth of a multi-depth bundle."""
    return [f"depth {d.depth}: from {d.tensor!r} [{d.kind}, {'x'.join(map(str, d.feature_shape))}], "
            f"{d.costs.get('tail_params', 0):,} trainable parameters, "
            f"{d.costs.get('tail_macs', 0) / 1e6:.2f} M tail MACs per sample" for d in m.depths]


def _cmd_model_nodes(args: argparse.Namespace) -> int:
    from ..int8.cut_points import candidate_cuts
    from ..int8.onnx_import import load_onnx
    from ..int8.split_check import SplitChecker

    if args.mxnet:
        from ..int8.onnx_export import export_onnx

        where = f"gluon {args.mxnet}"
        model = load_onnx(export_onnx(_mxnet_block(args.mxnet, args.input_name), (1, *_mxnet_input_shape(args))))
    else:
        where = args.file
        model = load_onnx(args.file)
    cuts = candidate_cuts(model)
    checker = SplitChecker(model, where)  # what `model create --split` checks, without quantising
    verdicts = {} if args.no_check else {c.name: checker.check(c.name) for c in cuts}
    if args.json:
        print(json.dumps([{**c.to_json(), **({"create": verdicts[c.name].to_json()} if verdicts else {})}
                          for c in cuts], indent=2))
        return EXIT_OK
    if not cuts:
        print("no single-tensor block boundary found (any node or tensor name can still be given to --split)")
        return EXIT_OK
    width = max(len(c.name) for c in cuts)
    print(f"{'SPLIT':<{width}}  {'SHAPE':<16} {'KIND':<16}" + ("" if args.no_check else " CREATE"))
    for c in cuts:
        line = f"{c.name:<{width}}  {c.shape_text():<16} {c.kind:<16}"
        if verdicts:
            line += " " + _verdict_text(verdicts[c.name], where)
        print(line.rstrip())
    return EXIT_OK


def _verdict_text(verdict: Any, where: str) -> str:
    """`model nodes`' CREATE column: yes, or no and create's own reason."""
    if verdict.accepted:
        return "yes" if verdict.head_checked else "yes (head not checked: MXNet is not installed)"
    reason = verdict.reason or ""
    return "no: " + (reason[len(where) + 2:] if reason.startswith(f"{where}: ") else reason)


def _cmd_model_inspect(args: argparse.Namespace) -> int:
    from ..int8.bundle import load_bundle, unpack_bundle

    with tempfile.TemporaryDirectory(prefix="edge-coordinator-inspect-") as tmp:
        path = Path(args.bundle)
        bundle = unpack_bundle(path, Path(tmp) / "bundle") if path.is_file() else load_bundle(path)
        manifest = bundle.manifest.to_json()
    if args.json:
        print(json.dumps({"sha256": bundle.sha256, "verified": True, "manifest": manifest}, indent=2))
        return EXIT_OK
    m = bundle.manifest
    spec = m.input
    lines = [
        f"bundle:    {args.bundle} (sha256 {bundle.sha256}; every file verified)",
        f"model:     {m.name} {m.version}" + (f" (parent {m.parent_version})" if m.parent_version else ""),
        f"created:   {m.created or '?'} from {m.source or '?'}",
        f"input:     {spec.name} {spec.layout} {'x'.join(map(str, spec.shape))} {spec.dtype}; "
        f"x = (raw * {spec.scale:g} - mean {list(spec.mean)}) / std {list(spec.std)}",
        f"split:     {m.split_tensor!r} (node {m.split_node or '-'}) -> features {tuple(m.feature_shape)}",
        f"labels:    {len(m.labels)}: {', '.join(m.labels[:12])}{' ...' if len(m.labels) > 12 else ''}",
        *(["depths:"] + [f"  {line}" for line in _depth_lines(m)] if m.depths else []),
        "files:",
    ]
    lines += [f"  {name:<30} {entry.size:>10} B  sha256 {entry.sha256[:16]}..."
              for name, entry in sorted(m.files.items())]
    print("\n".join(lines))
    return EXIT_OK


def add_model_commands(sub: Any) -> None:
    model = sub.add_parser("model", help="create and inspect model bundles",
                           description="Model bundles: what devices download, verify and fine-tune.")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    create = msub.add_parser("create", help="build a bundle (and its archive) from an ONNX or MXNet model",
                             description=CREATE_HELP, epilog=CREATE_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    src = create.add_mutually_exclusive_group(required=True)
    src.add_argument("--onnx", metavar="FILE", help="ONNX model file")
    src.add_argument("--mxnet", metavar="PREFIX", help="exported Gluon block: PREFIX-symbol.json + PREFIX-0000.params")
    src.add_argument("--example", action="store_true",
                     help="a starter model: the demo's digits CNN, trained here on scikit-learn's digits (see above)")
    create.add_argument("--example-data", metavar="DIR", default=None,
                        help="with --example: write each of three example devices' digits to DIR/device-N/digits.npz")
    create.add_argument("--split", metavar="NODE",
                        help="node (or tensor) where the frozen backbone ends and the head begins")
    create.add_argument("--calib", metavar="PATH", help="calibration .npz or folder (see above; not with --example)")
    create.add_argument("--labels", metavar="FILE|A,B,...",
                        help="class labels: a file with one per line, or a comma-separated list")
    create.add_argument("--name", help="model name ([A-Za-z0-9._+-], up to 64; --example: digits)")
    create.add_argument("--version", help="this bundle's version (--example: 1)")
    create.add_argument("--parent-version", default=None, help="the version this one was derived from")
    create.add_argument("--input-shape", type=_shape, default=None, metavar="C,H,W",
                        help="input shape (for --mxnet, default: the --calib arrays' shape; "
                             "checked against the ONNX input otherwise)")
    create.add_argument("--input-name", default="data", help="the MXNet symbol's input name (default: data)")
    create.add_argument("--scale", type=float, default=1.0, help="raw pixel multiplier before mean/std (e.g. 1/255)")
    create.add_argument("--mean", type=_floats, default=None, metavar="M[,M,M]", help="per-channel mean")
    create.add_argument("--std", type=_floats, default=None, metavar="S[,S,S]", help="per-channel std")
    create.add_argument("--depths", type=_depth_count, default=3, metavar="N",
                        help="also record up to N training depths below the split (default 3; 0: head only): "
                             "the last 1x1 conv, then the last blocks; each gets its int8 prefix and fp32 "
                             "tail, and a device's `finetune --depth auto` picks how deep it can afford")
    create.add_argument("--method", choices=("minmax", "percentile", "entropy"), default=None,
                        help="activation range calibration (default: the quantiser's, min/max)")
    create.add_argument("--bias-correction", action="store_true",
                        help="each int8 layer's bias absorbs its mean int8 error on the calibration samples: "
                             "features closer to the fp32 net's (up to +1.3 dB), top-1 agreement within its "
                             "noise either way; model create runs the backbone twice more")
    create.add_argument("--edgetpu-model", metavar="FILE", default=None,
                        help="the int8 model compiled by edgetpu_compiler, for Coral devices")
    create.add_argument("--validation", metavar="DIR|NPZ", default=None,
                        help="a small labelled server set (100-500 samples; image folders, CSV or NPZ as the "
                             "agent reads data) the coordinator keeps to score every version and judge every "
                             "update: written beside the bundle as OUTPUT.server-set.npz, registered with it")
    create.add_argument("--output", required=True, metavar="DIR", help="bundle directory to create")
    create.add_argument("--archive", metavar="FILE", default=None, help="also write the single-file .tar.gz")
    create.add_argument("--overwrite", action="store_true", help="replace an existing bundle directory")
    create.set_defaults(func=_cmd_model_create)
    nodes = msub.add_parser(
        "nodes", help="list candidate split points (block boundaries) with their shapes",
        description="List where a model can be split into frozen backbone and trainable head: block "
                    "boundaries (after each residual add, concat / fire block, global pool, flatten, "
                    "the classifier's input) that every path from input to output goes through, "
                    "shallow to deep, with their output shapes (NCHW). Give one to `model create --split`. "
                    "CREATE says whether create accepts it: the same checks, run without quantising "
                    "(\"no: ...\" is the message create would print).",
        epilog="examples:\n  edge-coordinator model nodes resnet18.onnx\n"
               "  edge-coordinator model nodes --mxnet exported/net --input-shape 3,224,224 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    nsrc = nodes.add_mutually_exclusive_group(required=True)
    nsrc.add_argument("file", nargs="?", metavar="FILE", help="ONNX model file")
    nsrc.add_argument("--mxnet", metavar="PREFIX", help="exported Gluon block: PREFIX-symbol.json + PREFIX-0000.params")
    nodes.add_argument("--input-shape", type=_shape, default=None, metavar="C,H,W", help="input shape (for --mxnet)")
    nodes.add_argument("--calib", metavar="PATH", default=None, help="calibration .npz/folder to take --input-shape from")
    nodes.add_argument("--input-name", default="data", help="the MXNet symbol's input name (default: data)")
    nodes.add_argument("--json", action="store_true", help="print the split points as JSON")
    nodes.add_argument("--no-check", action="store_true",
                       help="list only: skip the CREATE column (whether `model create --split` accepts each "
                            "point: the backbone imports, its ops quantise, MXNet imports the head)")
    nodes.set_defaults(func=_cmd_model_nodes)
    inspect = msub.add_parser("inspect", help="verify a bundle (directory or archive) and print its manifest",
                              description="Verify every file's sha256 and print the manifest. Exit 65 if "
                                          "anything does not verify.")
    inspect.add_argument("bundle", metavar="BUNDLE", help="bundle directory or .tar.gz archive")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=_cmd_model_inspect)
    from .fleet_parser import add_register_command

    add_register_command(msub)


def _add_fleet(sub: Any) -> None:
    from .fleet_parser import add_fleet_commands

    add_fleet_commands(sub)


def _add_prune(sub: Any) -> None:
    from .retention_cli import add_prune_command

    add_prune_command(sub)


# Subcommand groups, in help order.
_GROUPS: list[Callable[[Any], None]] = [_add_fleet, add_model_commands, _add_prune]


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="edge-coordinator",
        description="Drive a fleet of edge-agent devices: build and register model bundles, "
                    "approve devices, trigger fine-tune rounds, aggregate their updates, publish versions.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"edge-coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _GROUPS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command("edge-coordinator", lambda: args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
