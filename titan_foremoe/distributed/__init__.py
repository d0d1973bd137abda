"""Process groups, meshes and the parallelized model (torchtitan's own)."""
