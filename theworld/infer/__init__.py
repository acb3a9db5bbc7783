"""Using a trained stage: generation, benchmark items and scoring, as a library (the command lines are
`theworld.describe` and `theworld.evaluate`). Nothing here imports `theworld.model`: the model is an argument."""
