"""Chains of JAX models (Flax, Equinox, Haiku, plain functions), proven from their jaxpr."""
