"""A token's text in the OpenAI answers: its own bytes (a character split across tokens joins back
from them), where its text starts in the completion (text_offset), and the tokens of a stop string
left out as the text leaves them out. A byte-level BPE built here (no download): a character of
four bytes is four tokens, each decoding alone to U+FFFD."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from orchestrator.generation import token_bytes
from orchestrator.openai_answers import Completion, text_offsets
from specdec.v1 import orchestrator_pb2

TEXT = "a🎉bé c"


@pytest.fixture(scope="module")
def tok():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    bpe = Tokenizer(models.BPE(vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def entries(tok, text: str) -> list[orchestrator_pb2.TokenLogprob]:
    out = []
    for token in tok.encode(text, add_special_tokens=False):
        alone = tok.decode([token])
        out.append(
            orchestrator_pb2.TokenLogprob(token_id=token, token=alone, token_bytes=token_bytes(tok, token, alone))
        )
    return out


def test_a_tokens_bytes_are_its_own(tok):
    """Each part of 🎉 decoded alone is U+FFFD, whose UTF-8 bytes (ef bf bd) were its `bytes`."""
    got = entries(tok, TEXT)
    assert len(got) == len(TEXT.encode())  # a token a byte
    assert sum(e.token == "\ufffd" for e in got) == 6  # 🎉's four bytes, é's two
    assert b"".join(e.token_bytes for e in got).decode() == TEXT


def test_text_offsets_follow_the_characters_not_each_tokens_text(tok):
    """Summed per token's text alone (U+FFFD a part), the offsets ran past the text's end."""
    got = entries(tok, TEXT)
    offsets = text_offsets(got)
    assert offsets == [0, 1, 1, 1, 1, 2, 3, 3, 4, 5]
    assert [TEXT[at] for at in offsets] == ["a", "🎉", "🎉", "🎉", "🎉", "b", "é", "é", " ", "c"]
    assert text_offsets(got[5:], offset=2)[0] == 2  # a chunk's own start


def test_a_stop_strings_tokens_are_left_out_with_its_text(tok):
    """Text "a🎉b" cut before the stop string "é c": the tokens that made it are not reported."""
    completion = Completion.start("completions", "m", logprobs=True)
    got = completion._logprobs(entries(tok, TEXT), end=3)
    assert got["text_offset"] == [0, 1, 1, 1, 1, 2] and len(got["tokens"]) == 6
    chat = Completion.start("chat", "m", logprobs=True)._logprobs(entries(tok, TEXT), end=3)
    assert (
        len(chat["content"]) == 6
        and bytes(chat["content"][1]["bytes"]) + bytes(b for c in chat["content"][2:5] for b in c["bytes"])
        == "🎉".encode()
    )
