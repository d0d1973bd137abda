"""Balance and training metrics, written with torchtitan's TensorBoard logger."""
