"""Evaluation protocols and baselines: the letter reader against lmms-eval's examples, the exact McNemar test against
known values, each baseline against a hand computation, captions against pycocoevalcap, the command line's outputs
(--json, --out, the model card's table) and its bad inputs, and train.eval.benchmarks under every shipped config."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests._eval_helpers import TWO_ITEMS, blink_folder, hand_scores, write_items
from theworld.embedded import synthetic
from theworld.evaluate import main
from theworld.infer import baselines, benchmark_items, captions, letters, scoring
from theworld.model import images
from theworld.model.config import ImageConfig, ModelConfig, WorldConfig
from theworld.model.inputs import text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import ChatFormatter
from theworld.model.world import TheWorld

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny():
    model, processor = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), image=ImageConfig())
    return model.eval(), processor


# ---------------------------------------------------------------------------------------------------------- letters


# ---------------------------------------------------------------------------------------------------------- stats


def test_unparsed_answers_are_wrong_and_counted_and_uncategorised_items_get_their_own_row(tmp_path):
    items = benchmark_items.read(write_items(tmp_path, TWO_ITEMS))
    recs = scoring.tally(
        items,
        [0, 1],
        [{"model": "(B)", "shuffled_world": "the ball"}, {"model": "no idea", "shuffled_world": "A"}],
        "generate",
    )
    assert [(r["pred"], r["pred_shuffled_world"]) for r in recs] == [(1, None), (None, 0)]
    s = scoring.summarize(recs, [], "generate")
    assert (s["accuracy"], s["accuracy_shuffled_world"], s["unparsed"], s["unparsed_shuffled_world"]) == (
        0.5,
        0.5,
        1,
        1,
    )
    assert s["categories"]["a"]["n"] == 1 and s["categories"][scoring.NO_CATEGORY]["n"] == 1


# ---------------------------------------------------------------------------------------------------------- baselines


def loglik(logits: torch.Tensor, enc, n_extra: int) -> float:
    labels = torch.tensor(enc.labels[:1] + [IGNORE] * n_extra + enc.labels[1:])
    logp = F.log_softmax(logits[:-1].double(), -1)
    keep = labels[1:] != IGNORE
    return float(logp[keep].gather(1, labels[1:][keep][:, None]).sum())


def gemma_alone(model, processor, item) -> list[float]:
    """Gemma 3's own forward (Gemma3ForConditionalGeneration, its image tokens and masks), no world anywhere."""
    fmt = ChatFormatter(processor)
    pv = torch.stack(
        [images.siglip_pixels(processor.image_processor, images.decode(Path(p).read_bytes())) for p in item.images]
    )
    out = []
    for choice in item.choices:
        enc = fmt.encode(item.question, choice, images=len(item.images))
        batch = text_batch([enc], fmt.pad_id)
        with torch.no_grad():
            logits = model.gemma(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                pixel_values=pv,
                token_type_ids=(batch.input_ids == model.image_token_id).long(),
            ).logits[0]
        out.append(loglik(logits, enc, 0))
    return out


def with_latents(model, processor, item, mean: torch.Tensor) -> list[float]:
    fmt = ChatFormatter(processor)
    pv = torch.stack(
        [images.siglip_pixels(processor.image_processor, images.decode(Path(p).read_bytes())) for p in item.images]
    )
    out = []
    for choice in item.choices:
        enc = fmt.encode(item.question, choice, images=len(item.images))
        with torch.no_grad():
            batch = text_batch(
                [enc], fmt.pad_id, latent_mean=mean, latent_logvar=torch.zeros_like(mean), pixel_values=pv
            )
            logits = model(batch, return_logits=True).logits[0]
        out.append(loglik(logits, enc, logits.shape[0] - len(enc.input_ids)))
    return out


def test_each_baseline_agrees_with_a_hand_computation_on_a_two_item_file(tiny, tmp_path):
    model, processor = tiny
    items = benchmark_items.read(write_items(tmp_path, TWO_ITEMS))
    init = baselines.InitProjector(model, WorldConfig(), seed=0)  # the tiny fixture is itself seed 0's start
    trained = {k: v.clone() for k, v in model.projector.state_dict().items()}
    with torch.no_grad():  # "train" the projector: the model now differs from its initialisation
        for p in model.projector.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        moved = {k: v.clone() for k, v in model.projector.state_dict().items()}
        conds = baselines.conditions(baselines.parse("all"))
        assert [c.name for c in conds] == ["model", "shuffled_world", "no_world", "constant_latent", "init_projector"]
        rng = torch.get_rng_state()
        scores = scoring.Scorer(model, processor, ImageConfig(), items, init).score([0, 1], conds)
        assert torch.equal(torch.get_rng_state(), rng)  # building the initial projector leaves the RNG alone
        assert all(torch.equal(v, moved[k]) for k, v in model.projector.state_dict().items())  # swapped back
        pixels = images.to_uint8_tensor(images.resize(images.decode(Path(items[0].images[0]).read_bytes()), 64)[0])
        latent = model.world_latents(pixels[None], None, None)[0]  # (1, C, T=1, h, w)
        const = model.projector.latents_mean.flatten()[None, :, None, None, None].expand_as(latent)
        fresh, _ = TheWorld.from_config(ModelConfig(dtype="float32"), WorldConfig(), seed=0)
        for i, s in enumerate(scores):
            assert s["model"] == pytest.approx(hand_scores(model, processor, items[i], items[i].images[0]), abs=1e-4)
            other = items[(i - 1) % 2].images[0]
            assert s["shuffled_world"] == pytest.approx(hand_scores(model, processor, items[i], other), abs=1e-4)
            assert s["no_world"] == pytest.approx(gemma_alone(model, processor, items[i]), abs=1e-4)
            assert s["constant_latent"] == pytest.approx(with_latents(model, processor, items[i], const), abs=1e-4)
            assert s["init_projector"] == pytest.approx(
                hand_scores(fresh.eval(), processor, items[i], items[i].images[0]), abs=1e-4
            )
            assert len({tuple(v) for v in s.values()}) == 5  # five different columns
    finally:
        model.projector.load_state_dict(trained)


def test_the_generate_protocol_answers_as_model_generate_and_gemma_generate_do(tiny, tmp_path):
    model, processor = tiny
    items = benchmark_items.read(write_items(tmp_path, [{**TWO_ITEMS[0], "image": f"{i}.png"} for i in range(3)]))
    conds = baselines.conditions(["no_world"])
    out = scoring.Scorer(model, processor, ImageConfig(), items, max_new_tokens=6).answer([0, 1, 2], conds)
    prompts = [letters.mc_prompt(it.question, it.choices) for it in items]
    paths = [it.images[0] for it in items]
    assert [o["model"] for o in out] == model.generate(paths, prompts, max_new_tokens=6)
    assert [o["shuffled_world"] for o in out] == model.generate(
        paths, prompts, max_new_tokens=6, world_images=paths[-1:] + paths[:-1]
    )
    fmt, tok = ChatFormatter(processor), processor.tokenizer
    for o, item, prompt in zip(out, items, prompts):  # no world: Gemma 3's own greedy generate
        ids = torch.tensor([fmt.prefix(prompt)])
        pv = images.siglip_pixels(processor.image_processor, images.decode(Path(item.images[0]).read_bytes()))[None]
        with torch.no_grad():
            new = model.gemma.generate(
                input_ids=ids,
                pixel_values=pv,
                max_new_tokens=6,
                do_sample=False,
                token_type_ids=(ids == model.image_token_id).long(),
            )[0, ids.shape[1] :].tolist()
        stops = scoring.stop_ids(model)
        new = new[: next((k for k, t in enumerate(new) if t in stops), len(new))]
        assert o["no_world"] == tok.decode(new, skip_special_tokens=True).strip()


# ---------------------------------------------------------------------------------------------------------- captions


def test_caption_metrics_are_pycocoevalcaps_on_the_plain_tokenisation():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    refs = [["top left red square .", "A red square, top left!"], ["bottom right blue circle ."]]
    hyps = ["top left red circle .", "Bottom right blue circle"]
    got = captions.scores(refs, hyps)
    gts = {0: ["top left red square", "a red square top left"], 1: ["bottom right blue circle"]}
    res = {0: ["top left red circle"], 1: ["bottom right blue circle"]}
    assert got["bleu4"] == Bleu(4).compute_score(gts, res, verbose=0)[0][3]
    assert got["rouge_l"] == Rouge().compute_score(gts, res)[0]
    assert got["cider"] == Cider().compute_score(gts, res)[0]
    assert 0 < got["bleu4"] < 1 and 0 < got["rouge_l"] < 1 and got["cider"] > 0
    exact = captions.scores(refs, ["top left red square", "bottom right blue circle ."])
    assert exact["bleu4"] == pytest.approx(1.0) and exact["rouge_l"] == pytest.approx(1.0)


def caption_file(root: Path, n: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        img, caption = synthetic.scene(5, i)
        img.save(root / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "captions": [caption, caption.upper()]}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    return root / "captions.jsonl"


# ---------------------------------------------------------------------------------------------------------- the CLI


def test_the_cli_json_out_and_model_card_on_a_trained_run(trained_run, run_copy, tmp_path, capsys):
    out = tmp_path / "items.out.jsonl"
    argv = [
        "--model",
        str(run_copy),
        "--data",
        str(trained_run["mc"]),
        "--json",
        "--baselines",
        "all",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 6 and res["protocol"] == "loglik" and set(res["baselines"]) == set(baselines.BASELINES)
    for b in res["baselines"].values():
        assert {"accuracy", "accuracy_ci95", "difference", "p_value"} <= b.keys() and 0 <= b["p_value"] <= 1
    assert res["baselines"]["shuffled_world"]["accuracy"] == res["accuracy_shuffled_world"]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6 and {"item", "answer", "pred", "outputs"} <= lines[0].keys()
    assert set(lines[0]["outputs"]) == {"model", *baselines.BASELINES} and len(lines[0]["outputs"]["model"]) == 4
    assert sum(r["pred"] == r["answer"] for r in lines) / 6 == res["accuracy"]
    gen_out = tmp_path / "generate.out.jsonl"
    assert main(argv[:4] + ["--protocol", "generate", "--json", "--max-new-tokens", "3", "--out", str(gen_out)]) == 0
    gen = json.loads(capsys.readouterr().out)
    answers = [json.loads(x) for x in gen_out.read_text().splitlines()]
    # the 4-step tiny model answers "" or "." runs, never a letter: every answer is unparsed, and so wrong
    assert all(re.fullmatch(r"[.\s]*", a) for r in answers for a in r["outputs"].values()), answers
    assert [(r["pred"], r["pred_shuffled_world"]) for r in answers] == [(None, None)] * 6
    assert (gen["protocol"], gen["unparsed"], gen["unparsed_shuffled_world"], gen["accuracy"]) == ("generate", 6, 6, 0)
    card = (run_copy / "final" / "README.md").read_text()
    table = card[card.index("## Evaluation results") :].splitlines()
    rows = [r for r in table if r.startswith("| items.jsonl")]
    assert len(rows) == 2 and "| loglik | 6 |" in rows[0] and "| generate | 6 |" in rows[1]
    assert f"{res['accuracy']:.4f}" in rows[0] and "no_world" in rows[0] and "--baselines all" in rows[0]
    assert main(argv[:4] + ["--json"]) == 0  # the same benchmark and protocol again: its row is replaced
    capsys.readouterr()
    again = (run_copy / "final" / "README.md").read_text()
    assert len([r for r in again.splitlines() if r.startswith("| items.jsonl")]) == 2
    assert again.startswith(card[: card.index("## Evaluation results")])  # the card above the table is kept


def test_the_caption_task_on_a_trained_run(trained_run, run_copy, tmp_path, capsys):
    data = caption_file(tmp_path)
    assert (
        main(
            [
                "--model",
                str(run_copy),
                "--data",
                str(data),
                "--task",
                "caption",
                "--json",
                "--max-new-tokens",
                "8",
                "--out",
                str(tmp_path / "c.jsonl"),
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 3
    recs = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    for suffix, cond in (("", "model"), ("_shuffled_world", "shuffled_world")):
        expected = captions.scores([r["references"] for r in recs], [r["outputs"][cond] for r in recs])
        assert {k + suffix: res[k + suffix] for k in captions.METRICS} == {k + suffix: v for k, v in expected.items()}


# ---------------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("key", ["categry", "answers"])
def test_an_unknown_key_is_one_line_naming_the_key_and_the_item(tmp_path, capsys, key):
    good = {"image": "0.png", "question": "q", "choices": ["a", "b"], "answer": 0}
    path = write_items(tmp_path, [good, {**good, key: "x"}])
    assert main(["--model", str(tmp_path), "--data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2" in err and repr(key) in err


def test_a_caption_file_with_an_unknown_key_or_no_captions_is_one_line(tmp_path, capsys):
    data = caption_file(tmp_path, 1)
    data.write_text(data.read_text() + json.dumps({"image": "0.png", "caption": "x"}) + "\n")
    assert main(["--model", str(tmp_path), "--data", str(data), "--task", "caption"]) == 2
    data.write_text(json.dumps({"image": "0.png", "captions": []}) + "\n")
    assert main(["--model", str(tmp_path), "--data", str(data), "--task", "caption"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and f"{data}:2" in err[0] and "'caption'" in err[0] and "field 'captions'" in err[1]


def test_a_blink_folder_with_val_and_test_files_is_read_by_split(tmp_path, capsys):
    import shutil

    folder = blink_folder(tmp_path / "blink")
    val = folder / "Counting" / "val-00000-of-00001.parquet"
    shutil.copy(val, folder / "Counting" / "test-00000-of-00001.parquet")
    assert len(benchmark_items.read(folder)) == 2 and len(benchmark_items.read(folder, "test")) == 2
    assert main(["--model", str(tmp_path), "--data", str(folder), "--split", "train"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'train'" in err and "test, val" in err


def test_a_refused_blink_row_names_the_sub_task_folder_and_file(tmp_path, capsys):
    folder = blink_folder(tmp_path / "blink", answer="(D)")
    assert main(["--model", str(tmp_path), "--data", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Counting/val-00000-of-00001.parquet:idx val_Counting_2" in err


def test_an_unknown_baseline_is_one_line(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--data", "x.jsonl", "--baselines", "no_world,gemma"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'gemma'" in err and "init_projector" in err


# ---------------------------------------------------------------------------------------------------------- training

SHIPPED = sorted((ROOT / "configs").glob("stage*.yaml")) + sorted((ROOT / "configs" / "real").glob("stage*.yaml"))


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_train_benchmarks_run_under_every_shipped_config(config, tiny, tmp_path):
    """The config as shipped (micro_batch_size: auto), with a benchmark added; the model is the tiny one, fed at its
    image size, since the real configs' models are not here."""
    from accelerate import Accelerator

    from train.config import TrainConfig, load_config, resolve_micro_batch
    from train.eval.benchmarks import BenchmarkEval, lines

    mc = tmp_path / "mc" / "items.jsonl"
    benchmark_items.make_synthetic(mc, 3)
    cfg = load_config(TrainConfig, config, [f"train.eval.benchmarks=[{{path: {mc}, baselines: [no_world]}}]"])
    bench = BenchmarkEval.load(cfg)  # before the micro batch is resolved, as train.loop does
    resolve_micro_batch(cfg, 1)
    cfg.image = ImageConfig()
    model, processor = tiny
    components = SimpleNamespace(
        raw=model, processor=processor, cfg=cfg, accelerator=Accelerator(cpu=True), rank=0, world_size=1
    )
    results = bench.run(components)
    assert results["bench/items/n"] == 3 and 0 <= results["bench/items/no_world/p_value"] <= 1
    assert lines(results)[0].startswith("benchmark items: n 3, accuracy ")


# ---------------------------------------------------------------------------------------------------------- describe


def test_describe_uses_the_prompt_the_run_trained_with(trained_run, tmp_path, capsys):
    from theworld import describe

    final = trained_run["run"] / "final"
    assert (final / "prompt.txt").read_text() == synthetic.PROMPT + "\n"  # the synthetic cache's prompt
    assert f'model.generate(["image.png"], "{synthetic.PROMPT}")' in (final / "README.md").read_text()
    img = tmp_path / "a.png"
    synthetic.scene(9, 0)[0].save(img)
    common = ["--model", str(trained_run["run"]), "--image", str(img), str(img), "--max-new-tokens", "6"]
    assert describe.main(common) == 0
    default = capsys.readouterr().out
    assert describe.main(common + ["--prompt", synthetic.PROMPT]) == 0
    assert capsys.readouterr().out == default


def test_generated_text_never_ends_in_a_broken_character(tiny):
    from theworld.infer.generate import decode_text

    tok = tiny[1].tokenizer
    ids = tok("é東", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut inside 東's bytes
    assert decode_text(tok, ids[:-1]) == "é" and decode_text(tok, ids[:-2]) == "é" and decode_text(tok, ids) == "é東"


def test_the_synthetic_set_writes_its_captions_beside_it(tmp_path):
    records = benchmark_items.make_synthetic(tmp_path / "items.jsonl", 4)
    items = captions.read(tmp_path / benchmark_items.CAPTIONS)
    assert [it.captions for it in items] == [[r["choices"][r["answer"]]] for r in records]
    assert [it.images[0].name for it in items] == [Path(r["image"]).name for r in records]


def test_captions_on_a_caches_held_out_split_are_the_trainers_eval_samples(trained_run, run_copy, tmp_path, capsys):
    from theworld import cache_format as cf
    from theworld.cache_format.held_out import split

    out = tmp_path / "c.jsonl"
    argv = [
        "--model",
        str(run_copy),
        "--data",
        str(trained_run["cache"]),
        "--task",
        "caption",
        "--json",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 8  # the run's train.eval.samples
    reader = cf.CacheReader(trained_run["cache"])
    held = split(reader, 8)[1]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["item"].rsplit(":", 1)[1] for r in recs] == [reader.key(i) for i in held.tolist()]
    assert [r["references"] for r in recs] == [[reader.sample(i, tensors=False).caption] for i in held.tolist()]
    assert {r["prompt"] for r in recs} == {synthetic.PROMPT}
    assert main(argv[:6] + ["--split", "train"]) == 2
    assert "one held-out split" in capsys.readouterr().err


@pytest.mark.parametrize(
    "entry,words",
    [
        ("{path: a.jsonl, baselines: [gemma]}", "'gemma'"),
        ("{path: a.jsonl, protocol: greedy}", "protocol"),
        ("{path: a.jsonl, baseline: [all]}", "baseline"),
    ],
)
def test_a_bad_benchmark_entry_is_one_line_naming_it(entry, words):
    from theworld.core.errors import UserError
    from train.config import TrainConfig, load_config

    with pytest.raises(UserError, match=words):
        load_config(TrainConfig, ROOT / "configs" / "stage1.yaml", [f"train.eval.benchmarks=[{entry}]"])
