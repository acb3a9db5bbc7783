"""hub.history: every checkpoint uploaded whole (optimizer, RNG and state.json too) into its own checkpoint-N/ folder
of the repo, each one kept, against a local stand-in of the Hub's write API (tests/theworld/core/test_hub.py)."""

from __future__ import annotations

from tests.theworld.core.test_hub import REPO, LocalHub, checkpoint_like


def test_history_keeps_each_checkpoint_whole_in_its_own_folder(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    from train.state.hub_upload import HubUploader

    server = LocalHub()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_test")
    warnings = []
    up = HubUploader(REPO, True, warnings.append, history=True)
    try:
        for step in (2, 4):  # submitted back to back: with history the second never supersedes the first
            ckpt = checkpoint_like(tmp_path / f"checkpoint-{step}")
            (ckpt / "optimizer.pt").write_bytes(b"adam %d" % step)
            up.submit(ckpt, ckpt.name, ckpt.name)
        assert up.wait(60)
    finally:
        server.shutdown()
        server.server_close()
    assert not warnings
    assert [message for message, _ in server.commits] == ["checkpoint-2", "checkpoint-4"]
    for message, files in server.commits:
        names = ("config.yaml", "optimizer.pt", "rng.safetensors", "state.json", "trainable.safetensors")
        assert set(files) == {f"{message}/{n}" for n in names}
        assert files[f"{message}/optimizer.pt"] == (tmp_path / message / "optimizer.pt").read_bytes()
