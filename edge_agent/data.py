"""Local training data on the device: image folders, CSV and NPZ, all untrusted.

Three formats, detected from the path:

- an image folder: one sub-folder per label (`data/cat/001.png`), PNG/JPEG/BMP/PGM (or
  `.npy`, one sample's raw values: what the daemon's local service stores for arrays),
  converted to the model's channels, resized down to its input size (aspect ratio not
  kept; an image smaller than the input in either side is skipped as `too-small`, never
  blown up) and normalised with the bundle's input spec (`x = (raw * scale - mean) / std`,
  raw pixels 0..255 whatever the file's depth: a 16-bit image is scaled, 65535 -> 255,
  never clipped). An image with any (partly) transparent pixel is skipped as
  `transparent-image` (the model sees no alpha; which background to flatten onto is the
  owner's choice); pixels with no known full scale (floating-point, 32-bit integer outside
  PNG/PGM, CIELab) are skipped as `unsupported-pixels`;
- a CSV file: a header row, C*H*W numeric feature columns (raw values, CHW order) and
  one label column (default `label`);
- an NPZ file: arrays `x` (N, C, H, W), (N, H, W) for one channel, or (N, C*H*W), raw
  values, and `y` (N,) label names or integers.

Labels are names, never silent indices: a folder name, a CSV cell or an NPZ `y` value
(integers as their decimal text) must equal one of the model's labels, or be mapped to
one by an explicit label map (`edge_agent.labels.parse_label_map`: `0=brick,1=grass`, a JSON or TOML file,
or `indices` to say that integer values are indices into the model's labels). A label
that is neither is an `InputError` naming it, unless `skip_unknown=True`: then its
samples are skipped and counted. Anything wrong with one sample -- an unreadable or
corrupt file, a too-small image, a non-numeric or non-finite value, a duplicate -- is
skipped and counted in the `DataReport`, never raised. Only problems with the data set as
a whole (unknown labels, nothing usable, a CSV whose header does not fit the model) raise
`InputError`. `DataReport.summary_lines()` is what a console shows about the skips.

Each sample is identified by the sha256 of its normalised float32 bytes. The train /
validation split is a function of that hash alone, so a sample never changes sides as the
data set grows, and the feature cache uses the same hash as its key.

PIL is imported only when an image folder is read.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import read_limited
from .errors import InputError
from .labels import INDICES
from .sample_decode import ImageRefused, decode_array_sample, decode_image_bytes

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".pgm", ".ppm")
ARRAY_SUFFIX = ".npy"  # one sample's raw values in a label folder (the local service stores arrays so)
MAX_IMAGE_BYTES = 32 << 20
MAX_TABLE_BYTES = 512 << 20  # one CSV or NPZ file
MAX_FILES = 200_000
MAX_SAMPLES = 1_000_000
MAX_EXAMPLES = 20  # problem lines kept in the report
DEFAULT_VAL_FRACTION = 0.2
def _names(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(str(i)[:40]) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


@dataclass
class DataReport:
    """What was read, what was skipped and why. JSON-ready via `to_json`."""

    source: str
    format: str = ""
    seen: int = 0  # files (image folders) or rows/samples (CSV, NPZ)
    loaded: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    per_class: dict[str, int] = field(default_factory=dict)
    empty_classes: list[str] = field(default_factory=list)  # model labels with no sample
    unknown_labels: list[str] = field(default_factory=list)  # labels found but not in the model
    mapped: dict[str, str] = field(default_factory=dict)  # data label -> model label, by the label map
    examples: list[str] = field(default_factory=list)
    train: int = 0
    validation: int = 0

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}" + (f" ({detail[:160]})" if detail else ""))

    @property
    def skipped_total(self) -> int:
        return int(sum(self.skipped.values()))

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "format": self.format, "seen": self.seen, "loaded": self.loaded,
            "skipped": dict(sorted(self.skipped.items())), "skipped_total": self.skipped_total,
            "per_class": dict(self.per_class), "empty_classes": list(self.empty_classes),
            "unknown_labels": list(self.unknown_labels), "mapped": dict(self.mapped),
            "examples": list(self.examples), "train": self.train, "validation": self.validation,
        }

    def summary_lines(self, examples: int = 3) -> list[str]:
        return data_summary(self.to_json(), examples)


def data_summary(report: dict[str, Any], examples: int = 3) -> list[str]:
    """What a console shows of a data report (`DataReport.to_json()`): counts, what was
    skipped and why (counts per reason, a few example paths), mapped and empty labels."""
    split = (f" ({report.get('train', 0)} train, {report.get('validation', 0)} validation)"
             if report.get("train") or report.get("validation") else "")
    lines = [f"{report.get('loaded', 0)} of {report.get('seen', 0)} samples usable in {report.get('source', '?')}{split}"]
    mapped = sorted(dict(report.get("mapped") or {}).items())
    if mapped:
        lines.append("label map used: " + ", ".join(f"{k} -> {v}" for k, v in mapped[:10])
                     + (" ..." if len(mapped) > 10 else ""))
    skipped = dict(report.get("skipped") or {})
    if skipped:
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items()))
        lines.append(f"skipped {sum(skipped.values())} ({why})")
        if report.get("unknown_labels"):
            lines.append(f"labels not in the model, skipped (--skip-unknown): {_names(report['unknown_labels'])}")
        lines += [f"  e.g. {line}" for line in list(report.get("examples") or [])[:examples]]
    if report.get("empty_classes"):
        lines.append(f"no samples for model label(s): {_names(report['empty_classes'])}")
    return lines


@dataclass
class LocalDataset:
    """Normalised samples with label indices into the model's labels and content hashes."""

    x: np.ndarray  # (N, C, H, W) float32, normalised
    y: np.ndarray  # (N,) int64 indices into `labels`
    hashes: list[str]  # sha256 hex of each sample's float32 bytes
    labels: list[str]
    report: DataReport

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, index: np.ndarray) -> LocalDataset:
        return LocalDataset(self.x[index], self.y[index], [self.hashes[i] for i in index], self.labels, self.report)

    def without_pixels(self) -> LocalDataset:
        """The same samples with `x` emptied (labels, hashes and report kept): once the
        backbone features exist, the pixels are the biggest thing a job still holds."""
        return LocalDataset(np.empty((0, *self.x.shape[1:]), self.x.dtype), self.y, self.hashes, self.labels,
                            self.report)


def sample_hash(sample: np.ndarray) -> str:
    """The content hash of one normalised sample (shape and float32 bytes)."""
    arr = np.ascontiguousarray(sample, dtype=np.float32)
    digest = hashlib.sha256(repr(arr.shape).encode())
    digest.update(arr.tobytes())
    return digest.hexdigest()


def hash_fraction(content_hash: str, salt: str = "") -> float:
    """A uniform number in [0, 1) from a content hash (and an optional split salt)."""
    if salt:
        content_hash = hashlib.sha256(f"{salt}:{content_hash}".encode()).hexdigest()
    return int(content_hash[:13], 16) / float(1 << 52)


def split_indices(hashes: Sequence[str], val_fraction: float = DEFAULT_VAL_FRACTION, *,
                  salt: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices decided by each sample's hash alone.

    Adding samples never moves an existing one to the other side. A data set so small that
    no hash falls under `val_fraction` gets its lowest-hash sample as validation, so there
    is always something to measure accuracy on (only with >= 2 samples).
    """
    if not 0.0 < val_fraction < 1.0:
        raise InputError(f"validation fraction must be in (0, 1), got {val_fraction!r}")
    scores = np.array([hash_fraction(h, salt) for h in hashes], dtype=np.float64)
    val = scores < val_fraction
    if len(scores) >= 2 and not val.any():
        val[int(np.argmin(scores))] = True
    return np.flatnonzero(~val), np.flatnonzero(val)


class _Collector:
    """Accumulates accepted samples, rejecting duplicates and unknown labels."""

    def __init__(self, spec: Any, labels: Sequence[str], report: DataReport, max_samples: int, *,
                 label_map: dict[str, str] | str | None = None, skip_unknown: bool = False) -> None:
        self.spec, self.labels, self.report = spec, list(labels), report
        self.by_name = {name: i for i, name in enumerate(self.labels)}
        self.indices = label_map == INDICES
        self.label_map = label_map if isinstance(label_map, dict) else {}
        wrong = sorted({v for v in self.label_map.values() if v not in self.by_name})
        if wrong:
            raise InputError(f"label map: {_names(wrong)} not among the model's labels ({_names(self.labels)})")
        self.skip_unknown = skip_unknown
        self.max_samples = max_samples
        self.x: list[np.ndarray] = []
        self.y: list[int] = []
        self.hashes: list[str] = []
        self.seen_hashes: dict[str, int] = {}
        self.unknown: Counter[str] = Counter()

    def resolve(self, label: Any) -> int | None:
        """Model label index for a data label, by name (through the label map); None if
        unknown. An integer is an index only when the label map is `indices`."""
        if isinstance(label, bytes):
            label = label.decode("utf-8", "replace")
        if isinstance(label, np.generic):
            label = label.item()
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        text = str(label).strip()
        if text in self.label_map:
            self.report.mapped[text] = self.label_map[text]
            return self.by_name[self.label_map[text]]
        if text in self.by_name:
            return self.by_name[text]
        # ASCII digits only, and short: str.isdigit() accepts '²', and int() refuses > 4300 digits
        if self.indices and text.isascii() and text.isdecimal() and len(text) <= 9 and int(text) < len(self.labels):
            self.report.mapped[text] = self.labels[int(text)]
            return int(text)
        return None

    def unknown_error(self, found: Sequence[str], what: str) -> InputError:
        example = ",".join(f"{name}={self.labels[i % len(self.labels)]}" for i, name in enumerate(found[:2]))
        return InputError(
            f"{self.report.source}: {what} {_names(list(found))} match none of the model's labels "
            f"({_names(self.labels)}); labels are names, never indices: map them with --label-map "
            f"(e.g. {example}) or leave them out with --skip-unknown (agent.toml: [data] label_map, "
            "skip_unknown)")

    def reject_label(self, label: Any, where: str) -> None:
        self.unknown[str(label)[:64]] += 1
        self.report.skip("unknown-label", where, f"label {str(label)[:64]!r} is not one of the model's labels")

    def add(self, normalised: np.ndarray, label: Any, where: str) -> bool:
        if len(self.y) >= self.max_samples:
            self.report.skip("over-sample-limit", where, f"limit {self.max_samples}")
            return False
        index = self.resolve(label)
        if index is None:
            self.reject_label(label, where)
            return False
        if not np.isfinite(normalised).all():
            self.report.skip("non-finite", where, "NaN or infinite value")
            return False
        digest = sample_hash(normalised)
        if digest in self.seen_hashes:
            first = self.seen_hashes[digest]
            conflict = self.y[first] != index
            self.report.skip("duplicate-conflicting-label" if conflict else "duplicate", where,
                             f"same content as an earlier sample labelled {self.labels[self.y[first]]!r}")
            return False
        self.seen_hashes[digest] = len(self.y)
        self.x.append(np.ascontiguousarray(normalised, dtype=np.float32))
        self.y.append(index)
        self.hashes.append(digest)
        return True

    def finish(self) -> LocalDataset:
        report = self.report
        report.loaded = len(self.y)
        counts = Counter(self.y)
        report.per_class = {name: int(counts.get(i, 0)) for i, name in enumerate(self.labels)}
        report.empty_classes = [name for name, n in report.per_class.items() if n == 0]
        report.unknown_labels = sorted(self.unknown)
        if self.unknown and not self.skip_unknown:
            raise self.unknown_error(report.unknown_labels, "label value(s)")
        if not self.y:
            what = ", ".join(f"{k}: {v}" for k, v in sorted(report.skipped.items())) or "no samples found"
            raise InputError(f"{report.source}: no usable samples ({report.seen} seen; skipped {what})")
        c, h, w = self.spec.shape
        x = np.stack(self.x).reshape(len(self.x), c, h, w)
        return LocalDataset(x, np.asarray(self.y, np.int64), self.hashes, self.labels, report)


# ---------------------------------------------------------------- images


def _decode_image(path: Path, spec: Any) -> np.ndarray:
    """One image file -> raw (1, C, H, W) float32 pixels; raises ValueError on any problem."""
    return decode_image_bytes(read_limited(path, MAX_IMAGE_BYTES), spec)


def _load_image_folder(root: Path, spec: Any, coll: _Collector, max_files: int) -> None:
    channels = spec.shape[0]
    if channels not in (1, 3):
        raise InputError(f"{root}: image folders can feed 1- or 3-channel models; this one takes {channels}")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise InputError(f"{root}: reading images needs Pillow (pip install Pillow); or give CSV / NPZ") from None
    report = coll.report
    # hidden folders and ext4's lost+found (a data disk's root) are never label folders
    class_dirs = sorted(p for p in root.iterdir()
                        if p.is_dir() and not p.name.startswith(".") and p.name != "lost+found")
    for stray in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        report.seen += 1
        report.skip("not-in-a-label-folder", str(stray))
    unknown = [p.name for p in class_dirs if coll.resolve(p.name) is None]
    if unknown and not coll.skip_unknown:  # before decoding anything: a mistake costs no time
        raise coll.unknown_error(unknown, "sub-folder(s)")
    for folder in class_dirs:
        label = folder.name
        files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
        usable_before = len(coll.y)
        known = coll.resolve(label) is not None
        for item in files:
            report.seen += 1
            if report.seen > max_files:
                raise InputError(f"{root}: more than {max_files} files; split the data set or raise the limit")
            where = str(item)
            suffix = item.suffix.lower()
            if suffix not in IMAGE_SUFFIXES and suffix != ARRAY_SUFFIX:
                report.skip("not-an-image", where, f"suffix {item.suffix!r}")
                continue
            if not known:
                coll.reject_label(label, where)
                continue
            try:
                raw = (decode_array_sample(read_limited(item, MAX_IMAGE_BYTES), spec) if suffix == ARRAY_SUFFIX
                       else _decode_image(item, spec))
            except ImageRefused as exc:
                report.skip(exc.reason, where, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - any decoder failure is a counted skip
                report.skip("unreadable-image", where, f"{type(exc).__name__}: {exc}")
                continue
            coll.add(spec.normalise(raw)[0], label, where)
        if known and len(coll.y) == usable_before:
            report.skip("empty-class-folder", str(folder), f"no usable image for label {label!r}")


# ---------------------------------------------------------------- CSV


def _load_csv(path: Path, spec: Any, coll: _Collector, label_column: str) -> None:
    report = coll.report
    c, h, w = spec.shape
    want = c * h * w
    try:
        text = read_limited(path, MAX_TABLE_BYTES).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from None
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise InputError(f"{path}: empty CSV (need a header row)") from None
    except csv.Error as exc:
        raise InputError(f"{path}: line 1: not CSV ({exc})") from None
    header = [col.strip() for col in header]
    if label_column not in header:
        raise InputError(f"{path}: no label column {label_column!r} in the header "
                         f"(columns: {', '.join(header[:8])}{', ...' if len(header) > 8 else ''}); "
                         "name it with --label-column")
    if header.count(label_column) > 1:
        raise InputError(f"{path}: the label column {label_column!r} appears more than once")
    label_at = header.index(label_column)
    if len(header) - 1 != want:
        raise InputError(f"{path}: {len(header) - 1} feature columns, but the model takes {c}x{h}x{w} = {want} "
                         "values per sample (raw values in C, H, W order plus one label column)")
    line = 1
    try:
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            report.seen += 1
            where = f"{path}:{line}"
            if report.seen > MAX_SAMPLES:
                raise InputError(f"{path}: more than {MAX_SAMPLES} rows")
            if len(row) != len(header):
                report.skip("wrong-size", where, f"{len(row)} fields, header has {len(header)}")
                continue
            label = row[label_at].strip()
            cells = row[:label_at] + row[label_at + 1:]
            try:
                values = np.array([float(v) for v in cells], dtype=np.float64)
            except ValueError:
                bad = next((v for v in cells if not _is_float(v)), "?")
                report.skip("non-numeric", where, f"value {bad[:32]!r}")
                continue
            if not np.isfinite(values).all():
                report.skip("non-finite", where, "NaN or infinite value")
                continue
            raw = values.astype(np.float32).reshape(1, c, h, w)
            coll.add(spec.normalise(raw)[0], label, where)
    except csv.Error as exc:
        raise InputError(f"{path}:{line}: malformed CSV ({exc})") from None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- NPZ


def _load_npz(path: Path, spec: Any, coll: _Collector) -> None:
    report = coll.report
    c, h, w = spec.shape
    data = read_limited(path, MAX_TABLE_BYTES)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:  # sizes before decompressing
            if sum(i.file_size for i in archive.infolist()) > 4 * MAX_TABLE_BYTES:
                raise InputError(f"{path}: uncompressed size is over {4 * MAX_TABLE_BYTES} bytes")
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        names = set(npz.files)
        if not {"x", "y"} <= names:
            raise InputError(f"{path}: needs arrays 'x' and 'y', has {', '.join(sorted(names))[:120] or 'none'}")
        x, y = npz["x"], npz["y"]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise InputError(f"{path}: not a readable NPZ file ({exc})") from None
    if x.dtype.kind not in "fiu" or y.ndim != 1 or y.dtype.kind not in "iuUSf":
        raise InputError(f"{path}: x must be numeric and y a 1-D array of labels (got x {x.dtype}, y {y.dtype} {y.shape})")
    if len(x) != len(y):
        raise InputError(f"{path}: x has {len(x)} samples but y has {len(y)} labels")
    if len(x) > MAX_SAMPLES:
        raise InputError(f"{path}: more than {MAX_SAMPLES} samples")
    shape = tuple(x.shape[1:])
    if shape == (c, h, w):
        raw = x
    elif c == 1 and shape == (h, w):
        raw = x[:, None]
    elif shape == (c * h * w,):
        raw = x.reshape(len(x), c, h, w)
    else:
        raise InputError(f"{path}: x has samples of shape {shape}; the model takes ({c}, {h}, {w}) "
                         f"(or ({h}, {w}) for one channel, or ({c * h * w},) flattened)")
    for i in range(len(raw)):
        report.seen += 1
        sample = raw[i:i + 1].astype(np.float32)
        coll.add(spec.normalise(sample)[0], y[i], f"{path}[{i}]")


# ---------------------------------------------------------------- entry point


def detect_format(path: str | os.PathLike[str]) -> str:
    """'images', 'csv' or 'npz' for a path; InputError if it is none of them."""
    p = Path(path)
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in (".csv", ".npz"):
            return suffix[1:]
        raise InputError(f"{p}: unknown data file type {suffix!r} (use .csv, .npz or an image folder)")
    if not p.is_dir():
        raise InputError(f"{p}: no such file or folder")
    entries = [e for e in p.iterdir() if not e.name.startswith(".")]
    if any(e.is_dir() for e in entries):
        return "images"
    tables = sorted(e for e in entries if e.suffix.lower() in (".csv", ".npz"))
    if len(tables) == 1:
        return tables[0].suffix.lower()[1:]
    if not entries:
        raise InputError(f"{p}: the data folder is empty (need label sub-folders of images, a .csv or an .npz)")
    raise InputError(f"{p}: found no label sub-folders and {len(tables)} .csv/.npz files; "
                     "give one file, or a folder with one sub-folder per label")


def load_dataset(
    path: str | os.PathLike[str],
    spec: Any,
    labels: Sequence[str],
    *,
    label_column: str = "label",
    label_map: dict[str, str] | str | None = None,
    skip_unknown: bool = False,
    max_files: int = MAX_FILES,
    max_samples: int = MAX_SAMPLES,
) -> LocalDataset:
    """Read local data for a model with input `spec` (InputSpec-like) and `labels`.

    `label_map`: `parse_label_map`'s result (or None). Labels that match no model label
    raise InputError naming them unless `skip_unknown`. Per-sample problems are skipped
    and counted in the returned dataset's `report`; InputError when the data set as a
    whole is unusable.
    """
    if not labels:
        raise InputError("the model has no labels")
    shape = tuple(int(v) for v in spec.shape)
    if len(shape) != 3 or min(shape) < 1 or math.prod(shape) > 1 << 24:
        raise InputError(f"model input shape {shape} is not a sensible (C, H, W)")
    root = Path(path)
    kind = detect_format(root)
    report = DataReport(source=str(root), format=kind)
    coll = _Collector(spec, labels, report, max_samples, label_map=label_map, skip_unknown=skip_unknown)
    if kind == "images":
        _load_image_folder(root, spec, coll, max_files)
    else:
        target = root if root.is_file() else next(e for e in sorted(root.iterdir()) if e.suffix.lower() == f".{kind}")
        report.source = str(target)
        if kind == "csv":
            _load_csv(target, spec, coll, label_column)
        else:
            _load_npz(target, spec, coll)
    return coll.finish()


def split_dataset(data: LocalDataset, val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[LocalDataset, LocalDataset]:
    """(train, validation) by content hash; counts recorded in the data report."""
    train_idx, val_idx = split_indices(data.hashes, val_fraction)
    data.report.train, data.report.validation = len(train_idx), len(val_idx)
    return data.subset(train_idx), data.subset(val_idx)
