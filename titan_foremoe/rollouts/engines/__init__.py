"""Inference engines the trainer drives for live rollouts (``[rl] rollout_source = "vllm"`` or ``"sglang"``)."""
