"""VAE loading and preprocessing: [-1, 1] input, frame axis, posterior mean and logvar."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from theworld.core.errors import UserError
from theworld.embedded import synthetic
from theworld.model import encoders, images


def test_world_encoder_matches_direct_autoencoder_encode():
    from diffusers import AutoencoderKLWan

    path, _ = encoders.resolve_vae("tiny")
    direct = AutoencoderKLWan.from_pretrained(path).eval()
    enc = encoders.WorldEncoder(encoders.load_vae("tiny", "float32"))
    pixels = torch.stack([images.to_uint8_tensor(synthetic.scene(7, i)[0]) for i in range(2)])
    x = (pixels.float() / 255.0) * 2.0 - 1.0  # [-1, 1], the range the VAE was trained on
    with torch.no_grad():
        dist = direct.encode(x.unsqueeze(2)).latent_dist
        mean, logvar = enc(pixels)
    assert mean.shape == (2, 16, 1, 8, 8) and logvar.shape == mean.shape
    assert torch.allclose(mean, dist.mean, atol=1e-6) and torch.allclose(logvar, dist.logvar, atol=1e-6)
    assert not mean.requires_grad  # frozen -> no graph


def test_single_frame_convs_are_the_same_function_with_the_same_gradients():
    from diffusers import AutoencoderKLWan

    path, _ = encoders.resolve_vae("tiny")
    stock = AutoencoderKLWan.from_pretrained(path)
    fast = AutoencoderKLWan.from_pretrained(path)
    assert encoders.use_single_frame_convs(fast) > 10
    assert fast.state_dict().keys() == stock.state_dict().keys()
    g = torch.Generator().manual_seed(0)
    image = torch.rand(2, 3, 1, 32, 32, generator=g) * 2 - 1
    video = torch.rand(1, 3, 5, 32, 32, generator=g) * 2 - 1  # frames after the first take the stock path (cache)
    for x in (image, video):
        outs = []
        for vae in (stock, fast):
            vae.zero_grad()
            mean = vae.encode(x).latent_dist.mean
            mean.square().sum().backward()
            w = vae.encoder.conv_in.weight.grad.clone()
            outs.append((mean.detach(), w))
        assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5)
        assert torch.allclose(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-4)
    # a 1-frame image only reaches the last time tap, so the other taps get exactly zero gradient either way
    vae = fast
    vae.zero_grad()
    vae.encode(image).latent_dist.mean.sum().backward()
    assert vae.encoder.conv_in.weight.grad[:, :, :-1].abs().max() == 0


def test_vae_folder_or_pipeline_folder_or_hub_id(tmp_path):
    path, sub = encoders.resolve_vae("tiny")
    assert sub is None
    vae = encoders.load_vae(path, "float32")
    vae.save_pretrained(tmp_path / "pipeline" / "vae")
    assert encoders.resolve_vae(str(tmp_path / "pipeline")) == (str(tmp_path / "pipeline"), "vae")
    again = encoders.load_vae(str(tmp_path / "pipeline"), "float32")
    assert encoders.weights_hash(again) == encoders.weights_hash(vae)
    assert encoders.resolve_vae("nvidia/Cosmos-Predict2-2B-Video2World") == (
        "nvidia/Cosmos-Predict2-2B-Video2World",
        "vae",
    )
    with pytest.raises(UserError, match="model.vae"):  # offline: a clear one-line error, no traceback
        encoders.load_vae("nobody/no-such-model", "float32")
    # a revision goes to from_pretrained as its own keyword, never inside the repo id
    assert encoders.resolve_vae("nvidia/Cosmos-Predict2-2B-Video2World@v1") == (
        "nvidia/Cosmos-Predict2-2B-Video2World",
        "vae",
    )
    assert encoders.pretrained("user/gemma@refs/pr/1", "unused") == ("user/gemma", {"revision": "refs/pr/1"})
    assert encoders.pretrained("user/gemma", "unused") == ("user/gemma", {})


def test_crop_and_squash():
    img = Image.new("RGB", (200, 100), (0, 0, 0))
    img.paste((255, 0, 0), (50, 0, 150, 100))  # the centre square is red
    out, box = images.resize(img, 32, "crop")
    assert box == (50, 0, 150, 100) and out.size == (32, 32)
    assert np.asarray(out)[:, 2:-2, 0].min() > 250 and np.asarray(out)[..., 1].max() < 10  # only red kept
    out, box = images.resize(img, 32, "squash")
    assert box == (0, 0, 200, 100) and np.asarray(out)[:, 0, 0].max() < 20  # the black borders survive


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def test_unusual_images_are_converted():
    rgb = Image.new("RGB", (40, 20), (10, 200, 30))
    cases = {
        "cmyk": _encode(rgb.convert("CMYK"), "JPEG"),
        "rgba": _encode(Image.new("RGBA", (40, 20), (10, 200, 30, 255)), "PNG"),
        "palette": _encode(rgb.convert("P"), "PNG"),
        "gray": _encode(rgb.convert("L"), "PNG"),
        "16bit": _encode(Image.fromarray(np.full((20, 40), 40000, dtype=np.uint16)), "PNG"),
    }
    for name, data in cases.items():
        t, meta = images.load_for_vae(data, 16)
        assert t.shape == (3, 16, 16) and t.dtype == torch.uint8, name
        assert meta["original_size"] == [40, 20] and meta["crop_box"] == [10, 0, 30, 20], name
    sixteen, _ = images.load_for_vae(cases["16bit"], 16)
    assert abs(int(sixteen[0, 0, 0]) - round(40000 / 65535 * 255)) <= 1  # scaled, not clipped at 255
    # EXIF orientation 6 (rotate 90): a 40x20 file is a 20x40 picture
    exif = Image.Exif()
    exif[0x0112] = 6
    t, meta = images.load_for_vae(_encode(rgb, "JPEG", exif=exif), 16)
    assert meta["original_size"] == [20, 40]


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "empty"),
        (b"not an image at all", "unreadable"),
        (_encode(Image.new("RGB", (64, 64)), "PNG")[:60], "unreadable"),
    ],
)
def test_bad_images_raise_with_a_reason(data, reason):
    with pytest.raises(images.BadImage, match=reason):
        images.load_for_vae(data, 16)


def test_decompression_bomb_is_refused():
    data = _encode(Image.new("L", (4000, 4000)), "PNG")
    with pytest.raises(images.BadImage, match="oversized"):
        images.decode(data, max_pixels=1_000_000)


def test_large_jpeg_uses_draft_decoding_without_changing_the_crop_box():
    big = Image.new("RGB", (1600, 1200), (120, 30, 200))
    t, meta = images.load_for_vae(_encode(big, "JPEG"), 64)
    assert t.shape == (3, 64, 64) and meta["crop_box"] == [200, 0, 1400, 1200]
    img = images.decode(_encode(big, "JPEG"), draft_size=64)
    assert img.size[0] < 1600 and min(img.size) >= 64  # decoded at a reduced scale, never below the target


def test_offline_with_a_hub_id_not_in_the_local_cache_says_exactly_that(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    for load, spec, key in [
        (encoders.load_gemma, "google/gemma-3-4b-it", "model.gemma"),
        (encoders.load_vae, "nvidia/Cosmos-Predict2-2B-Video2World", "model.vae"),
    ]:
        with pytest.raises(UserError) as e:
            load(spec, "float32")
        msg = str(e.value)
        assert msg.startswith(f"{key}: '{spec}' is not in the local Hugging Face cache") and "HF_HUB_OFFLINE" in msg
        assert "config.json" not in msg and "\n" not in msg
        assert f"({encoders.hub_download_command()} download {spec})" in msg
    with pytest.raises(UserError, match="is not a folder here"):
        encoders.load_vae(str(tmp_path / "no" / "such" / "vae"), "float32")
    with pytest.raises(UserError, match=r"'gemma3' is not a folder here \(nor a hub id"):  # neither: said at once
        encoders.load_gemma("gemma3", "float32")


def test_the_download_advice_names_the_command_the_installed_huggingface_hub_has(monkeypatch):
    import importlib.metadata as md
    import shutil

    real = md.distribution("huggingface_hub")
    scripts = {e.name for e in real.entry_points if e.group == "console_scripts"}
    assert encoders.hub_download_command() == ("hf" if "hf" in scripts else "huggingface-cli")
    if shutil.which("hf") or shutil.which("huggingface-cli"):  # the venv's bin is on PATH: it is that one
        assert shutil.which(encoders.hub_download_command())

    class Old:  # huggingface_hub before 0.34: only huggingface-cli
        entry_points = [md.EntryPoint("huggingface-cli", "huggingface_hub.commands:main", "console_scripts")]

    monkeypatch.setattr(md, "distribution", lambda name: Old())
    assert encoders.hub_download_command() == "huggingface-cli"
