"""The training loop: steps made of explicit, named micro-steps."""
