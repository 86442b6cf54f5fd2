"""The fp32 tail after the int8 prefix, as a function features -> logits.

One dense layer (most bundles' classifier) is one numpy product; a deeper tail that
numpy_tail computes runs its forward pass in numpy (stored BatchNorm statistics); only a
tail of other ops loads MXNet Gluon. `kind` says which, so a caller (the daemon's service,
`predict`) can report -- and a test can assert -- that no MXNet was needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NUMPY_DENSE, NUMPY_TAIL, MXNET = "numpy-dense", "numpy-tail", "mxnet"


@dataclass(frozen=True)
class Tail:
    kind: str  # NUMPY_DENSE | NUMPY_TAIL | MXNET
    logits: Callable[[np.ndarray], np.ndarray]


def build_tail(view: Any, values: Mapping[str, np.ndarray]) -> Tail:
    """The tail of bundle view `view` (at its depth) with parameters `values` by bare name."""
    from ..int8.bundle import HEAD_SYMBOL
    from ..int8.head_form import _affine, dense_head_form
    from ..train.numpy_tail import TailProgram, unsupported

    symbol_json = view.read(HEAD_SYMBOL).decode("utf-8")
    split = view.manifest.split_tensor
    form = dense_head_form(symbol_json, split)
    if form is not None and form.weight in values and form.bias in values:
        w = np.asarray(values[form.weight], np.float32)
        b = np.asarray(values[form.bias], np.float32).reshape(-1)
        return Tail(NUMPY_DENSE, lambda f: _affine(form, w, b, f))
    if not unsupported(symbol_json, split):
        program = TailProgram(symbol_json, split)
        weights = {name: np.asarray(values[name], np.float32) for name in (*program.arg_names, *program.aux_names)}
        return Tail(NUMPY_TAIL, lambda f: program.forward(weights, np.asarray(f, np.float32), False)[0])
    return _mxnet_tail(view, values)


def _mxnet_tail(view: Any, values: Mapping[str, np.ndarray]) -> Tail:
    from ..int8.mxnet_import import mxnet

    mx = mxnet()  # MXNetUnavailableError (one line, exit 69) where it cannot load
    block = view.head_block()
    for name, p in block.collect_params().items():
        p.set_data(mx.nd.array(np.asarray(values[name], np.float32)))
    return Tail(MXNET, lambda f: block(mx.nd.array(np.ascontiguousarray(f, np.float32))).asnumpy())
