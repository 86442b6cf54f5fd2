"""numpy's BLAS on one thread for a fine-tuning job.

numpy's OpenBLAS runs a matrix product on as many threads as the machine has cores, and after
each product its idle threads busy-wait a while before they sleep (OpenBLAS's THREAD_TIMEOUT),
so the work that follows -- an int8 engine's run, the reference's -- pays for spinning cores.
A job's products are small (a tail's 1x1 convolutions over 32 images at 3x3 pixels: 288 x 480
by 480 x 80; here a second thread cut such a product's wall time by a third at 17 % more CPU),
and most of a first job's work between them is not BLAS. A digits first job at depth 4 on
2 cores (4 alternating runs each): 4.77-5.57 CPU-s with OpenBLAS's default, 4.37-4.51 on one
thread -- selection, prefix adaptation and features each cheaper; jobs in service, mostly the
training loop, within noise either way. The int8 engines keep their own thread counts
(XNNPACK's pool, the native kernels' threads): only BLAS is limited.

threadpoolctl sets it at run time, after numpy has loaded OpenBLAS (the OPENBLAS_NUM_THREADS
variable is read only when the library loads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's (and any other loaded) BLAS on one thread inside the block."""
    # a dependency, imported when a job starts rather than with the module
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield
