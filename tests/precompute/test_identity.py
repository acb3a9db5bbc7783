"""What built an output_dir: the identity a run records, and the one-line refusals of a folder built otherwise."""

from __future__ import annotations

import json
import os

import pytest

from precompute import identity
from tests._precompute_helpers import make_cfg
from theworld import cache_format as cf
from theworld.core import atomic
from theworld.core.errors import UserError


def test_a_synthetic_layout_is_its_seed_not_a_path_or_a_prompt(tmp_path):
    one = identity.layout_identity(make_cfg(tmp_path, "seed=3", shard=8))
    two = identity.layout_identity(make_cfg(tmp_path / "elsewhere", "seed=3", shard=8))
    assert one == two  # output_dir is no part of it
    assert one["source"]["seed"] == 3 and one["source"]["path"] is None and one["source"]["prompt"] is None
    assert one["shard_size"] == 8 and "img2dataset" not in one["source"]
    assert identity.layout_identity(make_cfg(tmp_path, "seed=4")) != one


def test_how_fast_and_where_urls_download_is_no_part_of_the_identity(tmp_path):
    def urls(*sets):
        cfg = make_cfg(tmp_path, "source.type=urls", f"source.path={tmp_path / 'u.parquet'}", *sets)
        return identity.layout_identity(cfg)

    fast = urls(f"source.staging_dir={tmp_path / 'a'}", "source.img2dataset.thread_count=3")
    slow = urls(f"source.staging_dir={tmp_path / 'b'}", "source.img2dataset.processes_count=5")
    assert fast == slow and fast["source"]["staging_dir"] is None
    assert "thread_count" not in fast["source"]["img2dataset"]
    assert urls("source.img2dataset.retries=7") != fast  # what it downloads still counts


def test_run_identity_adds_the_fingerprint_and_the_entry_count(tmp_path):
    cfg = make_cfg(tmp_path)
    run = identity.run_identity(cfg, {"vae": "x"}, 12)
    assert run == {"fingerprint": {"vae": "x"}, **identity.layout_identity(cfg), "num_entries": 12}


def test_an_empty_or_own_output_dir_is_accepted_and_claim_records_the_identity_once(tmp_path):
    ident = {"fingerprint": {"a": 1}, "shard_size": 8}
    identity.check_identity(tmp_path, ident)  # nothing there yet
    stale = tmp_path / cf.SHARDS / atomic.partial_name("shard-000000.tar", pid=os.getpid())
    stale.parent.mkdir()
    stale.write_bytes(b"half")
    identity.claim_output(tmp_path, ident)
    assert json.loads((tmp_path / cf.RUN_FILE).read_text()) == ident
    assert not stale.exists() and (tmp_path / cf.ERRORS_DIR).is_dir()
    identity.claim_output(tmp_path, {"other": 1})  # a rerun keeps the first record
    assert json.loads((tmp_path / cf.RUN_FILE).read_text()) == ident
    identity.check_identity(tmp_path, ident)
    identity.check_identity(tmp_path, {"shard_size": 8})  # a partial identity compares its own fields only


def test_a_cache_built_otherwise_is_refused_naming_the_first_field_and_counting_the_rest(tmp_path):
    identity.claim_output(tmp_path, {"fingerprint": {"a": 1, "b": 2, "c": 3}, "shard_size": 8})
    with pytest.raises(UserError) as e:
        identity.check_identity(tmp_path, {"fingerprint": {"a": 9, "b": 9, "c": 9}, "shard_size": 8})
    msg = str(e.value)
    assert "different fingerprint.a (and 2 more: fingerprint.b, fingerprint.c)" in msg and "\n" not in msg
    with pytest.raises(UserError, match=r"different shard_size: use another output_dir"):
        identity.check_identity(tmp_path, {"fingerprint": {"a": 1, "b": 2, "c": 3}, "shard_size": 4})


def test_shards_without_a_record_or_an_unreadable_record_are_refused(tmp_path):
    (tmp_path / cf.SHARDS).mkdir()
    (tmp_path / cf.SHARDS / "shard-000000.tar").write_bytes(b"")
    with pytest.raises(UserError, match=f"holds shards but no {cf.RUN_FILE}"):
        identity.check_identity(tmp_path, {"shard_size": 8})
    (tmp_path / cf.RUN_FILE).write_text("{not json")
    with pytest.raises(UserError, match=f"{cf.RUN_FILE} is unreadable"):
        identity.check_identity(tmp_path, {"shard_size": 8})
