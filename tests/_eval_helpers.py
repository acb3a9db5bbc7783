"""Multiple-choice fixtures shared by tests/theworld/test_evaluate.py and tests/theworld/infer/test_scoring.py: item
files, a BLINK-layout
folder, and the scores computed by hand (each choice alone, full logits)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from theworld.embedded import synthetic
from theworld.infer import benchmark_items
from theworld.model import images
from theworld.model.inputs import text_batch
from theworld.model.objective import IGNORE
from theworld.model.text import ChatFormatter


def write_items(root: Path, records: list[dict], n_images: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_images):
        synthetic.scene(11, i)[0].save(root / f"{i}.png")
    path = root / "items.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


TWO_ITEMS = [
    {
        "image": "0.png",
        "question": "describe the scene .",
        "choices": ["top left red circle .", "left", "bottom right"],
        "answer": "(B)",
        "category": "a",
    },
    {"image": ["1.png", "2.png"], "question": "left right", "choices": ["red square .", "blue"], "answer": 0},
]


def hand_scores(model, processor, item: benchmark_items.Item, world_image) -> list[float]:
    """Each choice on its own: full logits of the sequence, log-softmax, summed over the answer tokens."""
    fmt = ChatFormatter(processor)
    world = images.to_uint8_tensor(images.resize(images.decode(Path(world_image).read_bytes()), 64)[0])[None]
    pv = torch.stack(
        [images.siglip_pixels(processor.image_processor, images.decode(Path(p).read_bytes())) for p in item.images]
    )
    out = []
    for choice in item.choices:
        enc = fmt.encode(item.question, choice, images=len(item.images))
        batch = text_batch([enc], fmt.pad_id, images=world, pixel_values=pv)
        with torch.no_grad():
            logits = model(batch, return_logits=True).logits[0]
        n_world = logits.shape[0] - len(enc.input_ids)
        labels = torch.tensor(enc.labels[:1] + [IGNORE] * n_world + enc.labels[1:])
        logp = F.log_softmax(logits[:-1].double(), -1)
        keep = labels[1:] != IGNORE
        out.append(float(logp[keep].gather(1, labels[1:][keep][:, None]).sum()))
    return out


def blink_folder(root: Path, answer: str = "(B)", image_1=True) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    png = images.to_bytes(synthetic.scene(11, 0)[0])
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = {
        "idx": ["val_Counting_1", "val_Counting_2"],
        "sub_task": ["Counting", "Jigsaw"],
        "question": ["how many?", "which piece?"],
        "choices": [["1", "2", "3"], ["(A)", "(B)"]],
        "answer": ["(C)", answer],
        "image_1": pa.array(
            [{"bytes": png, "path": "a.png"}, {"bytes": png if image_1 else None, "path": "b"}], type=struct
        ),
        "image_2": pa.array([None, {"bytes": png, "path": "c.png"}], type=struct),
        "image_3": pa.array([None, None], type=struct),
        "image_4": pa.array([None, None], type=struct),
    }
    (root / "Counting").mkdir(parents=True)
    pq.write_table(pa.table(rows), root / "Counting" / "val-00000-of-00001.parquet")
    return root
