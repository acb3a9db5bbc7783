"""theworld.core.heap: what a command loaded is kept out of the collector's passes for its run, garbage is not, and
nothing stays frozen after the command returns."""

from __future__ import annotations

import gc
import os
import weakref

from tests.conftest import base_args, train_inproc
from theworld.core import heap


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_freeze_keeps_the_live_objects_and_collects_the_garbage_first():
    with heap.scope():
        garbage = _Node()
        gone = weakref.ref(garbage)
        del garbage
        kept = _Node()
        heap.freeze()
        assert gone() is None  # collected before the freeze, not kept for the run
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of the collector's generations
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())  # the collector's again


def test_a_forked_process_inherits_the_frozen_objects():
    with heap.scope():
        kept = _Node()
        heap.freeze()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a loader worker's situation: its passes skip what its parent froze
            skipped = gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())
            os.write(w, b"1" if skipped else b"0")
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"1"


def test_a_training_run_trains_with_its_loaded_objects_frozen_and_leaves_none(cache, tmp_path, monkeypatch):
    import train.step

    seen = []

    def step_and_look(components, state, micro):
        if not seen:  # the model, its optimizer and the run's objects: out of the collector's passes while it trains
            alive = {id(o) for o in gc.get_objects()}
            seen.append([id(x) in alive for x in (components.raw, components.optimizer, state)])
        return real(components, state, micro)

    real = train.step.optimization_step
    monkeypatch.setattr(train.step, "optimization_step", step_and_look)  # train.loop.train imports it as it starts
    assert train_inproc(base_args(cache, tmp_path / "run", steps=1)) == 0
    assert seen == [[False, False, False]]
    assert gc.get_freeze_count() == 0
