"""Shared infrastructure: the config engine, errors, logs, paths, locks, process groups, the Hub."""
