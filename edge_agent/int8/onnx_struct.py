"""ONNX -> float graph handlers for the structural ops of real models (ResNet v1/v2, DenseNet,
ShuffleNet, SqueezeNet, torchvision exports): a mixin of onnx_import._Converter.

Lowerings, each exact in float and in int8:
- MaxPool with explicit pads SAME/VALID cannot express (ResNet v1's k3 s2 pads 1): PADV2
  filled with the int8 minimum (-128, below every value; the float graph pads with the
  batch minimum) then a VALID pool; ceil_mode widens the bottom/right padding the same way;
- AveragePool with pads: SAME when they are SAME's and count_include_pad=0 (TFLite divides by
  the in-image cells), PAD (zero) + VALID with count_include_pad=1; anything else is refused;
- a BatchNormalization that cannot fold into its producer (pre-activation ResNet v2,
  DenseNet): a 1x1 DEPTHWISE_CONV_2D with weight gamma/sqrt(var+eps) and bias
  beta - mean*weight (2-D input: RESHAPE around it); a following Relu fuses into it;
- Identity of a constant (torch's legacy exporter shares weights that way) is a constant, and
  so are Transpose / Reshape of one (dynamo's transposed Linear weights);
- Gemm / MatMul on a constant right operand: FULLY_CONNECTED (missing bias = zeros);
- Flatten, Reshape to (N, -1) / (0, -1), Squeeze of (N, C, 1, 1), Unsqueeze / Reshape back;
- channel shuffle, Reshape (N,g,C/g,H,W) -> Transpose(0,2,1,3,4) -> Reshape (N,C,H,W): one
  GATHER of the permuted channels (NHWC axis 3); Split along channels: a GATHER per part;
  Slice of a channel range with constant bounds (ShuffleNet v2's chunk, once onnx_fold.py has
  folded its Shape arithmetic): a GATHER of those channels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import onnx_import as oi
from .float_graph import FloatOp, to_nchw_shape
from .float_ops import out_size, same_pads
from .graph import UnsupportedOpError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import onnx


class StructOps:
    """`_op_<OnnxOp>` handlers; they use the converter's _act / _emit / shapes / consts."""

    pending: dict[str, dict[str, Any]]  # 5-D channel-split views awaiting the shuffle's end

    # -- pools
    def _pool(self, node: onnx.NodeProto, kind: str) -> None:
        nm, a, op_type = oi.node_name(node), oi._attrs(node), node.op_type
        x = self._act(node.input[0], f"node {nm!r}")
        if len(self.shapes[x]) != 4:
            raise UnsupportedOpError(nm, op_type, f"only 2-D pooling of an NCHW map, input {to_nchw_shape(self.shapes[x])}")
        n, h, w, c = self.shapes[x]
        if len(a.get("kernel_shape", [])) != 2 or len(a.get("strides", [1, 1])) != 2:
            raise UnsupportedOpError(nm, op_type, f"kernel_shape {a.get('kernel_shape')} / strides "
                                     f"{a.get('strides')} (supported: 2-D windows)")
        kh, kw = a["kernel_shape"]
        sh, sw = a.get("strides", [1, 1])
        if any(v != 1 for v in a.get("dilations", [1, 1])):
            raise UnsupportedOpError(nm, op_type, "dilated pooling")
        t, left, b, r = pads = oi._explicit_pads(nm, op_type, a, (h, w), (kh, kw), (sh, sw), (1, 1))
        if a.get("ceil_mode", 0):  # ONNX: out = ceil((size + pads - k) / s) + 1
            oh, ow = (-(-(s + p0 + p1 - k) // st) + 1 for s, p0, p1, k, st in
                      ((h, t, b, kh, sh), (w, left, r, kw, sw)))
        else:
            oh, ow = ((h + t + b - kh) // sh + 1), ((w + left + r - kw) // sw + 1)
        if min(oh, ow, kh, kw, sh, sw) < 1:
            raise UnsupportedOpError(nm, op_type, f"window {kh}x{kw} stride {sh}x{sw} on a {h}x{w} map with pads "
                                     f"{pads} (supported: positive windows that fit the padded input)")
        same = tuple(p for dim in zip(same_pads(h, kh, sh, 1), same_pads(w, kw, sw, 1), strict=True) for p in dim)
        include_pad = bool(a.get("count_include_pad", 0))
        exact = (oh, ow) == (out_size(h, kh, sh, 1, "VALID"), out_size(w, kw, sw, 1, "VALID"))
        if not any(pads) and exact:
            padding = "VALID"
        elif pads == same and (oh, ow) == (out_size(h, kh, sh, 1, "SAME"), out_size(w, kw, sw, 1, "SAME")) \
                and not (kind == "AVERAGE_POOL_2D" and include_pad):
            padding = "SAME"  # TFLite's SAME pooling ignores the padded cells, as ONNX's pads do here
        elif kind == "MAX_POOL_2D" or include_pad:
            # extra bottom/right cells so a VALID pool yields ONNX's (ceil_mode) output size
            eb, er = max(0, (oh - 1) * sh + kh - (h + t + b)), max(0, (ow - 1) * sw + kw - (w + left + r))
            if kind == "AVERAGE_POOL_2D" and (eb or er):
                raise UnsupportedOpError(nm, op_type, "ceil_mode=1 windows past the padding with "
                                         "count_include_pad=1 (supported: ceil_mode=0, or no overhang)")
            if max(t, b + eb) >= kh or max(left, r + er) >= kw or (oh - 1) * sh >= h + t or (ow - 1) * sw >= w + left:
                raise UnsupportedOpError(nm, op_type, f"pads {pads} leave a window without input cells "
                                         f"(supported: pads smaller than the kernel {kh}x{kw})")
            pad_kind = "PADV2" if kind == "MAX_POOL_2D" else "PAD"  # max: -128 fill; average: zeros
            x = self._pad_op(node, pad_kind, x, (t, b + eb), (left, r + er))
            padding = "VALID"
        else:
            raise UnsupportedOpError(nm, op_type, f"pads {pads} with count_include_pad=0 (supported: no pads, "
                                     f"TFLite SAME pads {same}, or count_include_pad=1)")
        opts = {"stride_h": sh, "stride_w": sw, "filter_h": kh, "filter_w": kw,
                "padding": padding, "activation": "NONE"}
        self._emit(node, FloatOp(kind, nm, [x], node.output[0], opts), (n, oh, ow, c))

    def _pad_op(self, node: onnx.NodeProto, kind: str, x: str, ph: tuple[int, int], pw: tuple[int, int]) -> str:
        n, h, w, c = self.shapes[x]
        out = f"{oi.node_name(node)}_pad"
        self._emit(node, FloatOp(kind, f"{oi.node_name(node)}/pad", [x], out,
                                 {"paddings": ((0, 0), ph, pw, (0, 0))}), (n, h + sum(ph), w + sum(pw), c))
        return out

    def _op_MaxPool(self, node: onnx.NodeProto) -> None:  # noqa: N802 - ONNX op names
        if len(node.output) > 1 and self.uses.get(node.output[1]):
            raise UnsupportedOpError(oi.node_name(node), "MaxPool", "its indices output is used")
        if oi._attrs(node).get("storage_order", 0):
            raise UnsupportedOpError(oi.node_name(node), "MaxPool", "storage_order=1")
        self._pool(node, "MAX_POOL_2D")

    def _op_AveragePool(self, node: onnx.NodeProto) -> None:  # noqa: N802
        self._pool(node, "AVERAGE_POOL_2D")

    # -- batch norm
    def _op_BatchNormalization(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = oi.node_name(node)
        if len(node.output) > 1 and any(self.uses.get(o) for o in node.output[1:] if o):
            raise UnsupportedOpError(nm, "BatchNormalization", "training mode (running mean/var outputs used)")
        x = self._act(node.input[0], f"node {nm!r}")
        channels = self.shapes[x][-1]
        gamma, beta, mean, var = (self._const(node, i) for i in range(1, 5))
        eps = float(oi._attrs(node).get("epsilon", 1e-5))
        if any(p is None or p.size != channels for p in (gamma, beta, mean, var)):
            raise oi.OnnxImportError(f"node {nm!r}: BatchNormalization parameters do not have {channels} channels")
        gamma, beta, mean, var = (p.reshape(-1).astype(np.float64) for p in (gamma, beta, mean, var))
        if np.any(var + eps <= 0):
            raise oi.OnnxImportError(f"node {nm!r}: negative variance")
        scale = gamma / np.sqrt(var + eps)
        try:
            op = self._fusable(node.input[0], node, ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"))
            if op.options.get("activation", "NONE") != "NONE":
                op = None
        except UnsupportedOpError:
            op = None
        if op is not None:  # fold into the producer's weights and bias
            axis = 3 if op.kind == "DEPTHWISE_CONV_2D" else 0
            shape = [1] * op.weight.ndim
            shape[axis] = -1
            op.weight = (op.weight * scale.reshape(shape)).astype(np.float32)
            op.bias = ((op.bias - mean) * scale + beta).astype(np.float32)
            op.norm = (gamma.astype(np.float32), beta.astype(np.float32))
            self._rename(op, node.output[0])
            return
        self._channel_affine(node, x, scale, beta - mean * scale)
        affine = self.producer[node.output[0]]
        if affine.kind == "DEPTHWISE_CONV_2D":  # a (N, C) input's affine sits between reshapes: left as it is
            affine.norm = (gamma.astype(np.float32), beta.astype(np.float32))

    def _channel_affine(self, node: onnx.NodeProto, x: str, scale: np.ndarray, shift: np.ndarray) -> None:
        """y = x * scale[c] + shift[c] as a 1x1 DEPTHWISE_CONV_2D (2-D input: reshaped around it)."""
        nm, shape = oi.node_name(node), self.shapes[x]
        c = shape[-1]
        if len(shape) not in (2, 4):
            raise UnsupportedOpError(nm, node.op_type, f"input of rank {len(shape)} (supported: NCHW or (N, C))")
        src = x
        if len(shape) == 2:
            src = f"{nm}_as_map"
            self._emit(node, FloatOp("RESHAPE", f"{nm}/to_map", [x], src, {"new_shape": (-1, 1, 1, c)}),
                       (shape[0], 1, 1, c))
        opts = {"stride_h": 1, "stride_w": 1, "padding": "VALID", "dilation_h": 1, "dilation_w": 1,
                "depth_multiplier": 1, "activation": "NONE"}
        out = node.output[0] if len(shape) == 4 else f"{nm}_map"
        self._emit(node, FloatOp("DEPTHWISE_CONV_2D", nm, [src], out, opts,
                                 scale.reshape(1, 1, 1, c).astype(np.float32), shift.astype(np.float32)),
                   self.shapes[src])
        if len(shape) == 2:
            self._emit(node, FloatOp("RESHAPE", f"{nm}/to_flat", [out], node.output[0], {"new_shape": (-1, c)}), shape)

    # -- identity
    def _op_Identity(self, node: onnx.NodeProto) -> None:  # noqa: N802
        src = node.input[0]
        if src in self.consts:  # torch's legacy exporter: Identity of a shared initializer
            self.consts[node.output[0]] = self.consts[src]
        elif src in self.pending:
            self.pending[node.output[0]] = self.pending[src]
        else:
            self.alias[node.output[0]] = self._act(src, f"node {oi.node_name(node)!r}")

    # -- matrix products
    def _op_Gemm(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm, a = oi.node_name(node), oi._attrs(node)
        if a.get("transA", 0):
            raise UnsupportedOpError(nm, "Gemm", "transA=1 (supported: transA=0, the activation as A)")
        x = self._act(node.input[0], f"node {nm!r}")
        b = self._const(node, 1)
        if b is None or b.ndim != 2:
            raise UnsupportedOpError(nm, "Gemm", f"B must be a 2-D constant, got shape {getattr(b, 'shape', None)}")
        w = b.astype(np.float64) * float(a.get("alpha", 1.0))
        w = w if a.get("transB", 0) else w.T  # FULLY_CONNECTED weight: [out, in]
        c = self._const(node, 2)  # optional since opset 11: none = zeros
        if c is not None and (c.size not in (1, w.shape[0]) or (c.ndim == 2 and c.shape[0] != 1)):
            raise UnsupportedOpError(nm, "Gemm", f"C of shape {c.shape} is not a bias of {w.shape[0]} outputs")
        bias = np.zeros(w.shape[0]) if c is None else np.asarray(c, np.float64).reshape(-1) * float(a.get("beta", 1.0))
        self._fc(node, x, w, bias)

    def _op_MatMul(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = oi.node_name(node)
        if node.input[0] in self.consts:
            raise UnsupportedOpError(nm, "MatMul", "a constant left operand (supported: activation @ constant)")
        x = self._act(node.input[0], f"node {nm!r}")
        w = self._const(node, 1)
        if w.ndim != 2:
            raise UnsupportedOpError(nm, "MatMul", f"weight shape {w.shape} (supported: 2-D)")
        self._fc(node, x, w.T, np.zeros(w.shape[1]))

    # -- reshapes, flatten, channel shuffle
    def _flatten_to(self, node: onnx.NodeProto, x: str) -> None:
        shape = self.shapes[x]
        if len(shape) == 2:
            self.alias[node.output[0]] = x
            return
        n, h, w, c = shape
        self._emit(node, FloatOp("RESHAPE", oi.node_name(node), [x], node.output[0],
                                 {"new_shape": (-1, h * w * c)}), (n, h * w * c))
        if h * w > 1:
            self.flat_nchw[node.output[0]] = (h, w, c)

    def _op_Flatten(self, node: onnx.NodeProto) -> None:  # noqa: N802
        if oi._attrs(node).get("axis", 1) != 1:
            raise UnsupportedOpError(oi.node_name(node), "Flatten", "only axis=1")
        self._flatten_to(node, self._act(node.input[0], f"node {oi.node_name(node)!r}"))

    def _target_shape(self, node: onnx.NodeProto, src: tuple[int, ...]) -> tuple[int, ...]:
        nm = oi.node_name(node)
        spec = self._const(node, 1)
        if spec is None:
            raise UnsupportedOpError(nm, "Reshape", "needs a constant shape input")
        allow_zero = oi._attrs(node).get("allowzero", 0)
        target = [src[i] if v == 0 and not allow_zero and i < len(src) else int(v)
                  for i, v in enumerate(np.asarray(spec).reshape(-1))]
        total = int(np.prod(src))
        if target.count(-1) == 1:
            known = int(np.prod([v for v in target if v != -1]))
            target[target.index(-1)] = total // max(known, 1)
        if int(np.prod(target)) != total or min(target, default=0) < 1:
            raise oi.OnnxImportError(f"node {nm!r}: cannot reshape {src} to {tuple(int(v) for v in spec.reshape(-1))}")
        return tuple(target)

    def _op_Reshape(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = oi.node_name(node)
        if node.input[0] in self.consts:  # a weight reshaped by the exporter: fold it
            value = self.consts[node.input[0]]
            self.consts[node.output[0]] = value.reshape(self._target_shape(node, value.shape))
            return
        if node.input[0] in self.pending:
            self._end_shuffle(node)
            return
        x = self._act(node.input[0], f"node {nm!r}")
        src = to_nchw_shape(self.shapes[x])
        target = self._target_shape(node, src)
        if target == src:
            self.alias[node.output[0]] = x
        elif len(target) == 2 and target[0] == src[0]:
            self._flatten_to(node, x)
        elif len(src) == 2 and target == (src[0], src[1], 1, 1):  # (N, C) -> (N, C, 1, 1)
            self._emit(node, FloatOp("RESHAPE", nm, [x], node.output[0], {"new_shape": (-1, 1, 1, src[1])}),
                       (src[0], 1, 1, src[1]))
        elif len(src) == 4 and len(target) == 5 and target[0] == src[0] and target[3:] == src[2:] \
                and target[1] * target[2] == src[1] and x not in self.flat_nchw:
            self.pending[node.output[0]] = {"src": x, "shape": target, "transposed": False}  # shuffle start
        else:
            raise UnsupportedOpError(nm, "Reshape", f"{src} -> {target} (supported: flattening to (N, -1), "
                                     "(N, C) -> (N, C, 1, 1), and ShuffleNet's channel shuffle)")

    def _op_Transpose(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm = oi.node_name(node)
        perm = tuple(int(p) for p in oi._attrs(node).get("perm", []))
        src = node.input[0]
        if src in self.consts:  # torch's dynamo exporter transposes Linear weights: fold it
            self.consts[node.output[0]] = np.transpose(self.consts[src], perm or None)
            return
        if src in self.pending and perm == (0, 2, 1, 3, 4):
            p = self.pending[src]
            n, g, cg, h, w = p["shape"]
            self.pending[node.output[0]] = {"src": p["src"], "shape": (n, cg, g, h, w), "transposed": not p["transposed"],
                                            "groups": p.get("groups", g)}
            return
        x = self._act(src, f"node {nm!r}")
        if perm == tuple(range(len(self.shapes[x]))):
            self.alias[node.output[0]] = x
            return
        raise UnsupportedOpError(nm, "Transpose", f"perm {perm} (supported: the identity, and (0, 2, 1, 3, 4) "
                                 "inside ShuffleNet's channel shuffle)")

    def _end_shuffle(self, node: onnx.NodeProto) -> None:
        nm, p = oi.node_name(node), self.pending[node.input[0]]
        x = p["src"]
        src = to_nchw_shape(self.shapes[x])
        if self._target_shape(node, p["shape"]) != src:
            raise UnsupportedOpError(nm, "Reshape", f"a 5-D channel split {p['shape']} must be reshaped back to {src}")
        if not p["transposed"]:
            self.alias[node.output[0]] = x
            return
        g, c = p.get("groups", p["shape"][2]), src[1]
        perm = np.arange(c).reshape(g, c // g).T.reshape(-1)  # output channel a*g+b <- input b*(C/g)+a
        self._emit(node, FloatOp("GATHER", nm, [x], node.output[0], {"axis": 3, "indices": perm}), self.shapes[x])

    def _squeeze_axes(self, node: onnx.NodeProto) -> list[int] | None:
        axes = oi._attrs(node).get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:  # opset 13 moved axes to an input
            axes = self._const(node, 1).reshape(-1).tolist()
        return None if axes is None else [int(a) for a in axes]

    def _op_Squeeze(self, node: onnx.NodeProto) -> None:  # noqa: N802
        """(N, C, 1, 1) -> (N, C): a flatten variant (after a global pool)."""
        nm = oi.node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        shape, axes = self.shapes[x], self._squeeze_axes(node)
        if len(shape) != 4 or shape[1:3] != (1, 1) or sorted(a % 4 for a in (axes or [2, 3])) != [2, 3]:
            raise UnsupportedOpError(nm, "Squeeze", f"axes {axes} of {to_nchw_shape(shape)} "
                                     "(supported: the 1x1 spatial axes 2, 3 of (N, C, 1, 1))")
        self._flatten_to(node, x)

    def _op_Unsqueeze(self, node: onnx.NodeProto) -> None:  # noqa: N802
        """(N, C) -> (N, C, 1, 1)."""
        nm = oi.node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        shape, axes = self.shapes[x], self._squeeze_axes(node)
        if len(shape) != 2 or axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            raise UnsupportedOpError(nm, "Unsqueeze", f"axes {axes} of {shape} (supported: (N, C) -> (N, C, 1, 1))")
        self._emit(node, FloatOp("RESHAPE", nm, [x], node.output[0], {"new_shape": (-1, 1, 1, shape[1])}),
                   (shape[0], 1, 1, shape[1]))

    def _op_Split(self, node: onnx.NodeProto) -> None:  # noqa: N802
        nm, a = oi.node_name(node), oi._attrs(node)
        x = self._act(node.input[0], f"node {nm!r}")
        shape = self.shapes[x]
        axis = int(a.get("axis", 0)) % len(shape)
        if len(shape) != 4 or axis != 1:
            raise UnsupportedOpError(nm, "Split", f"axis {axis} of rank {len(shape)} (supported: channels of NCHW)")
        c = shape[3]
        sizes = self._const(node, 1) if len(node.input) > 1 and node.input[1] else a.get("split")
        if sizes is None:
            k = len(node.output)
            sizes = [-(-c // k)] * (k - 1) + [c - -(-c // k) * (k - 1)]
        sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
        if len(sizes) != len(node.output) or sum(sizes) != c or min(sizes) < 1:
            raise oi.OnnxImportError(f"node {nm!r}: split sizes {sizes} do not cover {c} channels")
        start = 0
        for i, (out, size) in enumerate(zip(node.output, sizes, strict=True)):
            if out and self.uses.get(out):
                self._emit(node, FloatOp("GATHER", f"{nm}/{i}", [x], out,
                                         {"axis": 3, "indices": np.arange(start, start + size)}),
                           (*shape[:3], size))
            start += size

    def _op_Slice(self, node: onnx.NodeProto) -> None:  # noqa: N802
        """A channel range of an NCHW map with constant starts / ends / axes / steps: GATHER."""
        nm = oi.node_name(node)
        x = self._act(node.input[0], f"node {nm!r}")
        shape = self.shapes[x]
        if len(node.input) < 3:
            raise UnsupportedOpError(nm, "Slice", "starts and ends as inputs (opset 10+)")
        starts, ends = (self._const(node, i).reshape(-1) for i in (1, 2))
        axes = self._const(node, 3) if len(node.input) > 3 and node.input[3] else None
        steps = self._const(node, 4) if len(node.input) > 4 and node.input[4] else None
        axes = np.arange(len(starts)) if axes is None else axes.reshape(-1)
        steps = np.ones(len(starts), np.int64) if steps is None else steps.reshape(-1)
        nchw = to_nchw_shape(shape)
        index = np.arange(int(np.prod(nchw))).reshape(nchw)
        parts = [slice(None)] * len(nchw)
        for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
            parts[int(ax) % len(nchw)] = slice(int(s), int(e), int(st))
        kept = index[tuple(parts)]
        if len(shape) != 4 or kept.shape[0] != nchw[0] or kept.shape[2:] != nchw[2:] or kept.shape[1] < 1:
            raise UnsupportedOpError(nm, "Slice", f"{nchw} -> {kept.shape} (supported: a channel range of an "
                                     "NCHW map, constant starts / ends)")
        channels = kept[0, :, 0, 0] // (nchw[2] * nchw[3])
        self._emit(node, FloatOp("GATHER", nm, [x], node.output[0], {"axis": 3, "indices": channels}),
                   (*shape[:3], len(channels)))
