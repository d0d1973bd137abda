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


class TokenizerError(ValueError):
    """The folder's tokenizer cannot serve the job (one line naming the file or setting)."""


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class HFTokenizer:
    def __init__(self, folder: str, chat_template: str = ""):
        """``chat_template``: "" the tokenizer's own (an error when it has none: prompts would silently go
        untemplated), "none" plain text, else a Jinja template file."""
        from transformers import AutoTokenizer

        self.folder = folder
        if not any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
            raise TokenizerError(f"{folder} has no tokenizer file ({', '.join(_TOKENIZER_FILES)}); copy the "
                                 "model's tokenizer.json and tokenizer_config.json there")
        try:
            self.tok = AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # transformers' own message suggests installing sentencepiece/tiktoken
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise TokenizerError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {first})") from None
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
        if chat_template not in ("", "none"):
            try:
                with open(chat_template) as f:
                    self.tok.chat_template = f.read()
            except OSError as e:
                raise TokenizerError(f"[data] chat_template: cannot read {chat_template} ({e.strerror})") from None
        self.has_chat_template = chat_template != "none" and bool(getattr(self.tok, "chat_template", None))
        if chat_template == "" and not self.has_chat_template:
            raise TokenizerError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json or "
                                 "chat_template.jinja); set [data] chat_template = 'none' to train on plain "
                                 "prompts, or to a template file")

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def chat_prompt(self, user: str | list[dict], system: str = "") -> list[int]:
        """Prompt ids: the chat template over (system, user) with the assistant turn opened. ``user`` may be whole
        chat messages ``[{role, content}]``; ``system`` goes first unless they start with a system message."""
        turns = [{"role": "user", "content": user}] if isinstance(user, str) else list(user)
        if system and not (turns and turns[0]["role"] == "system"):
            turns = [{"role": "system", "content": system}] + turns
        if not self.has_chat_template:
            ids = self.encode("\n".join(m["content"] for m in turns))
            return ([self.bos_id] if self.bos_id is not None else []) + ids
        messages = turns
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def chat_loss_mask(self, messages: list[dict]):
        """``(ids_T, trained_T)``: a conversation under the chat template and its assistant-output mask
        (``rollouts/template_mask.py``): tool and user tokens are replayed, not trained."""
        from ..rollouts.template_mask import chat_loss_mask

        if not self.has_chat_template:
            raise TokenizerError("[data] chat_template = 'none': a multi-turn loss mask needs a chat template")
        return chat_loss_mask(self.tok, messages, self.eos_ids)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text up to the first EOS, special tokens skipped."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        for i, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:i]
                break
        return self.tok.decode(ids, skip_special_tokens=True)
