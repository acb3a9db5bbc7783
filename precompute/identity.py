"""What built an output_dir: the run identity recorded in precompute.json, and the checks that refuse to mix caches."""

from __future__ import annotations

import json
from pathlib import Path

from precompute.config import PrecomputeConfig
from theworld import cache_format as cf
from theworld.cache_format import storage
from theworld.core import atomic
from theworld.core.config import to_dict
from theworld.core.errors import UserError

LLAVA_CONVERSATIONS = "multi-turn"  # llava items of several human/gpt pairs are samples (cache_format.TURNS)


def layout_identity(cfg: PrecomputeConfig) -> dict:
    """What decides which source entries go into which shard, and which members they get (known before listing)."""
    src = to_dict(cfg.source)
    if cfg.source.type == "synthetic":
        src.update(path=None, prompt=None, seed=cfg.seed)
    if cfg.source.type == "urls":  # how fast and where it downloads changes no byte of the cache
        src["staging_dir"] = None
        for key in ("processes_count", "thread_count"):
            src["img2dataset"].pop(key)
    else:  # other sources do not download: their caches' records (older ones too) have no such section
        src.pop("img2dataset")
    if cfg.source.type == "llava":  # the rule that turns items into samples: an older cache kept one turn only
        src["conversations"] = LLAVA_CONVERSATIONS
    return {"source": src, "shard_size": cfg.shard_size, "cache": to_dict(cfg.cache)}


def run_identity(cfg: PrecomputeConfig, fingerprint: dict, num_entries: int) -> dict:
    """Everything that decides which bytes end up in which shard; a resumed run must agree on all of it."""
    return {"fingerprint": fingerprint, **layout_identity(cfg), "num_entries": num_entries}


def check_identity(out: Path, identity: dict) -> None:
    """Refuse an output_dir holding (part of) a cache built otherwise, naming the first field of `identity` (an
    ordered dict, possibly partial) that differs."""
    path = out / cf.RUN_FILE
    if not path.is_file():
        if any((out / cf.SHARDS).glob("*.tar")):
            raise UserError(
                f"output_dir {out} holds shards but no {cf.RUN_FILE}, so what built them is unknown: use "
                "another output_dir or delete it"
            )
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        raise UserError(
            f"output_dir {out}: {cf.RUN_FILE} is unreadable, so what built its shards is unknown: use "
            "another output_dir or delete it"
        ) from None
    diff = [f for key in identity for f in cf.fingerprint_diff({key: old.get(key)}, {key: identity[key]})]
    if diff:
        more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
        raise UserError(
            f"output_dir {out} holds a cache built with a different {diff[0]}{more}: "
            f"use another output_dir or delete it"
        )


def claim_output(out: Path, identity: dict) -> None:
    """Rank 0, once the identity is checked: the folders, no leftovers of a killed run, the identity recorded."""
    (out / cf.SHARDS).mkdir(parents=True, exist_ok=True)
    (out / cf.ERRORS_DIR).mkdir(parents=True, exist_ok=True)
    for folder in (out, out / cf.SHARDS, out / cf.ERRORS_DIR, out / cf.INDEX_DIR):
        atomic.remove_stale(folder, only_dead=False)  # nobody is writing: the listing is over, encoding not started
    if not (out / cf.RUN_FILE).is_file():
        cf.atomic_write_json(out / cf.RUN_FILE, identity)


def claim_remote(remote: storage.RemoteWriter, out: Path) -> None:
    """Rank 0, after claim_output, before any shard is put: the run record goes up as an exclusive create (S3's
    If-None-Match), so of two precomputes started into one prefix at once only one claims it; the other finds a
    record that is not its own and is refused in one line (`check_remote_claim`)."""
    r = remote.remote

    data = (out / cf.RUN_FILE).read_bytes()

    def create() -> None:
        try:
            r.fs.pipe_file(r.path(cf.RUN_FILE), data, mode="create")
        except FileExistsError:
            pass  # a rerun's, or another run's: compared below
        except (NotImplementedError, TypeError, ValueError):  # a store without exclusive creates: put when absent
            if not r.fs.exists(r.path(cf.RUN_FILE)):
                r.fs.pipe_file(r.path(cf.RUN_FILE), data)

    r._call(f"uploading {r.object_url(cf.RUN_FILE)}", create)
    check_remote_claim(remote, out)


def check_remote_claim(remote: storage.RemoteWriter, out: Path) -> None:
    """The run record in the bucket is this run's (checked after the claim and again before the manifest, for a
    store without exclusive creates): another run's is one line naming the first field that differs."""
    r = remote.remote
    theirs = r.read(cf.RUN_FILE)
    ours = json.loads((out / cf.RUN_FILE).read_bytes())
    try:
        theirs = json.loads(theirs) if theirs is not None else None
    except ValueError:
        theirs = {}
    if theirs == ours:
        return
    diff = cf.fingerprint_diff(theirs or {}, ours) or [cf.RUN_FILE]
    raise UserError(
        f"output_dir {r.url}: another precompute claimed it while this one ran (its {cf.RUN_FILE} has a different "
        f"{diff[0]}); two runs must not write one prefix: give this one another output_dir"
    )
