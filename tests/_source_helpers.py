"""Helpers of the tests of precompute/sources/*.py (tests/test_source_*.py): a listing of a source, the outcome of
every entry, small folders, tars, LLaVA items and HF-style parquet files."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from precompute import sources
from tests._precompute_helpers import gradient, png_bytes


def listing_of(kind: str, path, tmp_path: Path, **kw) -> sources.Listing:
    return sources.open_listing(kind, str(path), None, 0, "Describe the image.", index_dir=tmp_path / "idx", **kw)


def outcomes(listing: sources.Listing) -> dict[str, str]:
    """{key: caption, or 'error: <reason>'} over the whole listing, loading every usable entry."""
    out = {}
    for e in listing.entries(0, len(listing)):
        if e.error is None:
            try:
                out[e.key] = listing.load(e).caption
            except (sources.SourceError, OSError) as err:
                out[e.key] = f"error: {err}"
        else:
            out.setdefault(e.key, f"error: {e.error}")
    return out


def txt_folder(root: Path, n: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"img{i:03d}.png").write_bytes(png_bytes(gradient(20 + i % 3, 20)))
        (root / f"img{i:03d}.txt").write_text(f"caption {i}")


def write_tar(path: Path, members: list[tuple[str, str, bytes]]) -> Path:
    """A tar with members `<key>.<ext>` in the given order (as a tool that does not group them could write it)."""
    import io

    with tarfile.open(path, "w") as tf:
        for key, ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def chat_item(i: int, human: str = "Provide a brief description of the given image.\n<image>", **kw) -> dict:
    return {
        "id": f"GCC_train_{i:09d}",
        "image": f"GCC_train_{i:09d}.jpg",
        "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": f"a caption {i} ."}],
        **kw,
    }


def hf_parquet(path: Path, rows: list[dict], row_group_size: int) -> None:
    """A parquet file as HF `datasets` writes one with an Image feature: image is struct<bytes: binary, path:
    string>, and the features are recorded in the schema's b"huggingface" metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_t = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [("image", image_t), ("text", pa.string())],
        metadata={
            b"huggingface": json.dumps(
                {"info": {"features": {"image": {"_type": "Image"}, "text": {"dtype": "string", "_type": "Value"}}}}
            ).encode()
        },
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
