"""A conversation's token ids and loss mask from the chat template: what the template renders as the
assistant's output is trained; system, user and tool messages (and the template's role headers) are fed,
routed and replayed, never trained.

The assistant's output of message i is found by rendering the conversation twice: up to message i with
the generation prompt opened (the prefix the model was given) and through message i. The tokens between
the two, up to and including the first end-of-turn token, are what the model produced; template glue
after the end token (a newline) is not. This needs no ``{% generation %}`` markers in the template (most
models' templates have none); a template that re-renders earlier turns differently once a later one is
added (e.g. Qwen3 dropping older reasoning) breaks the prefix property and is refused, naming the message,
instead of training on misaligned tokens.

Cost: two template renders per assistant message, on the host, once per rollout (no device work).
"""

from __future__ import annotations

import numpy as np


def _render(tok, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                  return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def chat_loss_mask(tok, messages: list[dict], eos_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids_T, trained_T)`` of ``messages`` (``[{"role", "content"}]``) under ``tok``'s chat template."""
    ids = _render(tok, messages, False)
    mask = np.zeros(len(ids), dtype=bool)
    eos = set(int(e) for e in eos_ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _render(tok, messages[:i], True)
        through = _render(tok, messages[: i + 1], False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(f"message {i}: the chat template renders the conversation before this assistant "
                             "message differently once it is added (not a prefix): its tokens cannot be located")
        end = len(through)
        for j in range(len(before), len(through)):
            if through[j] in eos:
                end = j + 1
                break
        mask[len(before) : end] = True
    return np.asarray(ids, dtype=np.int64), mask
