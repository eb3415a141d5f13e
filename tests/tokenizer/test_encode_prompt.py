"""encode_prompt: a text prompt gets the tokenizer's BOS (as SGLang and vLLM encode it), once."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from plait.models.tokenizer import encode_prompt


def _tokenizer(adds_bos: bool) -> PreTrainedTokenizerFast:
    vocab = {"<s>": 0, "</s>": 1, "h": 2, "i": 3, " ": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.add_special_tokens(["<s>", "</s>"])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_a_text_prompt_gets_one_bos():
    tok = _tokenizer(adds_bos=True)
    assert encode_prompt(tok, "hi") == [0, 2, 3]
    assert encode_prompt(tok, "<s>hi") == [0, 2, 3]  # written by the text: not added again
    assert encode_prompt(tok, " <s>hi")[:2] == [0, 4]  # not at the start: the text's own
    assert encode_prompt(tok, "") == [0]


def test_a_tokenizer_without_bos_adds_nothing():
    tok = _tokenizer(adds_bos=False)
    assert encode_prompt(tok, "hi") == [2, 3] == tok.encode("hi", add_special_tokens=False)
    assert encode_prompt(tok, "") == []
