"""An HF tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) behind the trainer's tokenizer interface.

The interface is ``CharTokenizer``'s: ``encode``, ``decode`` (up to the first
EOS), ``pad_id``, ``bos_id``, ``eos_id``; plus ``eos_ids`` (every id that ends a
completion: the tokenizer's EOS and ``generation_config.json``'s
``eos_token_id``, which for Qwen3 lists both ``<|im_end|>`` and
``<|endoftext|>``) and ``chat_prompt`` (the chat template with the generation
prompt appended).
"""

from __future__ import annotations

import json
import os

import torch


class HFTokenizer:
    def __init__(self, folder: str):
        from transformers import AutoTokenizer

        self.folder = folder
        self.tok = AutoTokenizer.from_pretrained(folder)
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        gen_path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            eos += gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        if not eos:
            raise ValueError(f"{folder}: neither the tokenizer nor generation_config.json names an EOS token")
        self.eos_ids = list(dict.fromkeys(int(i) for i in eos))
        self.eos_id = self.eos_ids[0]
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id  # Qwen3 has none; the chat template starts the prompt
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def chat_prompt(self, user: str, system: str = "") -> list[int]:
        """Prompt ids: the chat template over (system, user) with the assistant turn opened."""
        if not self.has_chat_template:
            ids = self.encode((system + "\n" if system else "") + user)
            return ([self.bos_id] if self.bos_id is not None else []) + ids
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text up to the first EOS, special tokens skipped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        for i, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:i]
                break
        return self.tok.decode(ids, skip_special_tokens=True)
