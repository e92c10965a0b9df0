"""Data for tpzoo: sentencepiece / Hugging Face tokenizers, memory-mapped indexed datasets and
their preprocessing, GPT and BERT samples, fine-tuning task readers, and the bundled demo.

Names load on first use, so ``python -m tpzoo.data`` starts without importing torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "tokenizer": ("Tokenizer", "load_tokenizer", "train_tokenizer"),
    "indexed": ("IndexedDataset", "IndexedDatasetBuilder", "token_dtype"),
    "preprocess": ("split_sentences",),  # the function preprocess: tpzoo.data.preprocess.preprocess
    "gpt_dataset": ("GPTDataset",),
    "bert_dataset": ("BertDataset",),
    "tasks": ("Example", "TaskDataset", "load_task", "read_examples"),
    "build": ("add_data_args", "build_datasets", "resolve_data", "samples_needed", "split_documents"),
    "demo": ("demo_data", "demo_task", "unigram_entropy"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tpzoo.data' has no attribute {name!r}")
    return getattr(import_module(f"tpzoo.data.{_MODULE_OF[name]}"), name)
