"""Inference on the device: the ONE path from raw pixels to labels, shared by
`edge-agent predict`, the daemon's local service and evaluation (benchmarks, the fleet
simulation, the local guard that decides which model is served).

    raw pixels -> bundle input spec -> int8 prefix on the selected engine (at the depth the
    tail was trained at) -> fp32 tail: numpy for one dense layer or any tail numpy_tail
    computes, MXNet Gluon only for anything else -> logits -> top-k

Rooms: this package sits above int8 (engines, bundles, the selection cache) and the numpy
side of train (dense_head's form, numpy_tail's forward); the agent imports it, never the
other way round, and nothing here imports MXNet at module level.
"""
