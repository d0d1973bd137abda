"""Prompt datasets from files: JSONL or Parquet rows of (prompt, reference answer).

Every row is turned into prompt ids once, at load, through the HF tokenizer's
chat template (optional system message); a prompt is a string, or a list of
``{role, content}`` chat messages (verl / slime / OpenAI rows) rendered whole by
the template. A bad row is found before any
step runs: a missing or null key, a prompt of another type, an empty prompt, or a prompt that leaves no room for
the completion in the context is an error naming the file and the row, or is
skipped and counted with ``skip_bad_rows``. (Cost: one tokenizer pass over the
file per rank at start-up, about a second per 10^5 short prompts with a fast
tokenizer.)

Order: epoch ``e`` visits the rows in a permutation seeded by ``(seed, e)``;
``take`` hands out the next ``n`` global examples, each data-parallel rank its
own contiguous slice. The only state is how many examples were consumed
(``state_dict``/``load_state_dict``), so a restored run continues with the
example it would have seen next.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .records import RecordError, iter_records
from .sft import MicroBatch, pack_examples
from .tasks import Example


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file and row."""


@dataclass(frozen=True)
class PromptExample(Example):
    prompt_ids: tuple[int, ...] = ()
    response_ids: tuple[int, ...] = ()  # supervised warm-up target, EOS included
    row: int = -1


def read_rows(path: str) -> list[dict]:
    """Rows of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file."""
    if not os.path.isfile(path):
        raise DatasetError(f"[data] path {path!r} does not exist")
    if not path.endswith((".jsonl", ".json", ".parquet")):
        raise DatasetError(f"{path}: expected a .jsonl, .json (JSON lines) or .parquet file")
    try:
        return [row for _, row in iter_records(path)]
    except RecordError as e:
        raise DatasetError(str(e)) from None


def field(where: str, row: dict, key: str):
    """``row[key]``; a missing key and a null value are told apart."""
    if key not in row:
        raise DatasetError(f"{where}: missing key {key!r} (has {sorted(row)})")
    if row[key] is None:
        raise DatasetError(f"{where}: {key!r} is null")
    return row[key]


def _kind(value) -> str:
    return f"{type(value).__name__} ({str(value)[:60]})"


def prompt_value(where: str, key: str, value) -> str | list[dict]:
    """A prompt as text, or as chat messages ``[{role, content}, ...]`` (verl / slime / OpenAI rows), which the
    tokenizer's chat template renders; anything else would be trained as its Python repr, so it is refused."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: empty prompt")
        return value
    if not isinstance(value, (list, tuple)):
        raise DatasetError(f"{where}: {key!r} is a {_kind(value)}, not a string or a list of "
                           "{role, content} messages")
    if not value:
        raise DatasetError(f"{where}: empty prompt ({key!r} is an empty list of messages)")
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: {key!r} message {j} is a {_kind(m)}, not a {{role, content}} message "
                               "with string values")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        raise DatasetError(f"{where}: empty prompt (every message's content is blank)")
    return messages


def prompt_text(prompt: str | list[dict]) -> str:
    """The example's text (rollout dumps, reward functions): a message list's last user turn, as for a plain
    prompt (its last turn when no turn is the user's)."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else prompt[-1]["content"]


def answer_value(where: str, key: str, value) -> str:
    """The reference answer as text: a string, or a number (math datasets store ``42``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: {key!r} is a {_kind(value)}, not a string or a number")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encoded(where: str, what: str, encode, text: str) -> list[int]:
    """``encode()``, a tokenizer's failure on this row a ``DatasetError`` naming it (``skip_bad_rows`` skips it):
    a lone UTF-16 surrogate (half an emoji, from a JSON ``\\ud83d`` escape) is named with its position, which the
    Rust tokenizer reports as a bare ``TypeError``."""
    if m := _SURROGATE.search(text):
        raise DatasetError(f"{where}: the {what} holds a lone UTF-16 surrogate U+{ord(m.group()):04X} at character "
                           f"{m.start()} (half of an emoji or other character: not text any tokenizer encodes)")
    try:
        return list(encode())
    except (TypeError, ValueError, UnicodeError) as e:
        raise DatasetError(f"{where}: the tokenizer cannot encode the {what} ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


class PromptDataset(Stateful):
    """Prompts with reference answers, chat-templated, with a resumable position."""

    def __init__(
        self,
        path: str,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str = "",
        response_template: str = "{answer}",
        max_prompt_tokens: int,
        max_sft_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        skip_bad_rows: bool = False,
    ):
        self.path, self.seed, self.shuffle = path, seed, shuffle
        self.name = os.path.basename(path)
        self.examples: list[PromptExample] = []
        self.skipped = 0
        for i, row in enumerate(read_rows(path)):
            try:
                self.examples.append(self._example(
                    i, row, tokenizer, prompt_key, answer_key, system_prompt, response_template,
                    max_prompt_tokens, max_sft_tokens,
                ))
            except DatasetError:
                if not skip_bad_rows:
                    raise
                self.skipped += 1
        if not self.examples:
            raise DatasetError(f"{path}: no usable rows ({self.skipped} skipped)")
        self.consumed = 0
        self._cached_epoch, self._cached_order = -1, []

    def _example(self, i, row, tok, prompt_key, answer_key, system, template, max_prompt, max_sft):
        where = f"{self.path} row {i}"
        prompt = prompt_value(where, prompt_key, field(where, row, prompt_key))
        answer = answer_value(where, answer_key, field(where, row, answer_key))
        ids = _encoded(where, "prompt", lambda: tok.chat_prompt(prompt, system), prompt_text(prompt))
        prompt = prompt_text(prompt)
        if len(ids) > max_prompt:
            raise DatasetError(f"{where}: prompt of {len(ids)} tokens is longer than the context allows "
                               f"({max_prompt} = seq_len - max_new_tokens + 1)")
        text = template.format(answer=answer)
        response = _encoded(where, "answer", lambda: tok.encode(text), text) + [tok.eos_id]
        if max_sft is not None and len(ids) + len(response) > max_sft:  # seq_len inputs + the last target
            raise DatasetError(f"{where}: prompt + response of {len(ids) + len(response)} tokens does not fit "
                               f"seq_len {max_sft - 1} (+ 1 target) for the supervised warm-up")
        return PromptExample(prompt=prompt, answer=answer, prompt_ids=tuple(ids), response_ids=tuple(response),
                             row=i)

    def __len__(self) -> int:
        return len(self.examples)

    def fingerprint(self) -> str:
        """A hash of the usable rows' token ids, in file order: a resume must read the rows it was saved on."""
        import hashlib

        h = hashlib.sha256()
        for ex in self.examples:
            h.update(repr((ex.prompt_ids, ex.response_ids)).encode())
        return h.hexdigest()[:16]

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s row order, seeded by ``(seed, epoch)``; the last one is kept, since every step
        of an epoch reads it (a permutation of the whole dataset per step costs O(rows))."""
        if self._cached_epoch != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._cached_order = torch.randperm(len(self), generator=gen).tolist()
            else:
                self._cached_order = list(range(len(self)))
            self._cached_epoch = epoch
        return self._cached_order

    def take(self, n_global: int, dp_rank: int, dp_degree: int) -> list[PromptExample]:
        """This rank's share (``n_global / dp_degree`` examples) of the next ``n_global``; all ranks advance."""
        per_rank = n_global // dp_degree
        start = self.consumed + dp_rank * per_rank
        out = [self.examples[self._order(g // len(self))[g % len(self)]] for g in range(start, start + per_rank)]
        self.consumed += n_global
        return out

    @property
    def epoch(self) -> int:
        return self.consumed // len(self)

    # -- Stateful: checkpointed with the model ------------------------------------
    def state_dict(self) -> dict:
        return {"consumed": torch.tensor(self.consumed), "num_rows": torch.tensor(len(self))}

    def load_state_dict(self, state_dict: dict) -> None:
        rows = int(state_dict.get("num_rows", len(self)))
        if rows != len(self):
            raise DatasetError(f"{self.path}: checkpoint was taken on a dataset of {rows} usable rows, "
                               f"this one has {len(self)}")
        self.consumed = int(state_dict["consumed"])

    # -- batches ---------------------------------------------------------------------
    @staticmethod
    def sft_batch(examples: list[PromptExample], pad_id: int, seq_len: int) -> MicroBatch:
        """Prompt + response, loss on the response tokens only."""
        return pack_examples([(ex.prompt_ids, ex.response_ids) for ex in examples], pad_id, seq_len)


def build_prompt_dataset(data_cfg, tokenizer, *, seq_len: int, max_new_tokens: int, sft: bool, seed: int
                         ) -> PromptDataset:
    """The ``[data] path`` dataset: a prompt may take ``seq_len - max_new_tokens + 1`` tokens (the last
    sampled token is never fed back); with a supervised warm-up prompt + response must fit ``seq_len + 1``."""
    return PromptDataset(
        data_cfg.path, tokenizer, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
        system_prompt=data_cfg.system_prompt, response_template=data_cfg.response_template,
        max_prompt_tokens=seq_len - max_new_tokens + 1, max_sft_tokens=seq_len + 1 if sft else None,
        seed=seed, shuffle=data_cfg.shuffle, skip_bad_rows=data_cfg.skip_bad_rows,
    )
