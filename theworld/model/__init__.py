"""TheWorld's model: Gemma 3 + the Cosmos VAE world encoder + the world projector, and its inputs.

`from theworld.model import TheWorld` is the public name; it is resolved on first use so that the light modules of this
package (arch, inputs, objective, ...) import without transformers.
"""


def __getattr__(name: str):
    if name == "TheWorld":
        from theworld.model.world import TheWorld

        return TheWorld
    raise AttributeError(f"module 'theworld.model' has no attribute {name!r}")
