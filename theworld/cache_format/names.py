"""What everything in a cache is called: its files and folders, and the members of a sample (webdataset:
"<key>.<member>"). Every sample of a cache has the same member names, so tools that infer one schema from the first
samples (Hugging Face `datasets`' webdataset builder) read a whole cache."""

MANIFEST = "manifest.json"
SHARDS = "shards"
ERRORS = "errors.jsonl"
ERRORS_DIR = "errors"
RUN_FILE = "precompute.json"
INDEX_DIR = "source-index"
SHARD_INDEX = "shard-index"  # every shard's and sample's record in a few safetensors objects (index.py)
RECORDS = "shard-records"  # a remote precompute: each process's sidecars and error files in one object (storage.py)

LATENT = "latent.safetensors"  # tensors "mean", "logvar" (only "mean" with cache.latents: mean): (16, 1, h, w)
LATENT_FLIP = "latent_flip.safetensors"  # the same for the horizontally flipped image
SIGLIP = "siglip.safetensors"  # tensor "features": (mm_tokens, H), the multimodal projector's output
CAPTION = "txt"
META = "json"  # prompt, source, original_size, crop_box, flip; TURNS for a conversation
TURNS = "turns"  # META field of a multi-turn sample: the turns after the first, [[user, model], ...] (the first is
# prompt + caption, so single-turn readers and caches are unchanged)
IMAGE = "image"  # the original image file's bytes, whatever its format (jpg, png, webp; others kept as PNG)
