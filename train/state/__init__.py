"""A run's state on disk: checkpoints, their parts and migrations, final/, the model card, hub uploads."""
