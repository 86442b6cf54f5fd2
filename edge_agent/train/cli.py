"""`edge-agent finetune`: fine-tune a bundle's head on local data within a power budget.

Registered through edge_agent.cli's plugin list. Nothing heavy is imported here: numpy
and MXNet load only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..protocol.finetune import DISTILL_DEFAULT, MAX_DISTILL

DESCRIPTION = """\
Fine-tune the head of a model bundle on this device's own data, within a power budget.

The frozen backbone runs once per sample on the fastest correct int8 engine (features are
cached on disk, so a later run only computes new samples); MXNet trains the head in fp32.
The governor pauses training when the battery is below the floor or the board is too hot,
duty-cycles to hold the power cap, and stops before the energy budget is exceeded.
Checkpoints are written every N steps and on every pause or stop; --resume continues
exactly where a stopped or killed job left off.

BUNDLE is a bundle directory or its .tar.gz archive (as `kernels` and `inspect` take).

DATA is one of:
  a folder with one sub-folder per label of PNG/JPEG/BMP/PGM images, a CSV file (raw
  feature columns in C,H,W order + a label column) or an NPZ file (arrays x and y).
  Images are converted to the model's channels, resized DOWN to its input size (aspect
  ratio not kept) and normalised; an image smaller than the input is skipped
  ("too-small"), never blown up. 16-bit images are scaled to the 8-bit range (not
  clipped); images with transparent pixels ("transparent-image") and pixels with no known
  full scale, e.g. floating-point TIFFs ("unsupported-pixels"), are skipped. Sub-folder names, CSV label cells and NPZ y values are
  label NAMES and must equal the model's labels (never read as indices: a folder "3" is
  the label "3"); anything else is an error naming them, unless --label-map maps them or
  --skip-unknown leaves them out. Unreadable files, too-small images, bad rows and
  duplicates are skipped; what was skipped and why is printed (stderr) and kept in the
  report's "data" section."""

EXAMPLES = """\
examples:
  edge-agent finetune --model /var/lib/edge-agent/bundles/digits --data ~/photos
  edge-agent finetune --model textures.tar.gz --data ~/photos --label-map 0=brick,1=grass
  edge-agent finetune --model bundle/ --data ~/photos --label-map labels.toml --skip-unknown
  edge-agent finetune --model bundle/ --data samples.csv --budget-wh 0.5 --power-cap-w 5 \\
      --battery-floor 30 --epochs 10 --report report.json
  edge-agent finetune --model bundle/ --data samples.npz --resume     # after a reboot

The JSON report (stdout, or --report FILE) has accuracy before/after on the local
validation split, energy (Wh and its source), duration, peak RSS, steps, the stop reason
(done, early-stopped, budget-exhausted, deadline, cancelled, battery-low, error), the
status (trained, cancelled, failed) and the trained head parameters (also written to
STATE_DIR/head.params).

A job that ends having trained no step (steps of the checkpoint it resumed from count) is
a failure, not a success: "status": "failed", "failure" says why (the stop reason, where
it came -- engine selection, features, before the first step -- and the energy spent), no
head is written, one line on stderr says the same and the exit code is 75: try again
later, or with more budget or time (an engine choice made and the features computed are
cached, so the next run does not pay for them again).

exit codes: 0 trained (whatever stopped it: see "stop_reason"), 75 trained no step, 1 the
governor's error stop (e.g. no power reading), 130 cancelled (Ctrl-C, SIGTERM: --resume
goes on), 64 a bad flag or a budget too small to start; the rest: `edge-agent --help`."""


LABEL_MAP_HELP = """\
a label map says which model label each data label is (folder names, CSV label cells
and NPZ y values must otherwise equal a model label; they are never read as indices):
  --label-map 0=brick,1=grass,2=sky     inline DATA_LABEL=MODEL_LABEL pairs
  --label-map labels.json               a JSON object {"0": "brick", "1": "grass"}
  --label-map labels.toml               TOML pairs: "0" = "brick" (or a [labels] table)
  --label-map labels.txt                any other file: one DATA_LABEL=MODEL_LABEL a line
  --label-map indices                   integer labels are indices into the model's labels
Unmapped labels that equal a model label are kept as they are."""


def _default_state_dir(model: str, data: str) -> Path:
    """One state directory per (model, data) pair under the user's state home."""
    import hashlib

    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "edge-agent" / "finetune"
    key = hashlib.sha256(f"{Path(model).resolve()}\0{Path(data).resolve()}".encode()).hexdigest()[:12]
    return base / f"{Path(model).resolve().name}-{key}"


class ProgressBar:
    """One redrawn line on a terminal; a line every few seconds otherwise (logs, pipes)."""

    def __init__(self, stream: TextIO, *, width: int = 24, interval_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.width = width
        self.interval_s = 0.1 if self.tty else interval_s
        self._last = 0.0
        self._shown = False

    def render(self, ev: Any) -> str:
        if ev.phase in ("train", "paused", "checkpoint") and ev.total_steps:
            done = min(1.0, ev.step / ev.total_steps)
            fill = int(round(done * self.width))
            bar = "#" * fill + "-" * (self.width - fill)
            loss = f"{ev.loss:.4f}" if ev.loss is not None else "-"
            budget = f"/{ev.budget_wh:g}" if ev.budget_wh else ""
            watts = f"{ev.watts:.1f} W" if ev.watts is not None else "- W"
            temp = f"{ev.temp_c:.0f} C" if ev.temp_c is not None else "- C"
            state = f"  PAUSED: {ev.detail}" if ev.phase == "paused" else ""
            return (f"[{bar}] step {ev.step}/{ev.total_steps} epoch {ev.epoch + 1}/{ev.epochs} loss {loss} "
                    f"{ev.energy_wh:.4f}{budget} Wh {watts} {temp}{state}")
        return f"{ev.phase}: {ev.detail}"

    def __call__(self, ev: Any) -> None:
        now = time.monotonic()
        important = ev.phase in ("paused", "done", "data") or (ev.phase == "train" and ev.detail)
        if not important and now - self._last < self.interval_s:
            return
        self._last = now
        line = self.render(ev)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:200])
            if ev.phase in ("paused", "done", "data"):  # these stay on screen
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown = True


def _views(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) > 8:
        raise argparse.ArgumentTypeError(f"expected a whole number 0..8, got {text!r}")
    return int(text)


def _depth(text: str) -> str | int:
    import argparse

    from ..errors import UsageError
    from .depth_plan import parse_depth

    try:
        return parse_depth(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("depth: ")) from None


MAX_CHOICES_FILE = 64 * 1024


def _engine_choices(path: str) -> tuple[Any, ...]:
    """`--engine-choices FILE`: a JSON list of fleet engine choices, parsed strictly."""
    from ..atomic import read_limited
    from ..errors import InputError
    from ..protocol.engine_choice import parse_choices

    try:
        return tuple(parse_choices(json.loads(read_limited(path, MAX_CHOICES_FILE)), where=path))
    except (OSError, ValueError, InputError) as exc:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise argparse.ArgumentTypeError(str(exc)[:300]) from None


def _cmd_finetune(args: argparse.Namespace) -> int:
    from ..atomic import atomic_write_text
    from ..data import data_summary
    from ..errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_TEMPFAIL
    from .job import run_finetune
    from .job_report import NO_STEPS

    state_dir = Path(args.state_dir) if args.state_dir else _default_state_dir(args.model, args.data)
    if args.force_engine:  # the job reads the environment (as the agent's child does)
        from ..int8.engine import ENV_FORCE_WRONG

        os.environ[ENV_FORCE_WRONG] = "1"
    bar = None if args.quiet else ProgressBar(sys.stderr)
    report = run_finetune(
        model=args.model, data=args.data, state_dir=state_dir, cache_dir=args.cache_dir,
        budget_wh=args.budget_wh, budget_basis=args.budget_basis, energy_scope=args.energy_scope,
        power_cap_w=args.power_cap_w,
        battery_floor_pct=args.battery_floor, battery_resume_pct=args.battery_resume,
        thermal_limit_c=args.thermal_limit, window=args.window, deadline=args.deadline,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
        weight_decay=args.weight_decay, patience=args.patience, balance=args.balance, distill=args.distill,
        train_last=args.train_last, trainer=args.trainer, depth=args.depth, bn=args.bn, tail=args.tail,
        adapt=args.adapt, augment=args.augment, augment_kinds=args.augment_kinds,
        val_fraction=args.val_fraction, seed=args.seed,
        checkpoint_every=args.checkpoint_every, resume=args.resume, engine=args.engine,
        label_column=args.label_column, label_map=args.label_map, skip_unknown=args.skip_unknown,
        power_root=args.power_root, profile=args.profile,
        threads=args.threads, progress=bar, inference_energy=args.inference_energy,
        engine_choices=args.engine_choices,
    )
    text = json.dumps(report, indent=2, sort_keys=True) + "\n"
    summary = data_summary(report["data"])
    if bar is None and len(summary) > 1:  # the bar showed these; -q still says what was skipped and why
        for line in summary:
            print(f"data: {line}", file=sys.stderr)
    failure = report["failure"]
    if args.report:
        atomic_write_text(args.report, text)
        acc = report["accuracy"]
        if failure is None:  # (a failure's line below says what there is to say)
            print(f"accuracy {acc['before']} -> {acc['after']} on {acc['validation_samples']} validation samples; "
                  f"{report['energy']['wh']:.4f} Wh ({report['energy']['source']}); stop: {report['stop_reason']}; "
                  f"report: {args.report}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if report["stop_reason"] == "cancelled":  # Ctrl-C or SIGTERM: `finetune && deploy` must not go on
        print("cancelled: the checkpoint is kept (--resume goes on from it)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if failure is not None:  # nothing trained (or the governor's error): `finetune && deploy` must not go on
        print(f"failed: {failure['message']}" + (f"; report: {args.report}" if args.report else ""), file=sys.stderr)
        # nothing trained, nothing wrong with the input: a later run (more budget, time, sun) may succeed
        return EXIT_TEMPFAIL if failure["kind"] == NO_STEPS else EXIT_FAILURE
    return EXIT_OK


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not 0 < value < float("inf"):  # rejects 0, negatives, NaN and inf
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def _distill(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value <= MAX_DISTILL:  # rejects NaN too
        raise argparse.ArgumentTypeError(f"must be within 0..{MAX_DISTILL:g} (0: off), got {text!r}")
    return value


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be within 0..100, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `finetune` to the edge-agent command line."""
    p = subparsers.add_parser(
        "finetune", help="fine-tune a model's head on local data within a power budget",
        description=DESCRIPTION, epilog=EXAMPLES + "\n\n" + LABEL_MAP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="BUNDLE",
                   help="model bundle directory or .tar.gz archive (verified before use)")
    p.add_argument("--data", required=True, metavar="DIR", help="image folder, .csv or .npz (see above)")
    g = p.add_argument_group("power budget")
    g.add_argument("--budget-wh", type=_positive(float), metavar="X",
                   help="energy budget in Wh (above idle; see --budget-basis); stop before exceeding it. "
                        "Choosing the int8 engine is charged too (once per model and device; `edge-agent "
                        "kernels --bench` does it ahead, in the same cache); a budget too small for it "
                        "plus one batch exits 64 before starting")
    g.add_argument("--budget-basis", choices=("job", "total"), default="job",
                   help="'job': energy above idle (default); 'total': all energy drawn while the job runs")
    g.add_argument("--energy-scope", choices=("process", "device"), default=None,
                   help="what the budget is charged with. 'process' (default): this job's own CPU-seconds x the "
                        "board profile's watts per busy core, so other processes' load is never charged to it; "
                        "what the power source measures for the whole board is reported beside it. 'device': "
                        "that whole-board figure (battery-wide accounting, e.g. when the battery must also "
                        "carry other services). Default: $EDGE_AGENT_ENERGY_SCOPE, else 'process' (the agent's "
                        "jobs read the same variable)")
    g.add_argument("--power-cap-w", type=_positive(float), metavar="Y", help="average power cap in W (duty-cycled)")
    g.add_argument("--battery-floor", type=_percent, metavar="P", help="pause below this battery %%")
    g.add_argument("--battery-resume", type=_percent, metavar="P", help="resume at this battery %% (default floor+10)")
    g.add_argument("--thermal-limit", type=_positive(float), metavar="C",
                   help="pause at this temperature in C (default: the board profile's)")
    g.add_argument("--window", metavar="HH:MM-HH:MM", help="train only in this daily local-time window (solar hours)")
    g.add_argument("--deadline", metavar="TIME", help="give up after this time (ISO 8601 with zone, or epoch seconds)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=_positive(int), default=20, metavar="N", help="maximum epochs (default 20)")
    t.add_argument("--batch-size", type=_positive(int), metavar="N", help="default: the board profile's (32)")
    t.add_argument("--lr", type=_positive(float), default=None,
                   help="learning rate (default 0.01 for a one-dense-layer head, 0.001 for anything deeper)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    t.add_argument("--weight-decay", type=float, default=1e-4, metavar="WD")
    t.add_argument("--patience", type=_positive(int), default=3, metavar="N",
                   help="early stopping: epochs without validation-loss improvement (default 3)")
    t.add_argument("--balance", action="store_true", help="weight classes by inverse frequency")
    t.add_argument("--distill", type=_distill, default=DISTILL_DEFAULT, metavar="W",
                   help="weight of the pull towards what the bundle's own tail answers, on the classes other "
                        "than each sample's true one and the samples it answers right (not-true distillation, "
                        f"FedNTD): it keeps what the fleet's model knew of the classes this device seldom sees. "
                        f"0 turns it off (default {DISTILL_DEFAULT:g}: it took camera digits' held-out accuracy "
                        "from 0.699 to 0.752; README, 'Not forgetting what the fleet knew')")
    t.add_argument("--train-last", type=_positive(int), metavar="N", help="train only the head's last N layers")
    t.add_argument("--trainer", choices=("auto", "numpy", "mxnet"), default="auto",
                   help="auto (default): a head that is one dense layer trains in numpy with Gluon's exact "
                        "update rules and no MXNet import (~130 MB, ~2 CPU-s saved); any other head in "
                        "MXNet Gluon. mxnet: always Gluon")
    t.add_argument("--depth", type=_depth, default="auto", metavar="auto|head|N",
                   help="how deep to train on a multi-depth bundle (model create --depths): auto (default) "
                        "plans the deepest depth that fits the profile's training memory cap and --budget-wh "
                        "(the report's 'depth' says what was chosen and why, predicted and actual Wh and "
                        "peak RSS); head: the head only; N: the tail from the N-th block boundary down "
                        "(1: last 1x1 conv + head on a MobileNetV2). A job that no depth fits under the "
                        "memory cap (with +25 %% of what it adds to spare), or a depth N over it, is refused "
                        "before it prepares anything (exit 78, naming the cap)")
    t.add_argument("--bn", choices=("frozen", "update"), default="update",
                   help="BatchNorm in the trained tail: update its statistics from the local batches (default: "
                        "a device's own camera shifts them; bench_depth measures it) or keep the base model's")
    t.add_argument("--tail", choices=("full", "bias"), default="full",
                   help="full (default): train every tail parameter; bias: only biases and BatchNorm "
                        "scales/shifts plus the classifier (less memory)")
    t.add_argument("--adapt", choices=("auto", "bn", "none"), default="auto",
                   help="adapt the frozen int8 prefix to this device's camera: re-estimate its BatchNorm "
                        "statistics on the device's images and re-quantise it (bn; ~2 CPU-s on a "
                        "MobileNetV2 w0.5 at 96x96, no labels, no backward pass); auto (default): when the "
                        "images' statistics are far from the bundle's (the report's adaptation.shift); none: never")
    t.add_argument("--augment", type=_views, default=0, metavar="K",
                   help="K extra views of every training image (0-8, default 0), made before the int8 "
                        "prefix and cached like the images (views of the same image are the same every job)")
    t.add_argument("--augment-kinds", default="crop,brightness", metavar="LIST",
                   help="what a view changes: crop (a shift of up to 1/8), brightness (+-15 %%), flip "
                        "(horizontal; not for digits or text) (default crop,brightness)")
    t.add_argument("--val-fraction", type=float, default=0.2, metavar="F",
                   help="validation share, chosen by content hash so it is stable as data grows (default 0.2)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--label-column", default="label", help="CSV label column (default 'label')")
    t.add_argument("--label-map", metavar="FILE_OR_SPEC",
                   help="which model label each data label is: DATA=MODEL pairs (0=brick,1=grass), a .json/"
                        ".toml/text file of them, or 'indices' (integer labels index the model's labels)")
    t.add_argument("--skip-unknown", action="store_true",
                   help="skip (and count) data labels matching no model label instead of stopping")
    s = p.add_argument_group("state")
    s.add_argument("--resume", action="store_true", help="continue the job in --state-dir from its newest good checkpoint")
    s.add_argument("--state-dir", metavar="DIR",
                   help="checkpoints, head.params and report.json (default: one per model+data under "
                        "$XDG_STATE_HOME/edge-agent/finetune)")
    s.add_argument("--cache-dir", metavar="DIR",
                   help="feature cache and engine choice (default: features in STATE_DIR/cache, the engine choice in "
                        "the directory `kernels --bench` shares: $EDGE_AGENT_STATE_DIR, else /var/lib/edge-agent if "
                        "writable, else ~/.local/state/edge-agent)")
    s.add_argument("--checkpoint-every", type=_positive(int), default=50, metavar="N",
                   help="write a checkpoint once N steps went unsaved (also after the last epoch, on a pause and on a "
                        "stop): a power cut loses at most N steps; fewer writes spare the CPU and the SD card "
                        "(default 50)")
    o = p.add_argument_group("device")
    o.add_argument("--engine", help="force an int8 engine (tflite, native, mxnet-onednn, reference, edgetpu); "
                                    "one that disagrees with the reference is an error (exit 69)")
    o.add_argument("--force-engine", action="store_true",
                   help="use --engine even if it disagrees with the reference, with a warning")
    o.add_argument("--engine-choices", type=_engine_choices, default=(), metavar="FILE",
                   help="a JSON list of int8 engine choices other devices measured (what a fleet finetune command "
                        "carries: `edge-coordinator devices --engine-choices` prints it); the one made on a device "
                        "of this kind is only re-checked here, not measured again")
    o.add_argument("--inference-energy", metavar="FILE",
                   help="the local inference service's energy file: its energy is not charged to this job")
    o.add_argument("--threads", type=_positive(int), help="CPU threads (default: the board profile's)")
    o.add_argument("--profile", help="board profile name (default: matched from the hardware probe)")
    o.add_argument("--power-root", default="/", metavar="ROOT",
                   help="read power, battery and thermal sensors under ROOT (default /; for tests and captured trees)")
    p.add_argument("--report", metavar="FILE", help="write the JSON report here instead of stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_finetune)
