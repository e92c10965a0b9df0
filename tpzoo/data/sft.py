"""Instruction tuning (SFT) samples: conversations formatted, tokenised, the loss on the answers only, and
examples packed into sequences without crossing.

    conversations = read_conversations("train.jsonl")   # rows {"prompt", "response"} or {"messages": [...]}
    dataset = SFTDataset(conversations, tokenizer, seq_length=256)
    dataset[0]   # {"input_ids": [s], "labels": [s], "document_ids": [s]}

A row is a prompt and its response, or chat ``messages`` ({"role": system | user | assistant, "content"}),
the last of them the assistant's. Formatting: the tokenizer's chat template when it has one (a Hugging
Face tokenizer folder whose ``tokenizer_config.json`` or ``chat_template.jinja`` holds it, rendered by
``transformers``), else the plain template: every message's content in order, each user or system message
followed by a newline, each assistant message by the end-of-document token. Only the assistant messages'
tokens carry a loss (labels -100 elsewhere), so the model learns the answers, never the prompts.

Packing: examples go, in order, into sequences of ``seq_length`` tokens, a new sequence when the next
example does not fit (one longer than ``seq_length`` is cut, and stands alone); ``document_ids`` number
the examples of a sequence (-1 on the padding), which the causal LM reads to keep each example to itself
(attention and positions, ``tpzoo.models.causal_lm``). ``labels[t]`` is the target of position t (the next
token), as ``CausalLMDataset``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from tpzoo.data.batches import ResizableSamples
from tpzoo.data.sources import one_file, row_place, rows, text_field
from tpzoo.models.config import IGNORE_INDEX

ROLES = ("system", "user", "assistant")
Segments = list[tuple[str, bool]]  # (text, whether its tokens carry a loss)


def _messages(row: dict[str, Any], path: str, number: int) -> list[dict[str, str]]:
    """The conversation of one row: ``messages``, or a prompt and a response; ValueError naming the row."""
    where = f"{path!r} {row_place(path, number)}"
    if row.get("messages") is not None:  # a file's rows share its fields: one without them holds None
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}, got {messages!r}")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: each message needs a role ({', '.join(ROLES)}) and a string content, "
                                 f"got {m!r}")
        if messages[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the last message is the {messages[-1]['role']}'s; a conversation to learn "
                             f"from ends with the assistant's answer")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    missing = [k for k in ("prompt", "response") if row.get(k) is None]
    if missing:
        raise ValueError(f"{where} has neither 'messages' nor {missing[0]!r} (its fields: "
                         f"{sorted(k for k, v in row.items() if v is not None)}); give each row a prompt and a "
                         f"response, or chat messages")
    return [{"role": "user", "content": text_field(row["prompt"], path, number, "prompt")},
            {"role": "assistant", "content": text_field(row["response"], path, number, "response")}]


def read_conversations(path: str) -> list[list[dict[str, str]]]:
    """The conversations of a jsonl file (see module docstring), in order."""
    path = one_file(path)
    out = [_messages(row, path, number) for number, row in enumerate(rows(path), 1)]
    if not out:
        raise ValueError(f"{path!r} holds no examples; fill it or pick another file")
    return out


def plain_segments(messages: list[dict[str, str]]) -> Segments:
    """The plain template: each message's content, a user or system one followed by a newline; the assistant's
    carry the loss (their end-of-document token is added by the caller, after each)."""
    return [(m["content"] + ("" if m["role"] == "assistant" else "\n"), m["role"] == "assistant") for m in messages]


def chat_template_of(tokenizer: Any) -> Callable[..., str] | None:
    """``render(messages, add_generation_prompt)`` by the chat template of ``tokenizer``'s folder (Hugging Face's
    ``apply_chat_template``), or None when it has none."""
    folder = tokenizer.path if os.path.isdir(tokenizer.path) else os.path.dirname(tokenizer.path)
    config = os.path.join(folder, "tokenizer_config.json")
    if getattr(tokenizer, "kind", None) != "huggingface" or not (
            os.path.isfile(os.path.join(folder, "chat_template.jinja"))
            or os.path.isfile(config) and "chat_template" in Path(config).read_text(encoding="utf-8")):
        return None
    from transformers import AutoTokenizer  # renders every template layout transformers writes

    hf = AutoTokenizer.from_pretrained(folder)
    if not hf.chat_template:
        return None
    return lambda messages, add_generation_prompt=False: hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def template_segments(render: Callable[..., str], messages: list[dict[str, str]]) -> Segments:
    """The conversation rendered by a chat template, cut where each assistant message starts and ends: the text
    of ``messages[:i]`` with the generation prompt, then of ``messages[:i + 1]`` (the answer, with what the
    template closes it with); ValueError where the template does not render a conversation as its prefixes."""
    out, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], add_generation_prompt=True), render(messages[:i + 1])
        if not before.startswith(done) or not upto.startswith(before):
            raise ValueError("the tokenizer's chat template does not render a conversation as the text of its "
                             "earlier turns followed by the new one; use a tokenizer without a template (the "
                             "plain template)")
        out += [(before[len(done):], False), (upto[len(before):], True)]
        done = upto
    rest = render(messages)[len(done):]
    return out + ([(rest, False)] if rest else [])


class SFTDataset(ResizableSamples):
    """Packed samples ``{"input_ids", "labels", "document_ids"}`` [s] (int64) of conversations (module docstring).
    ``lengths[i]``: the tokens example i takes; ``template``: "chat template" or "plain", the one used."""

    sample_name = "an instruction-tuning sequence"

    def __init__(self, conversations: list[list[dict[str, str]]], tokenizer: Any, seq_length: int) -> None:
        if tokenizer.eod is None:
            raise ValueError(f"tokenizer {tokenizer.path!r} has no end-of-document token")
        self.pad, self.min_length = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod, 2
        render = chat_template_of(tokenizer)
        self.template = "chat template" if render else "plain"
        self.examples = []  # (tokens, loss mask): the mask is True where the token is one to predict
        for messages in conversations:
            tokens, trained = [], []
            segments = template_segments(render, messages) if render else plain_segments(messages)
            for text, learn in segments:
                ids = tokenizer.encode(text) + ([tokenizer.eod] if learn and not render else [])
                tokens += ids
                trained += [learn] * len(ids)
            self.examples.append((tokens, trained))
        self.lengths = [len(tokens) for tokens, _ in self.examples]
        self.seq_length = seq_length

    def _resized(self) -> None:
        """Pack the examples anew: ``packs`` holds the example numbers of each sequence."""
        self.packs, used = [], self.seq_length
        for i, n in enumerate(self.lengths):
            n = min(n, self.seq_length)
            if used + n > self.seq_length:
                self.packs.append([])
                used = 0
            self.packs[-1].append(i)
            used += n

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels, docs = [], [], []
        for d, e in enumerate(self.packs[i]):
            tokens, trained = (x[:self.seq_length] for x in self.examples[e])
            ids += tokens
            labels += [t if learn else IGNORE_INDEX for t, learn in zip(tokens[1:], trained[1:])] + [IGNORE_INDEX]
            docs += [d] * len(tokens)
        pad = self.seq_length - len(ids)
        return {"input_ids": torch.tensor(ids + [self.pad] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad), "document_ids": torch.tensor(docs + [-1] * pad)}
