"""edge_agent/heap.py: a job's collections walk only what the job made (gc.freeze)."""

from __future__ import annotations

import gc
import threading

from edge_agent.heap import new_objects_only, release_freed_memory


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_collections_inside_the_block_leave_the_older_objects_out_and_find_the_new_cycles() -> None:
    older = [_Cycle() for _ in range(1000)]
    del older  # cyclic garbage made before the block: left for after it
    gc.collect()  # (and any earlier test's, so the count below is this test's)
    older = [_Cycle() for _ in range(1000)]
    older_ids = {id(o) for o in older}
    assert gc.get_freeze_count() == 0
    with new_objects_only():
        frozen = gc.get_freeze_count()
        assert frozen >= 1000  # the older objects, and everything alive when the block began
        del older
        new = _Cycle()
        new_id = id(new)
        del new
        found = gc.collect()
        assert 1 <= found < 1000  # the new cycle is found, the older ones dropped inside the block are not
        assert not any(id(o) in older_ids for o in gc.get_objects())  # (nor walked)
        assert new_id not in {id(o) for o in gc.get_objects()}
        assert release_freed_memory() in (True, False)  # collects and trims inside the block too
    assert gc.get_freeze_count() == 0
    assert gc.collect() >= 1000  # the older cycles dropped meanwhile are collected after the block


def test_nested_and_concurrent_blocks_share_one_freeze_lifted_by_the_last() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with new_objects_only():
            entered.set()
            release.wait(10)

    with new_objects_only():
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
        with new_objects_only():
            pass
        assert gc.get_freeze_count() > 0  # the inner block's end did not lift it
        release.set()
        thread.join(10)
        assert gc.get_freeze_count() > 0  # nor the other thread's
    assert gc.get_freeze_count() == 0
