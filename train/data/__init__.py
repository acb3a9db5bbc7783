"""Data: the cache and its checks, the sample order, batches, mixtures and the loaders."""
