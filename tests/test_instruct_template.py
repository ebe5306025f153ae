"""Rendering records for instruction tuning: the loss covers exactly the response tokens, on the
plain template and on a chat template; truncation is reported; a refused template says so."""
from __future__ import annotations

import copy

import pytest

from fedsilo.errors import ConfigError
from fedsilo.tasks.instruct.records import Record, alpaca
from fedsilo.tasks.instruct.template import IGNORE, prompt_ids, render, use_chat

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SENTENCES = ["Add two and three.", "The answer is five.", "What is the capital of France?",
             "Paris is the capital of France.", "Be brief and exact.", "### Instruction:\n### Response:\n",
             "Name a colour of the sky.", "Blue, on a clear day."]


def tiny_tokenizer():
    """A byte-level BPE fitted on a few sentences, with BOS added in front (as Llama's) and no chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


@pytest.fixture(scope="module")
def plain_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def chat_tok(plain_tok):
    tok = copy.deepcopy(plain_tok)
    tok.chat_template = CHATML
    return tok


def response_part(out, tok):
    """The unmasked tokens, decoded, and a check that labels equal the ids there."""
    kept = [i for i, label in enumerate(out.labels) if label != IGNORE]
    assert kept == list(range(kept[0], len(out.labels))), "the loss covers one contiguous tail"
    assert all(out.labels[i] == out.input_ids[i] for i in kept)
    return kept[0], tok.decode([out.input_ids[i] for i in kept])


def test_plain_template_masks_exactly_the_prompt(plain_tok):
    record = alpaca("Add two and three.", input="Be brief.", output="The answer is five.", system="Be exact.")
    out = render(record, plain_tok, chat=False, max_length=512)
    prompt = prompt_ids(record, plain_tok, chat=False)
    start, text = response_part(out, plain_tok)
    assert start == len(prompt) and out.input_ids[:start] == prompt
    assert text == "The answer is five.</s>"
    assert out.input_ids[0] == plain_tok.bos_token_id and out.input_ids[-1] == plain_tok.eos_token_id
    assert plain_tok.decode(prompt, skip_special_tokens=True) == (
        "Be exact.\n\n### Instruction:\nAdd two and three.\n\nBe brief.\n\n### Response:\n")
    assert not out.truncated and out.full_length == len(out.input_ids) and out.trains


def test_chat_template_masks_exactly_the_prompt(chat_tok):
    assert use_chat(chat_tok, "auto")
    record = alpaca("What is the capital of France?", output="Paris is the capital of France.")
    out = render(record, chat_tok, chat=True, max_length=512)
    prompt = prompt_ids(record, chat_tok, chat=True)
    start, text = response_part(out, chat_tok)
    assert start == len(prompt) and out.input_ids[:start] == prompt
    assert chat_tok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert text == "Paris is the capital of France.<|im_end|>\n"  # the end-of-turn is learnt, no EOS added
    assert chat_tok.eos_token_id not in out.input_ids


def test_multi_turn_chat_masks_the_earlier_answer(chat_tok):
    record = Record((("system", "Be brief and exact."), ("user", "Add two and three."),
                     ("assistant", "The answer is five."), ("user", "Name a colour of the sky.")),
                    "Blue, on a clear day.")
    out = render(record, chat_tok, chat=True, max_length=512)
    start, text = response_part(out, chat_tok)
    assert text == "Blue, on a clear day.<|im_end|>\n"
    prompt_text = chat_tok.decode(out.input_ids[:start])
    assert "The answer is five.<|im_end|>" in prompt_text and prompt_text.count("<|im_start|>") == 5


def test_multi_turn_plain_masks_the_earlier_answer(plain_tok):
    record = Record((("user", "Add two and three."), ("assistant", "The answer is five."),
                     ("user", "Name a colour of the sky.")), "Blue, on a clear day.")
    out = render(record, plain_tok, chat=False, max_length=512)
    start, text = response_part(out, plain_tok)
    assert text == "Blue, on a clear day.</s>"
    assert plain_tok.decode(out.input_ids[:start], skip_special_tokens=True) == (
        "### Instruction:\nAdd two and three.\n\n### Response:\nThe answer is five.\n\n"
        "### Instruction:\nName a colour of the sky.\n\n### Response:\n")


@pytest.mark.parametrize("chat", [False, True])
def test_plain_text_record_trains_on_every_token(plain_tok, chat_tok, chat):
    tok = chat_tok if chat else plain_tok
    out = render(Record((), "Paris is the capital of France."), tok, chat=chat, max_length=512)
    assert out.labels == out.input_ids
    assert tok.decode(out.input_ids) == "<s>Paris is the capital of France.</s>"


def test_truncation_is_reported(plain_tok):
    record = alpaca("Add two and three.", output="The answer is five.")
    whole = render(record, plain_tok, chat=False, max_length=512)
    prompt = len(prompt_ids(record, plain_tok, chat=False))
    cut = render(record, plain_tok, chat=False, max_length=prompt + 2)
    assert cut.truncated and cut.full_length == whole.full_length > len(cut.input_ids) == prompt + 2
    assert cut.input_ids == whole.input_ids[:prompt + 2] and cut.labels == whole.labels[:prompt + 2]
    assert cut.trains
    gone = render(record, plain_tok, chat=False, max_length=prompt)
    assert gone.truncated and not gone.trains and set(gone.labels) == {IGNORE}


def test_prompt_start_truncation_keeps_the_response(plain_tok):
    """A long context (PubMedQA's abstracts) loses its start, not the answer: the BOS and the whole
    response (+ EOS) stay, the labels still cover exactly the response."""
    record = alpaca("Read this long abstract. " * 20, output="yes")
    whole = render(record, plain_tok, chat=False, max_length=4096)
    answer = [t for t, y in zip(whole.input_ids, whole.labels) if y != IGNORE]
    out = render(record, plain_tok, chat=False, max_length=len(answer) + 5, truncation="prompt_start")
    assert out.truncated and out.trains and len(out.input_ids) == len(answer) + 5
    assert out.input_ids[0] == plain_tok.bos_token_id
    assert out.input_ids[-len(answer):] == answer and out.labels[-len(answer):] == answer
    assert set(out.labels[:-len(answer)]) == {IGNORE}
    assert out.input_ids[1:-len(answer)] == whole.input_ids[len(whole.input_ids) - len(answer) - 4:-len(answer)]
    end = render(record, plain_tok, chat=False, max_length=len(answer) + 5)
    assert end.truncated and not end.trains  # trl's cut at the end loses the answer here


def test_chat_without_a_chat_template_is_refused(plain_tok):
    assert not use_chat(plain_tok, "auto") and not use_chat(plain_tok, "plain")
    with pytest.raises(ConfigError, match="task.template"):
        use_chat(plain_tok, "chat")
    with pytest.raises(ConfigError, match="task.template"):
        use_chat(plain_tok, "jinja")
