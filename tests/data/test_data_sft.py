"""Instruction tuning's samples (``tpzoo.data.sft``): the loss on the answers only, by the plain template and
by a Hugging Face tokenizer's chat template; packed examples that give each example's own per-token losses
(attention and positions kept to each example) for a model of learned and one of rotary positions; the rows
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from families import CAUSAL_LM, GQA_LM

from tpzoo.data.demo import ANSWERS, demo_data, demo_files
from tpzoo.data.sft import SFTDataset, read_conversations
from tpzoo.data.tokenizer import load_tokenizer
from tpzoo.models.config import IGNORE_INDEX

pytestmark = pytest.mark.tier("unit")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "The soup was lovely."}, {"role": "assistant", "content": "positive"},
                {"role": "user", "content": "And the rooms?"}, {"role": "assistant", "content": "negative"}]


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(demo_data()[0])


def trained_text(tokenizer, dataset: SFTDataset, i: int = 0) -> list[str]:
    """The text of each run of tokens that carry a loss in packed sequence ``i`` (a target is the next token)."""
    sample = dataset[i]
    targets = [int(t) for t in sample["labels"]]
    runs, run = [], []
    for t in targets + [IGNORE_INDEX]:
        if t != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = runs + [tokenizer.decode(run)], []
    return runs


def test_plain_template_puts_the_loss_on_the_answers_only(demo_tokenizer):
    conversations = read_conversations(demo_files("instructions")[0])[:3]
    assert conversations[0][1]["content"] in ANSWERS and conversations[0][0]["role"] == "user"
    data = SFTDataset(conversations, demo_tokenizer, seq_length=256)
    assert (data.template, len(data)) == ("plain", 1)  # three short examples packed into one sequence
    sample = data[0]
    eod = demo_tokenizer.decode([demo_tokenizer.eod])
    assert trained_text(demo_tokenizer, data) == [f"{c[1]['content']}{eod}" for c in conversations]
    prompts = sum(len(demo_tokenizer.encode(c[0]["content"] + "\n")) for c in conversations)
    assert (sample["labels"] != IGNORE_INDEX).sum() + prompts == (sample["document_ids"] >= 0).sum()
    assert sample["document_ids"].unique().tolist() == [-1, 0, 1, 2]


def write_chat_tokenizer(folder):
    """A tiny byte-level BPE with ChatML's special tokens and template, as a Hugging Face checkpoint holds it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([m["content"] for m in CONVERSATION] * 20, vocab_size=300, show_progress=False,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(str(folder))
    return hf


def test_a_chat_template_formats_and_only_the_assistant_turns_carry_loss(tmp_path):
    hf = write_chat_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    data = SFTDataset([CONVERSATION], tokenizer, seq_length=128)
    assert data.template == "chat template"
    sample = data[0]
    real = sample["document_ids"] == 0
    assert tokenizer.decode(sample["input_ids"][real].tolist()) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert trained_text(tokenizer, data) == ["positive<|im_end|>\n", "negative<|im_end|>\n"]


@pytest.mark.parametrize("case", [CAUSAL_LM, GQA_LM], ids=["learned-positions", "rotary"])
def test_packed_examples_give_each_examples_own_losses(demo_tokenizer, case):
    conversations = read_conversations(demo_files("instructions")[1])[:5]
    packed = SFTDataset(conversations, demo_tokenizer, seq_length=120)
    assert len(packed) < len(conversations) and any(len(set(packed[i]["document_ids"].tolist())) > 2
                                                   for i in range(len(packed)))
    torch.manual_seed(0)
    model = case.model_class(case.config(hidden_dropout=0.0, attention_dropout=0.0)
                             if "hidden_dropout" in case.changes or case.family == "gpt" else case.config()).eval()
    alone = []
    for c in conversations:  # each example in a sequence of its own length: no packing, no padding
        one = SFTDataset([c], demo_tokenizer, seq_length=packed.lengths[len(alone)])[0]
        with torch.no_grad():
            loss = model(one["input_ids"][None], labels=one["labels"][None])[0]
        alone.append(loss[one["labels"] != IGNORE_INDEX])
    together = []
    for i in range(len(packed)):
        sample = packed[i]
        with torch.no_grad():
            loss = model(sample["input_ids"][None], labels=sample["labels"][None],
                         document_ids=sample["document_ids"][None])[0]
        together.append(loss[sample["labels"] != IGNORE_INDEX])
    expected, got = torch.cat(alone), torch.cat(together)
    assert got.shape == expected.shape and got.numel() > 0
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()
    without = model(packed[0]["input_ids"][None], labels=packed[0]["labels"][None])[0]  # no document_ids: it leaks
    assert not torch.allclose(without[packed[0]["labels"] != IGNORE_INDEX], together[0], rtol=1e-3)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi"}, "neither 'messages' nor 'response'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "the last message is the user's"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "each message needs a role"),
    ({"messages": []}, "'messages' must be a non-empty list"),
])
def test_rows_that_are_no_instruction_are_refused_naming_the_row(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl.*line 2.*{message}"):
        read_conversations(str(path))
