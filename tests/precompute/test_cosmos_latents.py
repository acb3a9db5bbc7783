"""python -m precompute.cosmos_latents, the command: its config is checked before torch loads, and what a user gets
wrong is one line and exit 2 (the run itself: tests/precompute/test_pipeline.py)."""

from __future__ import annotations

import yaml

from precompute import cosmos_latents
from tests._precompute_helpers import cli_args
from tests.conftest import main_in_a_fresh_interpreter


def test_a_config_mistake_is_refused_before_torch_and_the_encoders_are_imported(tmp_path):
    """Each process of a launch refuses a mistaken key at once, not after ~10 s of imports."""
    args = ["--config", "configs/precompute.yaml", "--set", f"output_dir={tmp_path / 'c'}", "--set", "shard_size=many"]
    code, heavy, err = main_in_a_fresh_interpreter("precompute.cosmos_latents", args)
    assert (code, heavy) == (2, []), err
    assert len(err.strip().splitlines()) == 1 and "shard_size" in err
    assert not (tmp_path / "c").exists()


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "c"
    assert cosmos_latents.main([*cli_args(out, n=7), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["source"]["num_samples"] == 7 and printed["output_dir"] == str(out)
    assert not out.exists()


def test_user_errors_exit_2(tmp_path, capsys, fake_vae):
    assert cosmos_latents.main(["--set", "shard_sise=3"]) == 2
    assert "shard_sise" in capsys.readouterr().err
    assert cosmos_latents.main(["--set", "source.type=folder", "--set", f"source.path={tmp_path}/nope"]) == 2
    assert "source.path" in capsys.readouterr().err
    out = tmp_path / "c"
    assert cosmos_latents.main(cli_args(out, n=4)) == 0
    capsys.readouterr()
    # Resuming into the same directory with different numbers is refused, naming the field.
    assert cosmos_latents.main(cli_args(out, "image.resize=squash", n=4)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fingerprint.image.resize" in err
    # another source into the same directory: refused before the source is listed or a model loaded
    wds_dir = tmp_path / "wds"
    wds_dir.mkdir()
    (wds_dir / "00000.tar").write_bytes(b"")
    assert cosmos_latents.main(cli_args(out, "source.type=webdataset", f"source.path={wds_dir}/00000.tar")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "source." in err.split("different ")[1].split(" ")[0], err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".run.lock", "errors", "errors.jsonl", "manifest.json", "precompute.json", "shard-index", "shards"]
    )
    # an output_dir that is a file, a --set value that is not YAML
    (tmp_path / "afile").write_text("x")
    assert cosmos_latents.main(cli_args(tmp_path / "afile", n=4)) == 2
    assert "output_dir" in capsys.readouterr().err
    assert cosmos_latents.main(["--set", "seed=[1"]) == 2
    assert "--set seed" in capsys.readouterr().err
    # shards whose config is unknown
    (out / "precompute.json").write_text("{torn")
    assert cosmos_latents.main(cli_args(out, n=4)) == 2
    assert "precompute.json is unreadable" in capsys.readouterr().err
