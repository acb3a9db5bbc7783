"""Round-3 hostile cases on the precompute / cache / inspect / inference-input side (issue 27)."""
from __future__ import annotations

from precompute.sources.listing import Truncated
from precompute.sources.synthetic import SyntheticListing


def test_num_samples_cut_meets_the_barrier_on_every_rank_even_when_the_record_exists(tmp_path):
    """Rank 1 starting after rank 0 wrote num_samples.json used to skip the barrier, so it ran one collective ahead
    (into shard writing before rank 0 had made errors/)."""
    calls = {0: 0, 1: 0}

    def barrier_for(rank):
        def barrier():
            calls[rank] += 1
        return barrier

    inner = SyntheticListing(0, 10, 16)
    first = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))
    late = Truncated(inner, 4, tmp_path, rank=1, barrier=barrier_for(1))
    assert (tmp_path / Truncated.RECORD).is_file()
    assert calls == {0: 1, 1: 1}
    assert len(first) == len(late) == 4
    rerun = Truncated(inner, 4, tmp_path, rank=0, barrier=barrier_for(0))  # a rerun reads the record, still meets it
    assert len(rerun) == 4 and calls[0] == 2
