"""``python -m tpzoo.data preprocess`` with Megatron-LM's tools/preprocess_data.py flags and output
names, data made by Megatron-LM (no tpzoo metadata), --train/valid/test-data-path and --mock-data."""

import json
import os
import re
import shlex
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from doc_helpers import ROOT, blocks
from families import MASKED_LM
from megatron_vocab import megatron_files

from tpzoo.data.__main__ import main
from tpzoo.data.build import build_datasets
from tpzoo.data.data_args import DataConfig, add_data_args, run_data
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.mock import mock_documents
from tpzoo.data.tokenizer_types import BertWordPieceLowerCase, GPT2BPETokenizer, NullTokenizer
from tpzoo.training.args import command_parser

pytestmark = pytest.mark.tier("distributed")




VOCAB_JSON, MERGES = "gpt2-vocab.json", "gpt2-merges.txt"  # Megatron-LM's GPT-2 BPE files, as docs/data.md names them


def texts(key: str) -> list[str]:
    return [json.loads(line)[key] for line in Path(megatron_files()["corpus"]).read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """docs/data.md's Megatron-LM commands (GPT-2 data with 2 workers, BERT sentences), run in a folder
    holding its inputs, and the GPT-2 one again for two json keys with 1 worker (prefix ``w1``)."""
    root = tmp_path_factory.mktemp("megatron-data")
    f = megatron_files()
    for key, name in (("corpus", "corpus.jsonl"), ("vocab_json", VOCAB_JSON), ("merges", MERGES),
                      ("vocab_txt", "vocab.txt")):
        shutil.copy(f[key], root / name)
    lines = [line for block in blocks("data.md", "sh") for line in block.splitlines() if line.strip()]
    assert len(lines) == 2 and all(line.startswith("python -m tpzoo.data preprocess ") for line in lines)
    cwd = os.getcwd()
    try:
        os.chdir(root)
        for line in lines:
            assert main(shlex.split(line)[3:]) == 0, line
        gpt = shlex.split(lines[0])[3:]
        assert main([*gpt, "--output-prefix", "w1", "--json-keys", "text", "title", "--workers", "1",
                     "--log-interval", "20"]) == 0
    finally:
        os.chdir(cwd)
    return root


def run_flags(row: str) -> list[str]:
    """The flags of docs/data.md's table row of runs named ``row``."""
    [flags] = re.findall(rf"^\| {row} [^|]*\| `([^`]*)` \|$", (ROOT / "docs" / "data.md").read_text(), re.M)
    return shlex.split(flags)


def test_docs_run_flags_read_the_data(made):
    for row, kind, cls in (("GPT", "causal-lm", GPT2BPETokenizer), ("BERT", "masked-lm", BertWordPieceLowerCase)):
        flags = [a for a in run_flags(row) if a not in ("--model", MASKED_LM.family)]
        cwd = os.getcwd()
        try:
            os.chdir(made)
            tok, prefix, _ = run_data(parsed_data(*flags), kind)
            train, _, _ = build_datasets(kind, tok, prefix, 32, 7, (4, 0, 0), "949,50,1")
        finally:
            os.chdir(cwd)
        assert type(tok) is cls and train[3]["input_ids"].shape == (32,)


def test_megatron_names_and_documents_decode(made):
    outputs = [f"{p}.{s}" for p in ("my-gpt2_text_document", "w1_title_document", "w1_text_document",
                                    "my-bert_text_sentence") for s in ("bin", "idx")]
    inputs = ["corpus.jsonl", MERGES, VOCAB_JSON, "vocab.txt"]
    assert sorted(p.name for p in made.iterdir()) == sorted(outputs + inputs)
    tok = GPT2BPETokenizer(str(made / VOCAB_JSON), str(made / MERGES))
    for key in ("text", "title"):
        data = IndexedDataset(str(made / f"w1_{key}_document"))
        assert data.metadata["tokenizer"] == tok.reference()
        assert [tok.decode(data.document(d)) for d in range(data.num_documents)] == [
            t + "<|endoftext|>" for t in texts(key)]
    for suffix in ("bin", "idx"):  # the same bytes for 1 and 2 workers
        assert (made / f"my-gpt2_text_document.{suffix}").read_bytes() == (
            made / f"w1_text_document.{suffix}").read_bytes()


def test_split_sentences_for_bert(made):
    tok = BertWordPieceLowerCase(str(made / "vocab.txt"))
    data = IndexedDataset(str(made / "my-bert_text_sentence"))
    assert data.num_sequences > 2 * data.num_documents and data.metadata["split_sentences"]
    assert tok.sep not in data.tokens  # no --append-eod
    first = " ".join(tok.decode(data.sequence(k)) for k in range(data.document_indices[1]))
    assert first == tok.decode(tok.encode(texts("text")[0]))


def parse(*argv: str):
    parser = command_parser("test", "")
    add_data_args(parser)
    args = parser.parse_args(argv)
    args.seed = 7
    return args


def parsed_data(*argv: str) -> DataConfig:
    return DataConfig.of(vars(parse(*argv)))


def strip_metadata(prefix: str, to: Path) -> str:
    """A copy of ``prefix`` as Megatron-LM writes it: its .idx without tpzoo's metadata block."""
    idx = Path(prefix + ".idx").read_bytes()
    size = struct.unpack("<Q", idx[-16:-8])[0]
    (to / "m.idx").write_bytes(idx[:-16 - size])
    shutil.copy(prefix + ".bin", to / "m.bin")
    return str(to / "m")


def test_megatron_made_data_needs_tokenizer_flags(made, tmp_path):
    f = megatron_files()
    prefix = strip_metadata(str(made / "w1_text_document"), tmp_path)
    with pytest.raises(ValueError, match="names no tokenizer .*--vocab-file vocab.json --merge-file merges.txt"):
        run_data(parsed_data("--data-path", prefix), "causal-lm")
    tok, found, sources = run_data(parsed_data("--data-path", "1.0", prefix, "--vocab-file", f["vocab_json"],
                                         "--merge-file", f["merges"]), "causal-lm")
    assert (type(tok), found, sources) == (GPT2BPETokenizer, prefix, None)
    train, valid, _ = build_datasets("causal-lm", tok, prefix, 32, 7, (8, 4, 0), "949,50,1")
    assert train[0]["input_ids"].shape == (32,) and len(valid) == 4
    null, _, _ = run_data(parsed_data("--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                str(tok.vocab_size)), "causal-lm")  # the ids as they are
    assert null.vocab_size == tok.vocab_size and null.eod == tok.vocab_size - 1


def test_one_prefix_per_split(made):
    gpt = str(made / "w1_text_document")
    args = parse("--train-data-path", gpt, "--valid-data-path", str(made / "w1_title_document"))
    tok, prefix, sources = run_data(DataConfig.of(vars(args)), "causal-lm")
    assert prefix == gpt and sources.per_split == (gpt, str(made / "w1_title_document"), None)
    train, valid, test = build_datasets("causal-lm", tok, prefix, 16, 7, (4, 4, 0), args.split, sources)
    titles = IndexedDataset(sources.per_split[1])
    assert set(np.concatenate([valid[i]["input_ids"].numpy() for i in range(4)])) <= set(titles.tokens)
    assert test is None
    with pytest.raises(ValueError, match="4 samples are asked of a split without data: pass --test-data-path"):
        build_datasets("causal-lm", tok, prefix, 16, 7, (4, 4, 4), args.split, sources)


@pytest.mark.tier("unit")
@pytest.mark.parametrize("kind", ["causal-lm", "masked-lm"])
def test_mock_data(kind, tmp_path):
    tok = BertWordPieceLowerCase(megatron_files()["vocab_txt"]) if kind == "masked-lm" else NullTokenizer(64)
    docs = mock_documents(kind, tok, seed=3, num_documents=50)
    again = mock_documents(kind, tok, seed=3, num_documents=50)
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(docs, again))
    assert not np.array_equal(docs[0][0], mock_documents(kind, tok, seed=4, num_documents=1)[0][0])
    tokens = np.concatenate([d[0] for d in docs])
    if kind == "causal-lm":
        assert all(d[0][-1] == tok.eod and tok.eod not in d[0][:-1] for d in docs)
        assert tokens.min() >= 0 and tokens.max() == tok.eod
    else:
        assert not set(tokens) & set(tok.special_ids) and all(sum(d[1]) == len(d[0]) for d in docs)
    extra = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "64") if kind == "causal-lm" else (
        "--vocab-file", megatron_files()["vocab_txt"])
    args = parse("--mock-data", "--data-cache-path", str(tmp_path), *extra)
    tok, prefix, _ = run_data(DataConfig.of(vars(args)), kind)
    assert run_data(DataConfig.of(vars(args)), kind)[1] == prefix  # built once, then found
    train, valid, _ = build_datasets(kind, tok, prefix, 32, 7, (8, 4, 0), args.split)
    sample = train[5]
    assert sample["input_ids"].shape == (32,) and int(sample["input_ids"].max()) < tok.vocab_size
    with pytest.raises(ValueError, match="needs \\[CLS\\], \\[SEP\\] and \\[MASK\\] ids"):
        mock_documents("masked-lm", NullTokenizer(64), seed=0)


def test_num_workers_read_the_same_batches(tmp_path):
    import multiprocessing

    from tpzoo.data.batches import global_batches
    from tpzoo.data.loader import BatchReader

    args = parse("--mock-data", "--data-cache-path", str(tmp_path), "--vocab-file", megatron_files()["vocab_txt"],
                 "--num-workers", "2")
    tok, prefix, _ = run_data(DataConfig.of(vars(args)), "masked-lm")
    train, _, _ = build_datasets("masked-lm", tok, prefix, 32, 7, (64, 0, 0), args.split)

    def ramp(consumed: int) -> int:  # 2, 2, 4, 4, ... as a batch ramp-up
        return 2 if consumed < 4 else 4

    others = set(multiprocessing.active_children())
    reader, state = BatchReader(train, args.num_workers, ramp), torch.get_rng_state()
    for start, size in [(0, 2), (2, 2), (4, 4), (8, 4), (20, 4), (24, 4)]:  # (20, 4): off the sequence, restarted
        got, want = reader.read(start, size), next(global_batches(train, size, torch.arange(start, start + size)))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (start, size)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's generator untouched
    with pytest.raises(ValueError, match="read\\(28, 2\\) but the batch schedule gives 4 samples at 28"):
        reader.read(28, 2)
    workers = set(multiprocessing.active_children()) - others
    assert len(workers) == args.num_workers
    reader.close()
    assert not workers & set(multiprocessing.active_children())  # the workers stopped and joined


@pytest.mark.tier("unit")
def test_blending_follows_megatrons_greedy_order():
    from tpzoo.data.blended import blend_sizes, blending_indices

    dataset_index, sample_index = blending_indices([0.25, 0.75], 8)  # by hand: the dataset furthest behind
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 1] and sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]
    weights = [0.2, 0.3, 0.5]
    dataset_index, sample_index = blending_indices(weights, 1000)
    for n in (10, 99, 1000):  # every prefix of the order within one sample of its share
        counts = np.bincount(dataset_index[:n], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1), (n, counts)
    assert all(np.bincount(dataset_index, minlength=3) <= blend_sizes(weights, 1000))
    assert blend_sizes(weights, 1000) == [201, 302, 503]  # ceil(ceil(1000 w) * 1.005)


def test_data_path_blend(made):
    gpt, titles = str(made / "w1_text_document"), str(made / "w1_title_document")
    args = parse("--data-path", "0.3", gpt, "0.7", titles, "--vocab-file", str(made / VOCAB_JSON),
                 "--merge-file", str(made / MERGES))
    tok, prefix, sources = run_data(DataConfig.of(vars(args)), "causal-lm")
    assert prefix == gpt and sources.blend == ((0.3, gpt), (0.7, titles))
    train, valid, _ = build_datasets("causal-lm", tok, prefix, 8, 7, (20, 10, 0), "80,20,0", sources)
    assert len(train) == 20 and len(valid) == 10 and train.dataset_index.tolist().count(0) == 6
    title_tokens = set(IndexedDataset(titles).tokens)
    for i in range(20):  # each sample is a window of the prefix the blend names
        from_titles = set(train[i]["input_ids"].tolist()) <= title_tokens
        assert from_titles or train.dataset_index[i] == 0
    again = build_datasets("causal-lm", tok, prefix, 8, 7, (20, 10, 0), "80,20,0", sources)[0]
    assert all(torch.equal(again[i]["input_ids"], train[i]["input_ids"]) for i in range(20))
    for bad in (["0.5", gpt, "0.5"], ["0.5", gpt, "-1", titles]):
        with pytest.raises(SystemExit):
            parse("--data-path", *bad)
