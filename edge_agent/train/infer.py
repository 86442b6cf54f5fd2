"""Predictions of a (fine-tuned) bundle at a training depth: the int8 prefix on an engine,
then the fp32 tail, with the bundle's own parameters or a trained head.params.

For evaluation -- held-out accuracy in benchmarks, the fleet simulation, tests -- not for
the idle daemon: it imports MXNet for any tail that is not one dense layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def tail_params(bundle: Any, head_file: str | Path | None = None) -> dict[str, np.ndarray]:
    """The bundle's head.params by bare name, or those of a trained head file."""
    from ..atomic import read_limited
    from ..mxparams import load_params, split_names
    from .trainer import head_from_bundle

    if head_file is None:
        return head_from_bundle(bundle)[1]
    return split_names(load_params(read_limited(head_file, 256 << 20), where=str(head_file)))[0]


class DepthPredictor:
    """logits(raw NCHW pixels) through `bundle` at `depth` with `params` (by bare name)."""

    def __init__(self, bundle: Any, *, depth: int = 0, params: Mapping[str, np.ndarray] | None = None,
                 engine: str = "reference", threads: int = 1) -> None:
        from ..int8.engines import load_engine
        from .dense_head import _affine, dense_head_form
        from .trainer import head_from_bundle

        self.view = bundle.at_depth(depth)
        self.spec = self.view.manifest.input
        self.runner = load_engine(engine).prepare(self.view, threads=threads)
        symbol_json, base = head_from_bundle(self.view)
        values = {**base, **(params or {})}
        form = dense_head_form(symbol_json, self.view.manifest.split_tensor)
        if form is not None:
            w, b = np.asarray(values[form.weight], np.float32), np.asarray(values[form.bias], np.float32)
            self._tail = lambda f: _affine(form, w, b.reshape(-1), f)
            return
        import mxnet as mx

        block = self.view.head_block()
        for name, p in block.collect_params().items():
            p.set_data(mx.nd.array(np.asarray(values[name], np.float32)))
        self._tail = lambda f: block(mx.nd.array(np.ascontiguousarray(f, np.float32))).asnumpy()

    def logits(self, raw: np.ndarray, *, batch_size: int = 64) -> np.ndarray:
        x = self.spec.normalise(raw)
        return np.concatenate([self._tail(self.runner.run(x[i:i + batch_size]))
                               for i in range(0, len(x), batch_size)])

    def accuracy(self, raw: np.ndarray, labels: np.ndarray) -> float:
        return float((self.logits(raw).argmax(axis=1) == np.asarray(labels)).mean()) if len(labels) else float("nan")

    def close(self) -> None:
        self.runner.close()
