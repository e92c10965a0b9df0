"""``--dataset`` through ``datasets``: a folder written by ``save_to_disk`` (a Dataset, or a
DatasetDict whose split ``--dataset-split`` picks) and a dataset name (with ``--dataset-config`` and
``--dataset-split``) that ``datasets`` resolves from its local cache, offline. The cache holds a
named dataset the way a download from the Hub leaves it: built by ``datasets``' own json builder from
a local dataset repository (README configs), filed under ``owner___name/config/version/hash``. Each is
tokenized through ``resolve_data`` into the tpzoo cache, keyed by what identifies the source.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import datasets
import pytest
from doc_helpers import blocks

from tpzoo.data.build import resolve_data
from tpzoo.data.demo import DEMO_TOKENIZER
from tpzoo.data.indexed import IndexedDataset
from tpzoo.data.sources import DatasetSource, absolute_specs
from tpzoo.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.tier("unit")



NAME, CONFIG = "tpzoo-tests/stories", "small"
SPLITS = {"train": [f"the cat sat on mat number {i}." for i in range(5)],
          "validation": ["a dog ran home.", "", "the bird sang twice."]}


def cache_named_dataset(cache: Path, repo: Path, name: str = NAME, config: str = CONFIG, key: str = "story") -> None:
    """Dataset ``name`` (``config``: ``SPLITS`` under the column ``key``) into the datasets cache ``cache``,
    with no network: the repo folder's README names the config's files; datasets' module factory and
    builder class for it prepare the arrow files, filed under the Hub name's folder (owner___name)."""
    from datasets.load import LocalDatasetModuleFactory, get_dataset_builder_class

    short = name.split("/")[1]
    (repo / config).mkdir(parents=True)
    files = ""
    for split, texts in SPLITS.items():
        (repo / config / f"{split}.jsonl").write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
        files += f"  - split: {split}\n    path: {config}/{split}.jsonl\n"
    (repo / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n")
    module = LocalDatasetModuleFactory(str(repo)).get_module()
    builder = get_dataset_builder_class(module, dataset_name=short)(
        cache_dir=str(cache), config_name=config, hash=module.hash, **{**module.builder_kwargs, "dataset_name": short})
    builder.download_and_prepare()
    (cache / short).rename(cache / name.replace("/", "___"))


def documents(prefix: str) -> list[list[int]]:
    data = IndexedDataset(prefix)
    return [data.document(d).tolist() for d in range(data.num_documents)]


def expected(texts: list[str]) -> list[list[int]]:
    """What a causal LM's cache holds for ``texts``: each non-empty one's tokens and end-of-document."""
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    return [tok.encode(t) + [tok.eod] for t in texts if t.strip()]


def tokenized(source: DatasetSource, cache: Path) -> str:
    return resolve_data("causal-lm", None, source, str(DEMO_TOKENIZER), str(cache))[1]


def test_save_to_disk_dataset_is_tokenized_once_and_again_when_it_changes(tmp_path):
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_dict({"text": SPLITS["train"]}).save_to_disk(folder)
    source = DatasetSource((folder,))
    assert source.kind == "saved"
    prefix = tokenized(source, tmp_path / "cache")
    assert documents(prefix) == expected(SPLITS["train"])
    assert IndexedDataset(prefix).metadata["inputs"] == [os.path.abspath(folder)]
    assert tokenized(source, tmp_path / "cache") == prefix  # found in the cache
    shutil.rmtree(folder)
    datasets.Dataset.from_dict({"text": SPLITS["train"][:2]}).save_to_disk(folder)  # the same folder, other content
    again = tokenized(source, tmp_path / "cache")
    assert again != prefix and documents(again) == expected(SPLITS["train"][:2])


def test_save_to_disk_dataset_dict_reads_the_split_asked(tmp_path):
    folder = str(tmp_path / "dict")
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"body": t}) for s, t in SPLITS.items()}).save_to_disk(folder)
    train = tokenized(DatasetSource((folder,), key="body"), tmp_path / "cache")
    valid = tokenized(DatasetSource((folder,), split="validation", key="body"), tmp_path / "cache")
    assert documents(train) == expected(SPLITS["train"]) and documents(valid) == expected(SPLITS["validation"])
    with pytest.raises(ValueError, match=r"split 'test' is not in save_to_disk folder .*its splits are train, "
                                         r"validation: pass --dataset-split"):
        tokenized(DatasetSource((folder,), split="test", key="body"), tmp_path / "cache")
    with pytest.raises(ValueError, match=r"column 'text' is not in .*\['body'\]: pass --json-key"):
        tokenized(DatasetSource((folder,)), tmp_path / "cache")


def test_cached_dataset_name_with_config_and_split_reads_offline(tmp_path, monkeypatch):
    cache_named_dataset(tmp_path / "hf", tmp_path / "repo")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    source = DatasetSource((NAME,), CONFIG, "validation", "story")
    assert source.kind == "name" and absolute_specs([NAME, "x.jsonl"]) == [NAME, os.path.abspath("x.jsonl")]
    prefix = tokenized(source, tmp_path / "cache")
    assert documents(prefix) == expected(SPLITS["validation"])
    assert "HF_DATASETS_OFFLINE" not in os.environ and not datasets.config.HF_HUB_OFFLINE  # set only while reading
    train = tokenized(DatasetSource((NAME,), CONFIG, None, "story"), tmp_path / "cache")
    assert train != prefix and documents(train) == expected(SPLITS["train"])
    with pytest.raises(ValueError, match=r"config 'big'\) is not in the datasets cache .*cached configs are "
                                         r"\['small'\]: pass --dataset-config"):
        tokenized(DatasetSource((NAME,), "big", None, "story"), tmp_path / "cache")
    with pytest.raises(ValueError, match=r"'tpzoo-tests/other' is not in the datasets cache .* on a machine with a "
                                         r"network run python -c \"import datasets; datasets.load_dataset"):
        tokenized(DatasetSource(("tpzoo-tests/other",)), tmp_path / "cache")


@pytest.mark.parametrize("source, message", [
    (DatasetSource(("corpus.jsonl",), split="train"), "--dataset-split picks a split of a dataset name"),
    (DatasetSource(("corpus.jsonl",), config="small"), "--dataset-config picks a configuration of a dataset name"),
], ids=["split-of-files", "config-of-files"])
def test_flags_that_name_no_part_of_files_are_refused(tmp_path, monkeypatch, source, message):
    (tmp_path / "corpus.jsonl").write_text('{"text": "the cat"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        source.open()


def test_docs_cached_name_command_runs_offline(tmp_path, monkeypatch, capsys):
    """The docs' command for a cached name (its ``shell`` block; the ``bash`` ones run in test_data_cli)."""
    from tpzoo.data.__main__ import main

    [line] = [line for block in blocks("data.md", "shell") for line in block.splitlines() if line.strip()]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "tpzoo.data"], line
    flags = dict(zip(argv, argv[1:]))
    cache_named_dataset(tmp_path / "hf", tmp_path / "repo", flags["--dataset"], flags["--dataset-config"], "text")
    shutil.copy(DEMO_TOKENIZER, tmp_path / flags["--tokenizer-model"])
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert main(argv[3:]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["documents"] == len(expected(SPLITS[flags["--dataset-split"]]))
