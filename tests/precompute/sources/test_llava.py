"""precompute/sources/llava.py: LLaVA-pretrain chat.json (single and multi-turn items). Moved from
tests/test_sources.py."""

from __future__ import annotations

import json

import pytest

from precompute import cosmos_latents, pipeline
from tests._precompute_helpers import gradient, jpeg_bytes, make_cfg, read_cache_plain
from tests._source_helpers import chat_item, listing_of
from theworld import cache_format as cf
from theworld.core.errors import UserError


def test_llava_chat_json(tmp_path, fake_vae):
    """LLaVA-CC3M-Pretrain-595K: chat.json beside images/ (the extracted images.zip); LLaVA-Instruct's multi-turn
    conversations keep every turn."""
    root = tmp_path / "LLaVA-CC3M-Pretrain-595K"
    (root / "images").mkdir(parents=True)
    for i in (0, 1, 2, 3, 6, 7):  # not 5: an item whose image is missing
        (root / "images" / f"GCC_train_{i:09d}.jpg").write_bytes(jpeg_bytes(gradient(30 + i, 24)))
    items = [
        chat_item(0),
        chat_item(1, human="<image>\nWhat is in the photo?"),
        chat_item(2),
        chat_item(3),
        {"id": "text-only", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        chat_item(5),
        chat_item(6),
        chat_item(7),
    ]
    items[2]["conversations"] += [{"from": "human", "value": " more?"}, {"from": "gpt", "value": "no "}]
    items[2]["conversations"][0]["value"] = "Look: <image> what is it?"
    items[6]["conversations"] += [{"from": "human", "value": "<image>\nand?"}, {"from": "gpt", "value": "no"}]
    items[7]["conversations"] += [{"from": "human", "value": "and?"}]
    (root / "chat.json").write_text(json.dumps(items, indent=2))
    out = tmp_path / "c"
    result = pipeline.run(
        make_cfg(
            out,
            "source.type=llava",
            f"source.path={root}/chat.json",
            f"source.image_root={root}/images",
            "num_workers=1",
        )
    )
    samples = read_cache_plain(out)
    assert list(samples) == [f"GCC_train_{i:09d}" for i in range(4)]
    s1 = samples["GCC_train_000000001"]
    assert s1["txt"] == b"a caption 1 ." and json.loads(s1["json"])["prompt"] == "What is in the photo?"
    assert (
        json.loads(samples["GCC_train_000000000"]["json"])["prompt"]
        == "Provide a brief description of the given image."
    )
    assert cf.TURNS not in json.loads(s1["json"])
    reader = cf.CacheReader(out)
    conv = reader.sample(reader.keys().index("GCC_train_000000002"), tensors=False)
    assert conv.turns == [("Look: what is it?", "a caption 2 ."), ("more?", "no")]
    assert reader.sample(reader.keys().index("GCC_train_000000001"), tensors=False).turns == [
        ("What is in the photo?", "a caption 1 .")
    ]
    reasons = {e["key"]: e["reason"] for e in cf.read_errors(out)}
    assert reasons == {
        "text-only": "bad item: no 'image' (a text-only item)",
        "GCC_train_000000006": "bad item: <image> outside the first human turn (a sample has one image, in its "
        "first turn)",
        "GCC_train_000000007": "bad item: conversation does not alternate human, gpt turns (starting with human, "
        "ending with gpt)",
        "GCC_train_000000005": reasons["GCC_train_000000005"],
    }
    assert reasons["GCC_train_000000005"].startswith("cannot read: FileNotFoundError")
    assert result["num_errors"] == 4
    # image_root defaults to the JSON's folder; a chat.json that changed is refused on resume
    (root / "images" / "chat.json").write_text(json.dumps([chat_item(3)]))
    listing = listing_of("llava", root / "images" / "chat.json", tmp_path / "l2")
    assert listing.load(listing.entries(0, 1)[0]).caption == "a caption 3 ."
    (root / "chat.json").write_text(json.dumps(items[:2]))
    with pytest.raises(UserError, match="chat.json changed since"):
        pipeline.run(
            make_cfg(out, "source.type=llava", f"source.path={root}/chat.json", f"source.image_root={root}/images")
        )


def test_llava_cache_of_single_turn_items_is_not_resumed(tmp_path, fake_vae):
    """A llava cache started before conversations were kept (its precompute.json lacks the rule) is refused, not
    completed with samples built another way."""
    (tmp_path / "GCC_train_000000000.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
    (tmp_path / "chat.json").write_text(json.dumps([chat_item(0)]))
    out = tmp_path / "c"
    args = (out, "source.type=llava", f"source.path={tmp_path}/chat.json", "num_workers=1")
    pipeline.run(make_cfg(*args))
    run_file = json.loads((out / cf.RUN_FILE).read_text())
    del run_file["source"]["conversations"]
    (out / cf.RUN_FILE).write_text(json.dumps(run_file))
    with pytest.raises(UserError, match="source.conversations"):
        pipeline.run(make_cfg(*args))


def test_llava_images_found_nowhere_say_where_they_were_looked_for_and_which_image_root_finds_them(
    tmp_path, capsys, fake_vae
):
    import json

    from tests._precompute_helpers import cli_args, gradient, jpeg_bytes

    root = tmp_path / "LLaVA-Pretrain"
    (root / "images" / "00000").mkdir(parents=True)
    items = []
    for i in range(3):
        (root / "images" / "00000" / f"{i:09d}.jpg").write_bytes(jpeg_bytes(gradient(30, 24)))
        items.append(
            {
                "id": f"{i:09d}",
                "image": f"00000/{i:09d}.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>\nDescribe."},
                    {"from": "gpt", "value": f"caption {i}"},
                ],
            }
        )
    (root / "blip_laion_cc_sbu_558k.json").write_text(json.dumps(items))
    src = f"source.path={root / 'blip_laion_cc_sbu_558k.json'}"
    assert cosmos_latents.main(cli_args(tmp_path / "c", "source.type=llava", src, n=3)) == 2
    err = capsys.readouterr().err
    assert "all 3 inputs failed" in err and f"'00000/000000000.jpg' are looked for under {root};" in err
    assert f"set source.image_root={root / 'images'}" in err, err
    assert (
        cosmos_latents.main(cli_args(tmp_path / "c2", "source.type=llava", src, f"source.image_root={root}", n=3)) == 2
    )
    assert f"set source.image_root={root / 'images'}" in capsys.readouterr().err  # also from a wrong image_root
