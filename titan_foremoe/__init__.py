"""titan_foremoe: RL post-training of MoE models with foresight expert placement."""
