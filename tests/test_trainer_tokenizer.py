"""rankscope_trainer.tokenizer: a word-level vocabulary built from the captions, stable through a checkpoint."""

from __future__ import annotations

import pytest
from rankscope_trainer.tokenizer import SPECIAL_TOKENS, WordTokenizer

CAPTIONS = ["a small red circle at the top left", "a large blue square at the centre", "a red square"]


def test_the_vocabulary_starts_with_the_special_tokens_then_the_most_frequent_words() -> None:
    tok = WordTokenizer.build(CAPTIONS, max_length=12)
    assert tok.vocab[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert tok.vocab[len(SPECIAL_TOKENS)] == "a"  # in every caption
    assert set(tok.vocab[len(SPECIAL_TOKENS) :]) == {w for c in CAPTIONS for w in c.split()}


def test_the_same_captions_in_another_order_give_the_same_ids() -> None:
    assert WordTokenizer.build(CAPTIONS, 12).vocab == WordTokenizer.build(reversed(CAPTIONS), 12).vocab


def test_a_batch_is_cls_words_sep_then_padding_with_a_matching_mask() -> None:
    tok = WordTokenizer.build(CAPTIONS, max_length=12)
    ids, mask, lengths = tok.batch(["A red circle.", "a small red circle at the top left"])
    assert ids.shape == mask.shape == (2, 12)
    assert lengths.tolist() == [6, 10]  # [CLS] a red circle [UNK](.) [SEP]; 8 words + 2
    assert mask.sum(dim=1).tolist() == lengths.tolist()
    assert tok.decode(ids[0].tolist()) == "a red circle"  # special tokens are left out
    assert ids[0, 4].item() == tok.vocab.index("[UNK]")
    assert (ids[0, 6:] == tok.pad_id).all()


def test_long_captions_are_truncated_but_keep_their_sep() -> None:
    tok = WordTokenizer.build(CAPTIONS, max_length=4)
    encoded = tok.encode("a small red circle at the top left")
    assert len(encoded) == 4
    assert encoded[-1] == tok.vocab.index("[SEP]")


def test_the_state_dict_round_trips() -> None:
    tok = WordTokenizer.build(CAPTIONS, max_length=9)
    again = WordTokenizer.from_state_dict(tok.state_dict())
    assert again.vocab == tok.vocab and again.max_length == 9
    assert again.batch(CAPTIONS)[0].equal(tok.batch(CAPTIONS)[0])


def test_a_foreign_state_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        WordTokenizer.from_state_dict({"kind": "bpe", "vocab": [], "max_length": 8})
    with pytest.raises(ValueError, match="must start with"):
        WordTokenizer(["a", "b"], 8)
