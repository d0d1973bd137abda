"""Embedded rollout: generation on the policy's own weights, recording every token's experts."""

from .generate import GenerationConfig, Rollout, generate

__all__ = ["GenerationConfig", "Rollout", "generate"]
