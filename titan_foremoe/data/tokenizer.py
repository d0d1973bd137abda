"""A character tokenizer for the embedded verifiable tasks."""

from __future__ import annotations

import torch

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARS = "0123456789+-=:,;>< abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Ids 0-2 are pad/bos/eos; one id per character of ``_CHARS`` after them."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    eos_ids = (EOS_ID,)  # every id that ends a completion (the HF tokenizer's interface)

    def __init__(self, vocab_size: int = 64):
        if vocab_size < 3 + len(_CHARS):
            raise ValueError(f"vocab_size {vocab_size} < {3 + len(_CHARS)} needed by the tokenizer")
        self.vocab_size = vocab_size
        self._to_id = {c: i + 3 for i, c in enumerate(_CHARS)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Characters up to the first EOS; pad/bos are skipped."""
        out = []
        for i in ids.tolist() if isinstance(ids, torch.Tensor) else ids:
            if i == EOS_ID:
                break
            if i in self._to_char:
                out.append(self._to_char[i])
        return "".join(out)
