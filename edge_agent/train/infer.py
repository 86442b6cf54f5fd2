"""Predictions of a (fine-tuned) bundle at a training depth: moved to edge_agent.inference
(the one inference path that `predict`, the daemon's service and evaluation share). These
names stay for existing callers (bench/bench_depth.py)."""

from __future__ import annotations

from ..inference.predictor import DepthPredictor, Predictor, tail_params

__all__ = ["DepthPredictor", "Predictor", "tail_params"]
