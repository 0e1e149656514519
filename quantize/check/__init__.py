"""Proving an output: verify (weights, config, layer function check) and eval (held-out text)."""
