"""The embedded default: tiny seeded models and the synthetic scenes."""
