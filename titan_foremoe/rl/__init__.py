"""GRPO: group-relative advantages and the clipped policy loss; pluggable rewards."""
