"""Model bundles: the unit a coordinator publishes and a device verifies, activates and runs.

A bundle is a flat directory (and, for transfer, a single tar.gz archive of it):

    manifest.json           name, version, parent version, input spec, labels, split point,
                            sha256 + size of every other file, format version
    backbone.onnx           the frozen backbone in fp32 (input -> split tensor)
    backbone_int8.tflite    the same backbone quantised to int8 by the project's own writer
    head-symbol.json        the trainable head as an MXNet symbol (split tensor -> outputs)
    head.params             the head's MXNet parameters (arg:/aux: ndarray file)
    calibration.npz         normalised NCHW float32 samples ("x"): calibration for engines
                            that quantise on the device (mxnet-onednn) and the check batch
                            for agreement
    backbone_int8_edgetpu.tflite   optional: the int8 model compiled by edgetpu_compiler
    depth<k>-backbone_int8.tflite  optional, k = 1..8: the int8 prefix up to depth k's cut
    depth<k>-head-symbol.json      and the fp32 tail from that cut to the outputs
    depth<k>-head.params           the parameters depth k's tail adds to depth k-1's

A multi-depth bundle (`manifest.depths`, see int8/depth_cuts.py) lets a device train
deeper than the head: depth 0 is the split above, depth k starts k block boundaries
earlier. Its parameters are split by depth -- head.params holds the head's, each
depth<k>-head.params what depth k's tail adds -- so a version that changed only the head
differs from its root in head.params alone and its patch stays small; `bundle_params`
reads them all. `Bundle.at_depth(k)` is the bundle as seen at depth k:
the same object with depth k's prefix as its backbone and its tail as its head, so
engines, selection and the feature cache work at any depth unchanged.

Everything read from a bundle is untrusted: sizes are checked before reading, the manifest
is validated field by field, and every file's sha256 is verified before use -- and again on
the exact bytes handed out by `Bundle.read`, so a file swapped after loading is still caught.
Bundles are only ever created or unpacked into a temp directory that is fsynced and renamed
into place, so a crash never leaves a half-written bundle under the final name.

Creating a bundle (`bundle_create.create_bundle`) needs MXNet and onnx; loading,
verifying and packing, here, do not (the idle daemon imports this module).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import read_limited
from ..errors import InputError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKBONE_ONNX = "backbone.onnx"
BACKBONE_INT8 = "backbone_int8.tflite"
BACKBONE_EDGETPU = "backbone_int8_edgetpu.tflite"
HEAD_SYMBOL = "head-symbol.json"
HEAD_PARAMS = "head.params"
CALIBRATION = "calibration.npz"
ORACLE = "oracle.npz"  # the reference's and the fp32 model's answers on the calibration samples
REQUIRED_FILES = (BACKBONE_ONNX, BACKBONE_INT8, HEAD_SYMBOL, HEAD_PARAMS, CALIBRATION)
OPTIONAL_FILES = (BACKBONE_EDGETPU, ORACLE)
MAX_DEPTH = 8
_DEPTH_FILE_RE = re.compile(r"^depth([1-8])-(backbone_int8\.tflite|head-symbol\.json|head\.params|oracle\.npz)\Z")  # \Z: no "\n" after
_COST_KEYS = ("prefix_macs", "tail_macs", "tail_params", "tail_activations", "cut_elements", "prefix_activations",
              "prefix_largest_activation")


def depth_file(depth: int, fname: str) -> str:
    """The bundle file holding depth `depth`'s BACKBONE_INT8, HEAD_SYMBOL, HEAD_PARAMS or ORACLE."""
    return fname if depth == 0 else f"depth{depth}-{fname}"

MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 256 << 20  # a MobileNetV2 1.0 fp32 ONNX is ~14 MB; leave ample room
MAX_ARCHIVE_BYTES = 512 << 20
MAX_CALIBRATION_SAMPLES = 1024
MAX_CALIBRATION_BYTES = 32 << 20  # stored samples; 224x224 RGB float32 -> 53 samples
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class BundleError(InputError):
    """A bundle (directory, archive or manifest) is malformed, incomplete or tampered with."""


class ManifestError(BundleError):
    """manifest.json is not valid JSON or misses / mistypes a field."""


class HashMismatchError(BundleError):
    """A bundle file's sha256 or size differs from the manifest."""


@dataclass(frozen=True)
class InputSpec:
    """What the backbone eats: x = (raw * scale - mean[c]) / std[c], laid out NCHW."""

    shape: tuple[int, int, int]  # (C, H, W), batch dimension excluded
    name: str = "data"
    layout: str = "NCHW"
    dtype: str = "float32"
    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def normalise(self, raw: np.ndarray) -> np.ndarray:
        """Raw NCHW pixels -> the normalised float32 input the backbone expects."""
        c = self.shape[0]
        mean = np.asarray(self.mean or (0.0,) * c, np.float32).reshape(1, c, 1, 1)
        std = np.asarray(self.std or (1.0,) * c, np.float32).reshape(1, c, 1, 1)
        return ((raw.astype(np.float32) * np.float32(self.scale)) - mean) / std

    def to_json(self) -> dict[str, Any]:
        c = self.shape[0]
        return {
            "name": self.name, "layout": self.layout, "dtype": self.dtype,
            "shape": list(self.shape),
            "normalisation": {
                "scale": self.scale,
                "mean": list(self.mean or (0.0,) * c),
                "std": list(self.std or (1.0,) * c),
            },
        }


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Depth:
    """One trainable depth of a multi-depth bundle (int8/depth_cuts.py): the tail starts at
    `tensor`; `costs` are per-sample counts (prefix_macs, tail_macs, tail_params,
    tail_activations, cut_elements; prefix_activations and prefix_largest_activation: the
    int8 prefix's activation elements in all and in its largest tensor, engine_memory's
    prefix_figures) for the device's planner."""

    depth: int
    tensor: str
    kind: str
    feature_shape: tuple[int, ...]
    node: str = ""
    costs: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"depth": self.depth, "tensor": self.tensor, "node": self.node, "kind": self.kind,
                "feature_shape": list(self.feature_shape), "costs": dict(self.costs)}


@dataclass
class Manifest:
    name: str
    version: str
    input: InputSpec
    labels: list[str]
    split_tensor: str  # the ONNX tensor where the backbone ends and the head begins
    feature_shape: tuple[int, ...]  # backbone output per sample, e.g. (32, 1, 1)
    files: dict[str, FileEntry]
    parent_version: str | None = None
    split_node: str = ""  # the ONNX node producing split_tensor ("" when it has no name)
    created: str = ""
    source: str = ""  # "gluon" or "onnx:<file name>"
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. quantisation method
    depths: list[Depth] = field(default_factory=list)  # empty: head-only bundle

    def to_json(self) -> dict[str, Any]:
        # "depths" only when there are any: a head-only bundle's manifest bytes (its identity) stay as they were
        return ({"depths": [d.to_json() for d in self.depths]} if self.depths else {}) | {
            "format_version": self.format_version,
            "name": self.name,
            "version": self.version,
            "parent_version": self.parent_version,
            "created": self.created,
            "source": self.source,
            "input": self.input.to_json(),
            "labels": list(self.labels),
            "split": {"tensor": self.split_tensor, "node": self.split_node,
                      "feature_shape": list(self.feature_shape)},
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "extra": self.extra,
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, obj: Any, *, where: str = MANIFEST) -> Manifest:
        return _parse_manifest(obj, where)


# ---------------------------------------------------------------- manifest validation


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = obj[key]
    # bool is an int subclass: never accept it where a number is expected
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ManifestError(f"{where}: field {key!r} must be {_kind_name(kind)}, got {value!r:.80}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in _as_tuple(kind))


def _ints(value: Any, where: str, *, length: int | None = None, limit: int = 1 << 16) -> tuple[int, ...]:
    if (not isinstance(value, list) or (length is not None and len(value) != length) or len(value) > 8
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limit for v in value)):
        want = f"{length} " if length else ""
        raise ManifestError(f"{where}: must be a list of {want}positive integers (<= {limit}), got {value!r:.80}")
    return tuple(value)


def _floats(value: Any, where: str, length: int, *, positive: bool = False) -> tuple[float, ...]:
    ok = isinstance(value, list) and len(value) == length and all(
        isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < 1e300 and (v > 0 or not positive)
        for v in value)  # abs(): NaN and Inf fail it, and an int too large for a float does not overflow
    if not ok:
        sign = "positive " if positive else ""
        raise ManifestError(f"{where}: must be a list of {length} finite {sign}numbers, got {value!r:.80}")
    return tuple(float(v) for v in value)


def _parse_manifest(obj: Any, where: str) -> Manifest:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: must be a JSON object, got {type(obj).__name__}")
    fmt = _field(obj, "format_version", int, where)
    if fmt != FORMAT_VERSION:
        raise ManifestError(f"{where}: format_version {fmt} is not supported (this agent reads {FORMAT_VERSION})")
    name = _field(obj, "name", str, where)
    version = _field(obj, "version", str, where)
    for key, value in (("name", name), ("version", version)):
        if not _NAME_RE.match(value):
            raise ManifestError(f"{where}: field {key!r}: {value!r:.80} is not 1-64 of [A-Za-z0-9._+-]")
    parent = _field(obj, "parent_version", (str, type(None)), where)
    inp = _field(obj, "input", dict, where)
    shape = _ints(_field(inp, "shape", list, f"{where}: input"), f"{where}: input.shape", length=3, limit=8192)
    if _field(inp, "layout", str, f"{where}: input") != "NCHW":
        raise ManifestError(f"{where}: input.layout must be 'NCHW', got {inp['layout']!r:.40}")
    if _field(inp, "dtype", str, f"{where}: input") != "float32":
        raise ManifestError(f"{where}: input.dtype must be 'float32', got {inp['dtype']!r:.40}")
    norm = _field(inp, "normalisation", dict, f"{where}: input")
    scale = _field(norm, "scale", (int, float), f"{where}: input.normalisation")
    if not (0 < scale < 1e300):  # NaN and Inf fail it; a huge int cannot overflow a float conversion
        raise ManifestError(f"{where}: input.normalisation.scale must be a positive number, got {scale!r}")
    spec = InputSpec(
        shape=shape,  # type: ignore[arg-type]
        name=_field(inp, "name", str, f"{where}: input"),
        scale=float(scale),
        mean=_floats(_field(norm, "mean", list, f"{where}: input.normalisation"),
                     f"{where}: input.normalisation.mean", shape[0]),
        std=_floats(_field(norm, "std", list, f"{where}: input.normalisation"),
                    f"{where}: input.normalisation.std", shape[0], positive=True),
    )
    labels = _field(obj, "labels", list, where)
    if not labels or len(labels) > 100_000 or not all(isinstance(v, str) and len(v) <= 256 for v in labels):
        raise ManifestError(f"{where}: labels must be a non-empty list of strings (<= 256 chars each)")
    split = _field(obj, "split", dict, where)
    files_obj = _field(obj, "files", dict, where)
    files: dict[str, FileEntry] = {}
    for fname, entry in files_obj.items():
        if fname not in REQUIRED_FILES + OPTIONAL_FILES and not _DEPTH_FILE_RE.match(fname):
            raise ManifestError(f"{where}: files: unexpected file name {fname!r:.80}")
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: files.{fname}: must be an object with sha256 and size")
        digest = _field(entry, "sha256", str, f"{where}: files.{fname}")
        size = _field(entry, "size", int, f"{where}: files.{fname}")
        if not _HEX64_RE.match(digest):
            raise ManifestError(f"{where}: files.{fname}.sha256 is not 64 lowercase hex digits")
        if not 0 <= size <= MAX_FILE_BYTES:
            raise ManifestError(f"{where}: files.{fname}.size {size} is outside 0..{MAX_FILE_BYTES}")
        files[fname] = FileEntry(digest, size)
    missing = [f for f in REQUIRED_FILES if f not in files]
    if missing:
        raise ManifestError(f"{where}: files: missing entries for {', '.join(missing)}")
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise ManifestError(f"{where}: field 'extra' must be an object")
    depths = _parse_depths(obj.get("depths", []), files, where)
    return Manifest(
        name=name, version=version, parent_version=parent, input=spec, labels=list(labels),
        split_tensor=_field(split, "tensor", str, f"{where}: split"),
        split_node=_field(split, "node", str, f"{where}: split"),
        feature_shape=_ints(_field(split, "feature_shape", list, f"{where}: split"),
                            f"{where}: split.feature_shape", limit=1 << 20),
        files=files, created=str(obj.get("created", "")), source=str(obj.get("source", "")),
        format_version=fmt, extra=extra, depths=depths,
    )


def _parse_depths(value: Any, files: dict[str, FileEntry], where: str) -> list[Depth]:
    """manifest.depths: depth 0..n in order, each deeper one with both of its files."""
    if not isinstance(value, list) or len(value) > MAX_DEPTH + 1:
        raise ManifestError(f"{where}: depths must be a list of at most {MAX_DEPTH + 1} objects")
    depths = []
    for k, item in enumerate(value):
        at = f"{where}: depths[{k}]"
        if not isinstance(item, dict):
            raise ManifestError(f"{at}: must be an object")
        if _field(item, "depth", int, at) != k:
            raise ManifestError(f"{at}: depth must be {k} (depths are listed in order from 0)")
        tensor, kind, node = (_field(item, key, str, at) for key in ("tensor", "kind", "node"))
        if not tensor or max(len(tensor), len(kind), len(node)) > 256:
            raise ManifestError(f"{at}: tensor, kind and node must be strings of 1-256 characters")
        costs = _field(item, "costs", dict, at)
        if set(costs) - set(_COST_KEYS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 50 for v in costs.values()):
            raise ManifestError(f"{at}: costs must map {', '.join(_COST_KEYS)} to non-negative integers")
        for fname in (BACKBONE_INT8, HEAD_SYMBOL):
            if depth_file(k, fname) not in files:
                raise ManifestError(f"{at}: files: missing {depth_file(k, fname)}")
        depths.append(Depth(k, tensor, kind, _ints(_field(item, "feature_shape", list, at), f"{at}.feature_shape",
                                                    limit=1 << 20), node, dict(costs)))
    listed = {int(m.group(1)) for f in files if (m := _DEPTH_FILE_RE.match(f))}
    if listed - set(range(1, len(depths))):
        raise ManifestError(f"{where}: files: depth files for depths the manifest does not list")
    return depths


# ---------------------------------------------------------------- loading


class _ParsedGraphs:
    """The process's parsed int8 prefixes by sha256, small ones only, handed out as copies
    (callers may change what they get). A job asked for them 14 times -- the planner's
    memory predictions for every depth, the engine's re-check, the adaptation -- each a
    parse of the flatbuffer in Python; a copy costs ~4 % of one. Measured on the textures
    MobileNetV2's in-service job: its work before training went from 1.5 to 1.2 CPU-s."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._graphs: dict[str, tuple[Any, int]] = {}  # sha256 -> (graph, tflite bytes), oldest first
        self._lock = threading.Lock()  # the agent's inference server prepares engines from its threads

    def get(self, sha256: str, data: bytes) -> Any:
        import copy

        from .tflite_reader import read_tflite

        with self._lock:
            kept = self._graphs.get(sha256)
        if kept is not None:
            return copy.deepcopy(kept[0])
        graph = read_tflite(data)
        if 4 * len(data) <= self.max_bytes:  # a large model's prefix is not held twice
            with self._lock:
                self._graphs[sha256] = (copy.deepcopy(graph), len(data))
                while sum(size for _, size in self._graphs.values()) > self.max_bytes:
                    del self._graphs[next(iter(self._graphs))]
        return graph


_PARSED_GRAPHS = _ParsedGraphs(16 << 20)


@dataclass
class Bundle:
    """A verified bundle on disk. `sha256` (of manifest.json) identifies it: the manifest
    pins every other file's hash, so it changes whenever any byte of the bundle does."""

    path: Path
    manifest: Manifest
    sha256: str
    depth: int = 0
    aliases: dict[str, str] = field(default_factory=dict)  # at depth k: BACKBONE_INT8 -> depth<k>-...

    def has(self, fname: str) -> bool:
        return fname in self.manifest.files

    def at_depth(self, depth: int) -> Bundle:
        """This bundle seen at training depth `depth` (module doc); 0 is the bundle itself."""
        if depth == self.depth:
            return self
        if self.depth != 0:
            raise BundleError(f"{self.path}: a depth view cannot be viewed at another depth")
        if not 0 <= depth < len(self.manifest.depths):
            have = len(self.manifest.depths) - 1 if self.manifest.depths else 0
            raise BundleError(f"{self.path}: the bundle has no depth {depth} (its depths: 0..{have}; "
                              "build it with `edge-coordinator model create --depths N`)")
        spec = self.manifest.depths[depth]
        aliases = {f: depth_file(depth, f) for f in (BACKBONE_INT8, HEAD_SYMBOL, ORACLE)
                   if f != ORACLE or depth_file(depth, f) in self.manifest.files}  # the answers are optional
        files = {f: e for f, e in self.manifest.files.items() if f not in (BACKBONE_EDGETPU, ORACLE)}  # for depth 0
        files.update({f: self.manifest.files[real] for f, real in aliases.items()})
        manifest = dataclasses.replace(self.manifest, split_tensor=spec.tensor, split_node=spec.node,
                                       feature_shape=spec.feature_shape, files=files)
        view_sha = hashlib.sha256(f"{self.sha256}:depth{depth}".encode()).hexdigest()
        return Bundle(self.path, manifest, view_sha, depth=depth, aliases=aliases)

    def read(self, fname: str) -> bytes:
        """The bytes of one bundle file, verified against the manifest on these very bytes."""
        entry = self.manifest.files.get(fname)
        if entry is None:
            raise BundleError(f"{self.path}: bundle has no file {fname!r}")
        where = self.path / self.aliases.get(fname, fname)
        try:
            data = read_limited(where, max(entry.size, 0))
        except FileNotFoundError:
            raise BundleError(f"{where}: missing (listed in {MANIFEST})") from None
        except InputError as exc:  # larger than the manifest says
            raise HashMismatchError(f"{where}: size differs from {MANIFEST} ({exc})") from None
        if len(data) != entry.size:
            raise HashMismatchError(f"{where}: {len(data)} bytes, {MANIFEST} says {entry.size} (truncated?)")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise HashMismatchError(f"{where}: sha256 {digest[:16]}... does not match {MANIFEST} ({entry.sha256[:16]}...)")
        return data

    def tflite_bytes(self) -> bytes:
        return self.read(BACKBONE_INT8)

    def onnx_bytes(self) -> bytes:
        """The fp32 backbone; in a multi-depth bundle with head.params' values written in
        (a federated version changes weights inside the backbone: int8/requantize.py)."""
        if not self.manifest.depths:
            return self.read(BACKBONE_ONNX)
        from .requantize import patched_backbone

        return patched_backbone(self)

    def calibration(self) -> np.ndarray:
        """The stored normalised NCHW float32 samples (validated again: shape and finiteness)."""
        return _load_npz_array(self.read(CALIBRATION), self.manifest.input, where=str(self.path / CALIBRATION),
                               max_bytes=2 * MAX_CALIBRATION_BYTES)

    def qgraph(self) -> Any:
        """The int8 backbone as a QGraph (parsed from the verified .tflite): a copy of the
        process's parse of these very bytes when it has one (_ParsedGraphs)."""
        data = self.tflite_bytes()  # read and verified every time: only the parse is kept
        return _PARSED_GRAPHS.get(self.manifest.files[BACKBONE_INT8].sha256, data)

    def head_block(self) -> Any:
        """The head as an MXNet Gluon SymbolBlock (imports MXNet)."""
        import warnings

        import mxnet as mx

        sym = mx.sym.load_json(self.read(HEAD_SYMBOL).decode("utf-8"))
        if self.manifest.depths:  # the parameters are split by depth
            arrays, prefixes = bundle_params(self)
            params = {f"{prefixes.get(n, 'arg')}:{n}": mx.nd.array(v) for n, v in arrays.items()}
        else:
            params = mx.nd.load_frombuffer(self.read(HEAD_PARAMS))
        if isinstance(params, list):  # what mx.nd.save({}) reads back as: a parameter-free head
            if params:
                raise BundleError(f"{self.path}: {HEAD_PARAMS} holds unnamed arrays")
            params = {}
        with warnings.catch_warnings():  # "Cannot decide type": the input's dtype comes at run time
            warnings.simplefilter("ignore", UserWarning)
            block = mx.gluon.SymbolBlock(sym, mx.sym.var(self.manifest.split_tensor))
        own = block.collect_params()
        for key, value in params.items():
            name = key.split(":", 1)[-1]
            if name in own:
                own[name]._load_init(value, mx.cpu())  # noqa: SLF001 - SymbolBlock has no public setter by name
        return block


def symbol_variables(symbol_json: bytes | str) -> set[str]:
    """The variable (parameter and input) names of an MXNet symbol JSON."""
    try:
        nodes = json.loads(symbol_json)["nodes"]
        return {str(n["name"]) for n in nodes if n.get("op") == "null"}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(f"{HEAD_SYMBOL}: not MXNet symbol JSON ({exc})") from None


def bundle_params(bundle: Bundle) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every parameter of the bundle by bare name, and its arg:/aux: prefix: head.params
    and, in a multi-depth bundle, each depth<k>-head.params (module doc)."""
    from ..mxparams import load_params, split_names

    merged: dict[str, np.ndarray] = {}
    for k in range(max(1, len(bundle.manifest.depths))):
        fname = depth_file(k, HEAD_PARAMS)
        if bundle.has(fname):
            merged.update(load_params(bundle.read(fname), where=f"{bundle.path}: {fname}"))
    return split_names(merged)


def params_files(params: dict[str, np.ndarray], prefixes: dict[str, str], manifest: Manifest,
                 symbols: dict[str, bytes]) -> dict[str, bytes]:
    """`params` (bare names) split into head.params and depth<k>-head.params: each depth's
    file holds the parameters its tail names that shallower tails do not. `symbols`: the
    bundle's files by name (its head symbols are read). A head-only bundle: head.params."""
    from ..mxparams import dump_params, join_names

    if not manifest.depths:
        return {HEAD_PARAMS: dump_params(join_names(params, prefixes))}
    out: dict[str, bytes] = {}
    placed: set[str] = set()
    for d in manifest.depths:
        names = symbol_variables(symbols[depth_file(d.depth, HEAD_SYMBOL)]) - placed
        part = {n: v for n, v in params.items() if n in names}
        if d.depth > 0 and not part:
            continue
        placed |= part.keys()
        out[depth_file(d.depth, HEAD_PARAMS)] = part  # type: ignore[assignment]
    rest = {n: v for n, v in params.items() if n not in placed}  # named by no tail: kept with the head
    head = {**out.get(HEAD_PARAMS, {}), **rest}  # type: ignore[dict-item]
    out[HEAD_PARAMS] = head  # type: ignore[assignment]
    return {f: dump_params(join_names(p, prefixes)) for f, p in out.items()}  # type: ignore[arg-type]


def parse_manifest(raw: bytes, where: str = MANIFEST) -> Manifest:
    """A manifest.json's bytes -> Manifest (ManifestError for anything else: bad UTF-8, bad
    JSON, too deep, wrong fields)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(raw)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({' '.join(str(exc).split())[:200]})") from None
    return _parse_manifest(obj, where)


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open a bundle directory, validate its manifest and verify every file's sha256."""
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory")
    try:
        raw = read_limited(root / MANIFEST, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise BundleError(f"{root}: no {MANIFEST}") from None
    bundle = Bundle(root, parse_manifest(raw, str(root / MANIFEST)), hashlib.sha256(raw).hexdigest())
    for fname in bundle.manifest.files:
        bundle.read(fname)
    bundle.calibration()  # shape and finiteness, not only the hash
    return bundle


def _load_npz_array(data: bytes, spec: InputSpec, *, where: str, key: str | None = "x",
                    max_bytes: int = MAX_FILE_BYTES) -> np.ndarray:
    """One float array from NPZ bytes (no pickles), checked against the input spec. The
    members' declared sizes bound what zipfile will inflate, so they are checked first."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            total = sum(i.file_size for i in zf.infolist())
            if total > max_bytes:
                raise InputError(f"{where}: {total} bytes uncompressed, over the limit of {max_bytes}")
        npz = np.load(io.BytesIO(data), allow_pickle=False)
        names = list(npz.files)
        if key is None:
            key = next((k for k in ("x", "data", "images") if k in names), names[0] if len(names) == 1 else None)
            if key is None:
                raise InputError(f"{where}: several arrays ({', '.join(names)[:120]}) and none is named x, data or images")
        if key not in names:
            raise InputError(f"{where}: no array {key!r} (has {', '.join(names)[:120]})")
        array = npz[key]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise InputError(f"{where}: not a readable NPZ file ({exc})") from None
    return check_calibration(array, spec, where=f"{where}[{key!r}]")


def check_calibration(array: np.ndarray, spec: InputSpec, *, where: str) -> np.ndarray:
    """Validate calibration samples: (N, C, H, W) as the input spec says, float, all finite."""
    want = (spec.shape[0], spec.shape[1], spec.shape[2])
    if array.ndim != 4 or tuple(array.shape[1:]) != want or array.shape[0] == 0:
        raise InputError(f"{where}: shape {tuple(array.shape)}, expected (N, {', '.join(map(str, want))}) "
                         f"in {spec.layout} with N >= 1")
    if array.dtype.kind not in "fiu":
        raise InputError(f"{where}: dtype {array.dtype} is not numeric")
    array = np.ascontiguousarray(array, dtype=np.float32)
    bad = ~np.isfinite(array)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"{where}: {int(bad.sum())} non-finite values (NaN/inf), first at index {index}")
    return array


# Writing bundles (atomic directories, archives) lives in bundle_files.py; its names stay
# importable from here, where every caller has always found them. Resolved on first use (PEP
# 562), not imported at the end of this module: bundle_files imports this module, and a
# process whose first import was bundle_files found these names not defined yet.
_FROM_BUNDLE_FILES = frozenset({"_check_dest", "_commit_dir", "pack_bundle", "unpack_bundle", "write_bundle_dir"})


def __getattr__(name: str) -> Any:
    if name in _FROM_BUNDLE_FILES:
        from . import bundle_files

        return getattr(bundle_files, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
