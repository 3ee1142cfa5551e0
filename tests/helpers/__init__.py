"""Test helpers: small models, batches and saved checkpoints the tests share (not tests)."""
