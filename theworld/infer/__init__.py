"""Using a trained stage: generation, benchmark items, evaluation protocols and baselines, statistics, caption metrics
and the model card's results, as a library (the command lines are `theworld.describe` and `theworld.evaluate`).
Nothing here imports `theworld.model`: the model is an argument."""
