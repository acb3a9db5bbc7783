"""TheWorld: Gemma 3 + the Cosmos VAE world encoder + a trainable world projector.

Rooms: `model/` (the model and its inputs), `core/` (config engine, errors, logs, paths, locks, process groups, the
Hub), `embedded/` (the tiny default), `cache_format/` (the latent cache), `infer/` (generation and scoring); the
commands (`describe`, `evaluate`, `export`, `models`) and the lmms-eval adapter sit at this level.
`TheWorld` and `from_pretrained` are importable from here.
"""


def __getattr__(name: str):
    if name in ("TheWorld", "from_pretrained"):
        from theworld.model.world import TheWorld

        return TheWorld if name == "TheWorld" else TheWorld.from_pretrained
    raise AttributeError(f"module 'theworld' has no attribute {name!r}")
