"""A word-level tokenizer built from the training captions (nothing downloaded).

    tok = WordTokenizer.build(captions, max_length=16)
    ids, mask, lengths = tok.batch(["a small red circle at the top left"])

Lower-cased words and punctuation marks are tokens; unseen words map to
[UNK]. The vocabulary is part of every checkpoint (`state_dict()`), so a
resumed run reads the same ids even if the captions on disk changed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SPECIAL_TOKENS", "WordTokenizer"]

PAD, UNK, CLS, SEP = "[PAD]", "[UNK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP)
_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class WordTokenizer:
    """Maps captions to fixed-length id tensors: [CLS] words... [SEP] [PAD]..."""

    def __init__(self, vocab: list[str], max_length: int) -> None:
        if list(vocab[: len(SPECIAL_TOKENS)]) != list(SPECIAL_TOKENS):
            raise ValueError(f"tokenizer vocabulary must start with {list(SPECIAL_TOKENS)}")
        if max_length < 3:
            raise ValueError(f"tokenizer max_length must be >= 3, got {max_length}")
        self.vocab = list(vocab)
        self.max_length = max_length
        self._ids = {word: index for index, word in enumerate(self.vocab)}

    @classmethod
    def build(cls, captions: Iterable[str], max_length: int, max_vocab: int = 30000) -> WordTokenizer:
        """Vocabulary = words of `captions`, most frequent first (ties alphabetical, so every rank agrees)."""
        counts = Counter(word for caption in captions for word in _words(caption))
        ranked = sorted(counts, key=lambda word: (-counts[word], word))
        return cls([*SPECIAL_TOKENS, *ranked[: max_vocab - len(SPECIAL_TOKENS)]], max_length)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    def encode(self, text: str) -> list[int]:
        """Ids of one caption, with [CLS] and [SEP], truncated to max_length (no padding)."""
        unk = self._ids[UNK]
        body = [self._ids.get(word, unk) for word in _words(text)][: self.max_length - 2]
        return [self._ids[CLS], *body, self._ids[SEP]]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, lengths) for a list of captions, padded to max_length."""
        ids = torch.full((len(texts), self.max_length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), self.max_length), dtype=torch.long)
        lengths = torch.zeros(len(texts), dtype=torch.long)
        for row, text in enumerate(texts):
            encoded = self.encode(text)
            ids[row, : len(encoded)] = torch.tensor(encoded)
            mask[row, : len(encoded)] = 1
            lengths[row] = len(encoded)
        return ids, mask, lengths

    def decode(self, ids: Iterable[int]) -> str:
        words = [self.vocab[i] for i in ids if 0 <= i < len(self.vocab)]
        return " ".join(w for w in words if w not in SPECIAL_TOKENS)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "word", "vocab": list(self.vocab), "max_length": self.max_length}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> WordTokenizer:
        if state.get("kind") != "word":
            raise ValueError(f"unknown tokenizer kind {state.get('kind')!r} in checkpoint")
        return cls(list(state["vocab"]), int(state["max_length"]))
