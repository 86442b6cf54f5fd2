"""Creating a model bundle: from a Gluon HybridBlock or an ONNX file, a split node,
calibration data (an NPZ, an image folder or an array) and labels.

This half needs MXNet and onnx, imported inside the functions; loading, verifying and
packing bundles (edge_agent.int8.bundle) do not, so the idle daemon never pulls this in.
"""

from __future__ import annotations

import io
import logging
import math
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import read_limited
from ..errors import InputError
from ..heap import release_freed_memory
from .bundle import (
    BACKBONE_EDGETPU,
    BACKBONE_INT8,
    BACKBONE_ONNX,
    CALIBRATION,
    HEAD_PARAMS,
    HEAD_SYMBOL,
    MAX_CALIBRATION_BYTES,
    MAX_CALIBRATION_SAMPLES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    REQUIRED_FILES,
    Bundle,
    BundleError,
    Depth,
    FileEntry,
    InputSpec,
    Manifest,
    _check_dest,
    _parse_manifest,
    depth_file,
    params_files,
    write_bundle_dir,
)
from .bundle_files import FileData, StagedFile, Staging
from .calibration_input import load_calibration

log = logging.getLogger(__name__)

# samples the float graph calibrates at a time: the ranges are the same at any batch, its
# activations (kept until their last reader) are not -- 8 ResNet-50 samples at 224 are ~80 MB
CALIBRATION_BATCH = 8
# samples the bias-correction pass runs at a time: it keeps both paths' activations (float
# and int8) and their errors; at 8 a ResNet-50's create peaked at 723 MB against 458 without it
CORRECTION_BATCH = 2


def backbone_corrections(backbone: Any, calib: np.ndarray, ranges: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """The bias corrections of a bundle's backbone (bias_correction.py) on its calibration
    samples and observed `ranges`: every prefix's ops are the backbone's, so create and the
    coordinator's re-quantisation (requantize.py) measure them once, the same way."""
    from .bias_correction import bias_corrections
    from .quantize import constrain_ranges

    return bias_corrections(backbone, calib, constrain_ranges(backbone, ranges), batch_size=CORRECTION_BATCH)


def _resolve_split(model: Any, split: str | None, default: str | None, where: str) -> tuple[str, str]:
    """Split node or tensor name -> (tensor, node name)."""
    from .onnx_import import node_name, split_hint

    nodes = list(model.graph.node)
    wanted = split or default
    if not wanted:
        raise InputError(f"{where}: name the split node between backbone and head with --split; "
                         f"{split_hint(model)}")
    for node in nodes:
        if node_name(node) == wanted or wanted in node.output:
            tensor = wanted if wanted in node.output else node.output[0]
            if tensor in {o.name for o in model.graph.output}:
                raise InputError(f"{where}: split {wanted!r} is the model's output: the head would be empty")
            return tensor, node.name
    raise InputError(f"{where}: unknown split node {wanted!r}; {split_hint(model)}")


def _mxnet_compatible(model: Any) -> Any:
    """MXNet's ONNX importer only sees initializers that are also graph inputs (old IR)."""
    from onnx import helper

    from .mxnet_onnx_compat import axes_as_attributes, constants_as_initializers, slices_as_gathers

    constants_as_initializers(model)  # before the listing below: they become inputs too
    axes_as_attributes(model)
    slices_as_gathers(model)
    listed = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if init.name not in listed:
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    # a Gemm without its optional C input crashes MXNet's linalg_gemm: give it a zero bias;
    # a Conv without kernel_shape (optional: the weight has it) is a KeyError in the importer
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in dims and \
                not any(a.name == "kernel_shape" for a in node.attribute):
            node.attribute.append(helper.make_attribute("kernel_shape", dims[node.input[1]][2:]))
        if node.op_type == "Gemm" and (len(node.input) < 3 or not node.input[2]) and node.input[1] in dims:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            units = dims[node.input[1]][0 if trans_b else -1]
            bias = f"{node.input[1]}__zero_bias"
            if bias not in dims:
                model.graph.initializer.append(helper.make_tensor(bias, 1, [units], [0.0] * units))
                model.graph.input.append(helper.make_tensor_value_info(bias, 1, [units]))
                dims[bias] = [units]
            del node.input[2:]
            node.input.append(bias)
    _free_batch_reshapes(model)
    from .onnx_elementwise import decompose_hard_swish

    return decompose_hard_swish(model)  # MXNet's importer knows HardSigmoid and Mul, not HardSwish


def _free_batch_reshapes(model: Any) -> None:
    """torch's dynamo exporter writes x.view(1, -1) (traced at batch 1) as Reshape(x, [1, C]):
    MXNet aborts the process on any other batch. Make that leading 1 a -1 (the batch)."""
    from onnx import numpy_helper

    consts = {i.name: i for i in model.graph.initializer}
    users = Counter(i for n in model.graph.node for i in n.input)
    for node in model.graph.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or users[node.input[1]] != 1 or node.input[1] not in consts:
            continue
        shape = numpy_helper.to_array(consts[node.input[1]])
        if shape.ndim == 1 and len(shape) >= 2 and shape[0] == 1 and not np.any(shape[1:] <= 0):
            fixed = np.concatenate([[-1], shape[1:]]).astype(shape.dtype)
            consts[node.input[1]].CopyFrom(numpy_helper.from_array(fixed, node.input[1]))


def onnx_to_mxnet(model_bytes: bytes) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """ONNX bytes -> (symbol, arg_params, aux_params) through mxnet.contrib.onnx.

    Bundles no longer use it (their tails come from tail_import.py); tests and the model-zoo
    bench keep it as MXNet's own, independent reading of an ONNX model to compare with."""
    import contextlib

    from .mxnet_onnx_compat import import_naming_node
    from .onnx_import import load_onnx

    model = _mxnet_compatible(load_onnx(model_bytes))  # size limit, parse and onnx.checker first
    # the importer prints deprecation notices on stdout; keep CLI output clean
    with contextlib.redirect_stdout(io.StringIO()):
        return import_naming_node(model)  # as onnx_mxnet.import_model; a failure names its node


def _gluon_split(block: Any, input_name: str) -> str | None:
    """The ONNX tensor ending `block.features` (the project's backbone/head convention):
    MXNet's exporter names each node's output tensor after the MXNet node."""
    features = getattr(block, "features", None)
    if features is None:
        return None
    import mxnet as mx

    return features(mx.sym.var(input_name)).name


def _source_model(source: Any, input_shape: tuple[int, int, int] | None) -> tuple[Any, str, str, str | None]:
    """(onnx model, where for errors, origin for the manifest, default split)."""
    from .onnx_import import load_onnx

    if isinstance(source, bytes | bytearray):
        return load_onnx(bytes(source)), "onnx model", "onnx", None
    if isinstance(source, str | os.PathLike):
        return load_onnx(source), os.fspath(source), f"onnx:{Path(source).name}", None
    from .onnx_export import export_onnx

    if input_shape is None:
        raise InputError("input_shape (C, H, W) is needed to export a Gluon block")
    _refuse_oversized_block(source)
    model = load_onnx(export_onnx(source, (1, *input_shape)))
    return model, f"gluon {type(source).__name__}", "gluon", _gluon_split(source, model.graph.input[0].name)


def _refuse_oversized_block(block: Any) -> None:
    """A Gluon block whose parameters alone exceed what an ONNX model may hold is refused
    before exporting (Gluon vgg11, 515 MB: refused only after the export had taken 6.9 GB)."""
    from .onnx_import import MAX_ONNX_BYTES

    def part(b: Any) -> int:
        params = b.collect_params().values() if b is not None else []
        return sum(math.prod(p.shape) * np.dtype(p.dtype).itemsize for p in params if p.shape and 0 not in p.shape)

    total = part(block)
    if total > MAX_ONNX_BYTES:
        features = part(getattr(block, "features", None))
        split = f" ({features / 2**20:.0f} MB in .features, {(total - features) / 2**20:.0f} MB after it)" \
            if features else ""
        raise InputError(f"gluon {type(block).__name__}: its parameters are {total / 2**20:.0f} MB{split}, over the "
                         f"{MAX_ONNX_BYTES >> 20} MB an ONNX model may hold: refused before exporting")


def create_bundle(
    source: Any,
    dest: str | os.PathLike[str],
    *,
    calibration: str | os.PathLike[str] | np.ndarray,
    labels: list[str],
    name: str,
    version: str,
    split: str | None = None,
    input_shape: tuple[int, int, int] | None = None,
    scale: float = 1.0,
    mean: tuple[float, ...] = (),
    std: tuple[float, ...] = (),
    parent_version: str | None = None,
    method: str | None = None,
    edgetpu_model: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    depths: int = 0,
    bias_correction: bool = False,
) -> Bundle:
    """Build a bundle from a Gluon HybridBlock or an ONNX model (path or bytes).

    The model is cut at `split` (a node or tensor name; for a Gluon net with `.features`
    the default is the output of `.features`): the backbone becomes backbone.onnx and, after
    post-training quantisation on `calibration` (see `load_calibration`), backbone_int8.tflite;
    the head becomes an MXNet symbol + params. Inputs are validated before any work; the
    bundle is written to a temp directory, verified, then renamed to `dest`.
    `depths` > 0 also records up to that many deeper training depths (int8/depth_cuts.py):
    for each, the int8 prefix up to its cut and the fp32 tail from it; head.params then
    holds the deepest tail's parameters. `bias_correction`: every int8 prefix's
    biases absorb their layers' mean int8 error on the calibration samples
    (bias_correction.py), measured once on the backbone; recorded in the manifest so that
    a coordinator re-quantising a prefix does the same.
    """
    import datetime

    from .depth_cuts import depth_costs
    from .engine_memory import count_activations
    from .graph import UnsupportedOpError
    from .onnx_import import import_onnx
    from .onnx_lean import LeanExtractor
    from .quantize import calibrate, quantize_graph
    from .reference import GraphError
    from .tflite_reader import read_tflite
    from .tflite_writer import write_tflite

    _check_dest(Path(dest), overwrite)
    labels = list(labels)
    dupes = sorted(v for v, n in Counter(labels).items() if n > 1)
    if dupes:
        raise InputError(f"labels: {', '.join(map(repr, dupes[:5]))} given more than once")
    if not isinstance(depths, int) or isinstance(depths, bool) or not 0 <= depths <= MAX_DEPTH:
        raise InputError(f"depths: must be an integer 0..{MAX_DEPTH}, got {depths!r}")
    model, where, origin, default_split = _source_model(source, input_shape)
    tensor, node = _resolve_split(model, split, default_split, where)
    try:
        float_graph = import_onnx(model, split=tensor)
    except UnsupportedOpError as exc:  # a ValueError: make it the user's input error
        raise BundleError(f"{where}: backbone up to {tensor!r}: {exc}") from None
    shape = tuple(int(v) for v in float_graph.input_shape[1:])
    if input_shape is not None and tuple(input_shape) != shape:
        raise InputError(f"{where}: input shape is {shape}, not the {tuple(input_shape)} given")
    spec = InputSpec(shape=shape, name=float_graph.input, scale=float(scale),  # type: ignore[arg-type]
                     mean=tuple(mean) or (0.0,) * shape[0], std=tuple(std) or (1.0,) * shape[0])
    manifest = Manifest(
        name=name, version=version, input=spec, labels=labels, split_tensor=tensor,
        split_node=node, feature_shape=tuple(int(v) for v in float_graph.output_shape[1:]),
        files={f: FileEntry("0" * 64, 0) for f in REQUIRED_FILES}, parent_version=parent_version,
        source=origin, created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    _parse_manifest(manifest.to_json(), "bundle arguments")  # name, version, labels, mean/std: fail early
    try:
        extractor = LeanExtractor(model)  # shape inference, without a copy of the weights
    except Exception as exc:  # onnx InferenceError names the op and node
        raise BundleError(f"{where}: ONNX shape inference fails: {str(exc).strip()[:300]}") from None
    _check_head_classes(extractor, model, tensor, labels, where)  # the rest of _head's checks come after the prefixes
    calib = load_calibration(calibration, spec)
    release_freed_memory()  # the importers' intermediate copies (resnet50: ~150 MB kept by malloc)
    with Staging(Path(dest)) as staging:  # the large files go to disk as they are made,
        # and what is no longer needed is let go before the next step (resnet50 at 224:
        # ~0.4 GB of weights in their several forms)
        observed: dict[str, tuple[float, float]] = {}
        corrections: dict[str, Any] | None = None if bias_correction else {}  # the backbone's, once measured
        activations: dict[str, dict[str, int]] = {}  # per int8 prefix file: the planner's figures
        calibration_options = {"batch_size": CALIBRATION_BATCH, **({"method": method} if method else {})}

        def int8_prefix(graph: Any, what: str, fname: str) -> StagedFile:
            """`graph` quantised, staged as `fname`. A depth's prefix is the backbone's ops up to
            its cut, run on the same calibration batches, so the ranges observed on the backbone
            are its own: one calibration pass in all instead of one per depth (resnet50 at 224:
            ~22 s each, and the pass's activations)."""
            nonlocal corrections
            try:
                needed = {graph.input, *(op.output for op in graph.ops)}  # what calibrate observes
                if not needed <= observed.keys():
                    observed.update(calibrate(graph, calib, **calibration_options))
                ranges = {t: observed[t] for t in needed}
                if corrections is None:  # the backbone comes first; its prefixes' ops are its own
                    corrections = backbone_corrections(graph, calib, ranges)
                tfl = write_tflite(quantize_graph(graph, calib, ranges=ranges, corrections=corrections,
                                                  **calibration_options))
                # the reader's checks are what every device will run, and its graph what they count
                activations[fname] = count_activations(read_tflite(tfl))
            except (UnsupportedOpError, GraphError) as exc:
                raise BundleError(f"{where}: cannot quantise the {what}: {exc}") from None
            return staging.put(fname, tfl)

        head_shape = tuple(float_graph.output_shape)
        files: dict[str, FileData] = {BACKBONE_INT8: int8_prefix(float_graph, "backbone", BACKBONE_INT8)}
        del float_graph  # its numpy weights: each depth below imports its own prefix
        release_freed_memory()
        prefixes = _deeper_prefixes(model, tensor, depths, where, int8_prefix)
        head_sym, deep_files, deep_specs, params = _tails(model, extractor, tensor, head_shape, prefixes, labels,
                                                          where)  # MXNet from here
        head_costs = depth_costs(model, tensor) if deep_specs else {}
        # from here on only the backbone's ONNX is read from the source, and only once, written
        # in chunks: neither the sub-model nor its serialisation is held whole
        del model
        files[BACKBONE_ONNX] = staging.put(BACKBONE_ONNX, extractor.extract_serialized([spec.name], [tensor]))
        del extractor
        release_freed_memory()
        files |= {
            HEAD_SYMBOL: head_sym.tojson().encode(),
            # with depths, params_files below writes it (split by depth)
            HEAD_PARAMS: b"" if deep_specs else _ndarray_bytes({f"arg:{k}": v for k, v in params[0].items()}
                                                               | {f"aux:{k}": v for k, v in params[1].items()}),
            CALIBRATION: _calibration_npz(calib),
            **deep_files,
        }
        if edgetpu_model is not None:
            files[BACKBONE_EDGETPU] = read_limited(edgetpu_model, MAX_FILE_BYTES)
            if files[BACKBONE_EDGETPU][4:8] != b"TFL3":
                raise BundleError(f"{edgetpu_model}: not a TFLite flatbuffer (no TFL3 identifier)")
        manifest.extra = {"quantisation": method or "minmax", "calibration_samples": int(len(calib)),
                          "bias_correction": bool(bias_correction)}
        if deep_specs:
            head_depth = Depth(0, tensor, "head", manifest.feature_shape, manifest.split_node, head_costs)
            manifest.depths = [head_depth, *deep_specs]
            for spec in manifest.depths:
                spec.costs.update(activations[depth_file(spec.depth, BACKBONE_INT8)])
            arrays = {k: v.asnumpy() for k, v in {**params[0], **params[1]}.items()}
            kinds = {k: "arg" for k in params[0]} | {k: "aux" for k in params[1]}
            params = ({}, {})  # the NDArrays: their numpy copies are what is written
            release_freed_memory()
            symbols = {f: d for f, d in files.items() if isinstance(d, bytes)}
            files.update((f, staging.put(f, d)) for f, d in params_files(arrays, kinds, manifest, symbols).items())
            del arrays
        # the tails' NDArrays are in `files` now: not held while the bundle is verified and its
        # oracle runs
        del params
        release_freed_memory()
        return write_bundle_dir(Path(dest), files, manifest, overwrite=overwrite, derived=_oracle_answers)


def _calibration_npz(calib: np.ndarray) -> bytes:
    """What the bundle keeps of the calibration: a fixed, spread-out subset, enough for
    on-device calibration (mxnet-onednn) and a check batch, small enough for a Pi's memory."""
    keep = min(MAX_CALIBRATION_SAMPLES, max(1, MAX_CALIBRATION_BYTES // calib[0].nbytes))
    rng = np.random.default_rng(0)
    stored = calib if len(calib) <= keep else calib[np.sort(rng.choice(len(calib), keep, replace=False))]
    npz = io.BytesIO()
    np.savez_compressed(npz, x=stored)
    return npz.getvalue()


def _oracle_answers(bundle: Bundle) -> dict[str, bytes]:
    """oracle.npz, one per depth (oracle_answers.py): the reference's and the fp32 model's
    answers, computed here once instead of on every device's first job at a depth."""
    from .oracle_answers import compute_all

    return compute_all(bundle)


def _deeper_prefixes(model: Any, split: str, depths: int, where: str, int8_prefix: Any
                     ) -> list[tuple[int, Any, tuple[int, ...], StagedFile]]:
    """(depth, cut, the shape there, its int8 prefix staged) for the depths below the head
    split, up to the first whose prefix does not import. All of them before any tail, so
    MXNet (~190 MB once imported) is not resident while they calibrate and quantise."""
    from .depth_cuts import depth_cuts
    from .onnx_import import import_onnx

    out = []
    for k, cut in enumerate(depth_cuts(model, split, depths) if depths else [], start=1):
        try:
            graph = import_onnx(model, split=cut.tensor)  # converts only the prefix's weights
        except (InputError, ValueError) as exc:  # the depths so far stand
            log.warning("%s: depth %d (%s) and deeper not recorded: %s", where, k, cut.tensor, exc)
            break
        shape = tuple(int(v) for v in graph.output_shape)
        # a sub-graph of the backbone: it quantises if the backbone did
        out.append((k, cut, shape, int8_prefix(graph, f"prefix up to depth {k} ({cut.tensor!r})",
                                               depth_file(k, BACKBONE_INT8))))
        del graph
        release_freed_memory()
    return out


def _tails(model: Any, extractor: Any, tensor: str, head_shape: tuple[int, ...],
           prefixes: list[tuple[int, Any, tuple[int, ...], StagedFile]], labels: list[str], where: str
           ) -> tuple[Any, dict[str, FileData], list[Depth], tuple[dict[str, Any], dict[str, Any]]]:
    """The head's symbol; files and manifest entries for the depths whose prefixes were made
    (per depth its int8 prefix and fp32 tail, up to the first tail that does not import or
    whose weights cannot be re-quantised); the parameters of all of them.

    The tails nest, so they are imported deepest first and each shallower one takes the
    deeper one's NDArrays by name instead of holding copies beside them (resnet50: ~60 MB)."""
    from .depth_cuts import depth_costs

    args: dict[str, Any] = {}
    aux: dict[str, Any] = {}
    made: dict[int, tuple[bytes, set[str], dict[str, str]]] = {}
    refused: dict[int, Exception] = {}
    for k, cut, shape, _ in reversed(prefixes):
        try:
            sym, t_args, t_aux, unmapped = _head(extractor, model, cut.tensor, shape, labels, where,
                                                 head_only=False, shared={**args, **aux})
        except (InputError, ValueError) as exc:  # e.g. a tail the importer refuses
            refused[k] = exc
            continue
        made[k] = (sym.tojson().encode(), set(t_args) | set(t_aux), unmapped)
        args.update(t_args)
        aux.update(t_aux)
        release_freed_memory()  # the tail's float graph: only its NDArrays stay
    head_sym, head_args, head_aux, _ = _head(extractor, model, tensor, head_shape, labels, where,
                                             shared={**args, **aux})
    files: dict[str, FileData] = {}
    specs: list[Depth] = []
    kept = set(head_args) | set(head_aux)  # what the recorded tails name, shallowest first
    for k, cut, shape, prefix in prefixes:
        if k in refused:  # the depths so far stand
            log.warning("%s: depth %d (%s) and deeper not recorded: %s", where, k, cut.tensor, refused[k])
            break
        symbol, names, unmapped = made[k]
        frozen = sorted(set(unmapped) - kept)  # inside the shallower int8 prefixes
        if frozen:
            log.warning("%s: depth %d (%s) and deeper not recorded: node %s: its weights do not map back onto "
                        "ONNX initialisers (a fold the tail import does not replay), so the int8 prefixes that "
                        "freeze them could not be re-quantised after training", where, k, cut.tensor,
                        unmapped[frozen[0]])
            break
        files[depth_file(k, BACKBONE_INT8)] = prefix
        files[depth_file(k, HEAD_SYMBOL)] = symbol
        kept |= names
        specs.append(Depth(k, cut.tensor, cut.kind, shape[1:], cut.node, depth_costs(model, cut.tensor)))
    params = ({n: v for n, v in {**args, **head_args}.items() if n in kept},
              {n: v for n, v in {**aux, **head_aux}.items() if n in kept})
    return head_sym, files, specs, params


def _check_head_classes(extractor: Any, model: Any, tensor: str, labels: list[str], where: str) -> None:
    """The head's class count against the labels, before any slow work, on its float graph
    (MXNet is imported only after the int8 prefixes are made: _head checks the rest, and a
    head the project's importer does not carry is left to its fallback there)."""
    from .onnx_import import import_onnx
    from .tail_import import tail_model

    try:
        graph = import_onnx(tail_model(extractor, model, tensor), name="tail", weights=extractor.wmap)
    except (InputError, ValueError):  # _head says why, or imports it another way
        return
    classes = int(np.prod(graph.output_shape[1:]))
    if classes != len(labels):
        raise InputError(_classes_mismatch(where, classes, labels))


def _classes_mismatch(where: str, classes: int, labels: list[str]) -> str:
    return f"{where}: the head outputs {classes} classes but {len(labels)} labels were given"


def _head(extractor: Any, model: Any, tensor: str, input_shape: tuple[int, ...], labels: list[str],
          where: str, *, head_only: bool = True, shared: dict[str, Any] | None = None
          ) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, str]]:
    """The tail from `tensor` to the output as MXNet symbol + params (tail_import.py: the
    project's own importer, parameters named after the ONNX initialisers) and the
    parameters no initialiser gives, checked: it imports, it has something to train, it
    takes the prefix's output and its output size is len(labels).

    `head_only` (the head split, depth 0): an op the project's importer does not carry (a
    Tanh, an Einsum...) falls back to MXNet's own ONNX importer, as heads were imported
    before tail_import.py -- nothing re-quantises a head, so its names need not map back.
    A deeper tail has no fallback: its depth is not recorded. `shared`: NDArrays a deeper
    tail made, by name (import_tail)."""
    from .cut_points import candidate_cuts
    from .graph import UnsupportedOpError
    from .mxnet_graph import MxnetGraphError
    from .mxnet_import import mxnet
    from .tail_import import import_tail

    try:
        tail = import_tail(extractor, model, tensor, mxnet(), shared)
        sym, args, aux, unmapped = tail.symbol, tail.args, tail.aux, tail.unmapped
    except (UnsupportedOpError, MxnetGraphError, InputError) as exc:  # names the node and op
        own = f"{where}: the fp32 tail after {tensor!r} cannot be imported: {exc}"
        if not head_only:
            raise BundleError(own) from None
        try:
            head = extractor.extract_model([tensor], [o.name for o in model.graph.output])
            sym, args, aux = onnx_to_mxnet(head.SerializeToString())
            unmapped = {}
        except Exception as contrib_exc:  # MXNet's importer raises bare errors per op; it names them
            raise BundleError(f"{own}; MXNet's importer: {str(contrib_exc).strip()[:200]}") from None
        log.info("%s: the head after %r came through MXNet's ONNX importer (%s)", where, tensor, exc)
    if not args and not aux:
        before = [c.name for c in candidate_cuts(model) if c.kind == "classifier-input"]
        hint = f"; split before the classifier, e.g. --split {before[0]}" if before else ""
        raise BundleError(f"{where}: the head after {tensor!r} has no parameters: nothing to fine-tune{hint}")
    try:
        _, (out,), _ = sym.infer_shape(**{tensor: input_shape})
    except Exception as exc:  # MXNetError: the head does not take the backbone's output
        raise BundleError(f"{where}: the head does not accept the backbone's output "
                          f"{input_shape}: {str(exc).strip().splitlines()[0][:200]}") from None
    classes = int(np.prod(out[1:]))
    if classes != len(labels):
        raise InputError(_classes_mismatch(where, classes, labels))
    return sym, args, aux, unmapped


def _ndarray_bytes(params: dict[str, Any]) -> bytes:
    """MXNet's ndarray file format, via a private temp file (mx.nd.save needs a path)."""
    import mxnet as mx

    with tempfile.TemporaryDirectory(prefix="edge-agent-head-") as tmp:
        target = Path(tmp) / HEAD_PARAMS
        mx.nd.save(str(target), params)
        return target.read_bytes()
