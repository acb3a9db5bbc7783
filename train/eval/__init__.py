"""Evaluation during training: held-out loss, caption samples, benchmarks and the plateau rule."""
