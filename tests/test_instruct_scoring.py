"""Scoring a decoder and packing its batches, on a tiny random Llama: packing changes no example's
loss or logits, multiple choice equals a hand computation, batched greedy decoding equals one prompt
at a time, and GSM8K's final number is read from real answers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedsilo.errors import ConfigError
from fedsilo.tasks.instruct.packing import pack, require_packable, unpacked
from fedsilo.tasks.instruct.scoring import (batched_option_loglikelihoods, extract_final_number, greedy_generate,
                                            option_loglikelihoods, options_ids, response_nll, same_number, token_nll)
from tests.test_instruct_template import tiny_tokenizer

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "instruct" / "gsm8k" / "test.jsonl"
VOCAB = 50
EOS, PAD = 2, 0


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, bos_token_id=1, eos_token_id=EOS,
                         pad_token_id=PAD, attn_implementation=attn, initializer_range=0.2)
    return LlamaForCausalLM(config).eval()  # wide init: greedy answers vary with their context


def random_rows(lengths_prompts, seed=1):
    """Rows as `template.render` gives them: a prompt labelled -100, then the response."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n, prompt in lengths_prompts:
        ids = torch.randint(3, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_changes_no_example(attn):
    model = tiny_llama(attn)
    require_packable(model)
    # a plain-text row (prompt 0) after another row: its first label must not be predicted across examples
    rows = random_rows([(9, 4), (3, 1), (12, 5), (5, 0), (7, 3), (2, 1)])
    packed, plain = pack(rows, max_length=16, pad_id=PAD), unpacked(rows, pad_id=PAD)
    with torch.no_grad():
        packed_sum, packed_n = response_nll(model, packed)
        plain_sum, plain_n = response_nll(model, plain)
        packed_logits = model(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"],
                              position_ids=packed["position_ids"]).logits
        plain_logits = model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"]).logits
    assert packed["input_ids"].shape[0] < len(rows)
    assert int(packed_n.sum()) == int(plain_n.sum())
    assert float(packed_sum.sum()) == pytest.approx(float(plain_sum.sum()), abs=1e-5)
    assert (packed["input_ids"] == PAD).sum() < (plain["input_ids"] == PAD).sum()
    # each example's logits, found where first-fit put it (an example starts where positions restart)
    ids, width = packed["input_ids"], packed["input_ids"].shape[1]
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[0]
        (b, t), = [(b, t) for b, t in (packed["position_ids"] == 0).nonzero().tolist()
                   if t + n <= width and torch.equal(ids[b, t:t + n], row["input_ids"])]
        torch.testing.assert_close(packed_logits[b, t:t + n], plain_logits[i, :n], atol=1e-5, rtol=0)


def test_packing_is_first_fit_in_order():
    rows = random_rows([(9, 1), (8, 1), (6, 1), (1, 0)])
    packed = pack(rows, max_length=16, pad_id=PAD)
    # 9 opens a sequence; 8 does not fit it (7 left) and opens another; 6 fits the first; 1 the first (1 left)
    assert packed["input_ids"].shape == (2, 16)
    assert packed["position_ids"][0].tolist() == list(range(9)) + list(range(6)) + [0]
    assert torch.equal(packed["input_ids"][0, 9:15], rows[2]["input_ids"])
    assert int((packed["labels"] == -100).sum()) == 4 + 8  # each example's first label, and the padding
    with pytest.raises(ValueError, match="does not fit"):
        pack(rows, max_length=8, pad_id=PAD)


def test_packing_refuses_an_attention_that_ignores_the_mask():
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="task.packing"):
        require_packable(model)


def test_token_nll_shifts_and_skips_the_prompt():
    logits = torch.randn(1, 4, VOCAB)
    labels = torch.tensor([[-100, -100, 7, 9]])
    nll = token_nll(logits, labels)
    by_hand = [0.0, -torch.log_softmax(logits[0, 1], -1)[7], -torch.log_softmax(logits[0, 2], -1)[9]]
    torch.testing.assert_close(nll[0], torch.tensor(by_hand), atol=1e-6, rtol=0)


def test_option_loglikelihoods_equal_a_hand_computation():
    model = tiny_llama()
    prompt = [1, 11, 12, 13, 14]
    options = [[21], [22, 23], [24, 25, 26]]
    scores = option_loglikelihoods(model, prompt, options)
    by_hand = []
    with torch.no_grad():
        for option in options:
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + option])).logits[0].float(), -1)
            total = 0.0
            for k, token in enumerate(option):
                total += float(logp[len(prompt) - 1 + k, token])
            by_hand.append(total)
    assert scores == pytest.approx(by_hand, abs=1e-5)
    assert max(range(3), key=scores.__getitem__) == max(range(3), key=by_hand.__getitem__)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_multiple_choice_equals_one_record_at_a_time(attn):
    """The fast path (one prompt pass for one-token options, left-padded; one right-padded batch for the
    rest) gives every record's scores as the per-record path does, to 1e-5, whatever mix of prompt
    lengths and option shapes shares the batch."""
    model = tiny_llama(attn)
    g = torch.Generator().manual_seed(3)
    prompts = [[1, *torch.randint(3, VOCAB, (n,), generator=g).tolist()] for n in (4, 17, 1, 9, 30, 6)]
    options = [[[21], [22], [23]], [[21], [22, 23], [24, 25, 26]], [[30], [31]], [[40, 41], [42]],
               [[5], [6], [7], [8]], [[9, 10, 11]]]
    fast = batched_option_loglikelihoods(model, prompts, options)
    slow = [option_loglikelihoods(model, p, o) for p, o in zip(prompts, options)]
    for got, want in zip(fast, slow):
        assert got == pytest.approx(want, abs=1e-5)
    assert [len(s) for s in fast] == [len(o) for o in options]
    with pytest.raises(ValueError, match="non-empty"):
        batched_option_loglikelihoods(model, [[1, 2], []], [[[3]], [[4]]])


def test_options_are_tokenised_alone():
    tok = tiny_tokenizer()
    ids = options_ids(tok, ["yes", "no", "maybe"])
    assert [tok.decode(i) for i in ids] == ["yes", "no", "maybe"]
    assert tok.bos_token_id not in sum(ids, [])


def test_batched_greedy_equals_one_at_a_time():
    model = tiny_llama()
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 30], [1, 40, 41, 42]]
    batched = greedy_generate(model, prompts, max_new_tokens=6, eos_id=EOS, pad_id=PAD)
    alone = [greedy_generate(model, [p], max_new_tokens=6, eos_id=EOS, pad_id=PAD)[0] for p in prompts]
    assert batched == alone
    assert all(EOS not in a for a in batched)


def test_greedy_stops_before_eos():
    model = tiny_llama()
    prompt = [1, 30, 31]
    first = greedy_generate(model, [prompt], max_new_tokens=8, eos_id=EOS, pad_id=PAD)[0]
    stop = next(t for t in first if t != first[0])  # declare a later token the EOS: the answer ends before it
    cut = greedy_generate(model, [prompt], max_new_tokens=8, eos_id=stop, pad_id=PAD)[0]
    assert 0 < len(cut) == first.index(stop) and cut == first[:len(cut)]


def test_final_number_variants():
    assert extract_final_number("so 3 + 4 = 7\n#### 1,000.") == "1000"
    assert extract_final_number("#### -3") == "-3"
    assert extract_final_number("#### 4\nand then #### 5") == "5"
    assert extract_final_number("the answer is 72") is None
    assert extract_final_number("####72") is None  # strict: one space after ####
    assert same_number("72", "72.0") and same_number("-3", "-3.00")
    assert not same_number("72", "27") and not same_number(None, "72") and not same_number("1.2.3", "1.2")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="../shared/data/instruct/gsm8k is absent")
def test_final_number_of_real_gsm8k_answers():
    with GSM8K_TEST.open(encoding="utf-8") as f:
        answers = [json.loads(line)["answer"] for _, line in zip(range(200), f)]
    assert len(answers) == 200
    for answer in answers:
        number = extract_final_number(answer)
        assert number is not None, answer[-40:]
        assert same_number(number, answer.rsplit("####", 1)[1].strip().replace(",", "")), answer[-40:]
        assert extract_final_number(answer + "\n") == number
