"""Data for tpzoo: sentencepiece / Hugging Face tokenizers, memory-mapped indexed datasets and
their preprocessing, GPT and BERT samples, fine-tuning task readers, and the bundled demo.

Names load on first use, so ``python -m tpzoo.data`` starts without importing torch.
"""

from tpzoo.lazy import lazy_exports

_EXPORTS = {
    "tokenizer": ("Tokenizer", "load_tokenizer", "train_tokenizer"),
    "indexed": ("IndexedDataset", "IndexedDatasetBuilder", "token_dtype"),
    "preprocess": ("split_sentences",),  # the function preprocess: tpzoo.data.preprocess.preprocess
    "gpt_dataset": ("GPTDataset",),
    "bert_dataset": ("BertDataset",),
    "tasks": ("Example", "TaskDataset", "load_task", "read_examples"),
    "build": ("build_datasets", "resolve_data", "samples_needed", "split_documents"),
    "data_args": ("add_data_args",),
    "demo": ("demo_data", "demo_files", "demo_task", "unigram_entropy"),
}
__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
