"""Embedded tasks and tokenizer: no hub downloads, fully reproducible."""
