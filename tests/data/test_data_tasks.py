"""Fine-tuning tasks: generic csv/tsv/jsonl files, GLUE folders, the demo sentiment task, and
classifier samples."""

import collections
import json
import re

import pytest
import torch

from tpzoo.data import grammar
from tpzoo.data.demo import demo_data, demo_task
from tpzoo.data.tasks import Example, TaskDataset, UnknownLabels, load_task, read_examples
from tpzoo.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.tier("unit")



# One training and one dev row per task, in GLUE's own layouts (CoLA has no header row).
GLUE_FILES = {
    "CoLA": (
        "gj04\t1\t\tOur friends won't buy this analysis.\n",
        "gj04\t0\t*\tThey drank the pub.\n",
        "Our friends won't buy this analysis.",
        None,
        1,
    ),
    "SST-2": (
        "sentence\tlabel\nit 's a charming journey . \t1\n",
        "sentence\tlabel\na dull film . \t0\n",
        "it 's a charming journey . ",
        None,
        1,
    ),
    "MRPC": (
        'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t702977\tHe said "yes".\tHe agreed.\n',
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\tA cat.\tA dog.\n",
        'He said "yes".',
        "He agreed.",
        1,
    ),
    "QQP": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t1\t2\tWhy null?\tNA\t0\n",
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n2\t3\t4\tHow?\tHow so?\t1\n",
        "Why null?",
        "NA",
        0,
    ),
    "MNLI": (
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
        "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n0\t1\t1n\tgov\t( a )\t( b )\t(ROOT a)\t(ROOT b)\t"
        "It rains.\tIt is dry.\tcontradiction\tcontradiction\n",
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
        "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
        "0\t1\t1e\tfiction\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tA.\tB.\t"
        "neutral\tneutral\tneutral\tneutral\tneutral\tneutral\n",
        "It rains.",
        "It is dry.",
        0,
    ),
    "QNLI": (
        "index\tquestion\tsentence\tlabel\n0\tWho?\tNobody.\tnot_entailment\n",
        "index\tquestion\tsentence\tlabel\n0\tWhat?\tThat.\tentailment\n",
        "Who?",
        "Nobody.",
        1,
    ),
    "RTE": (
        "index\tsentence1\tsentence2\tlabel\n0\tA man sleeps.\tA man rests.\tentailment\n",
        "index\tsentence1\tsentence2\tlabel\n0\tX.\tY.\tnot_entailment\n",
        "A man sleeps.",
        "A man rests.",
        0,
    ),
}


@pytest.mark.parametrize("task", sorted(GLUE_FILES))
def test_glue_layouts(tmp_path, task):
    train, dev, text, text_b, label = GLUE_FILES[task]
    (tmp_path / "train.tsv").write_text(train)
    (tmp_path / ("dev_matched.tsv" if task == "MNLI" else "dev.tsv")).write_text(dev)
    examples, names = load_task(task, "train", str(tmp_path))
    assert examples == [Example(text, text_b, label)]
    valid, valid_names = load_task(task, "valid", str(tmp_path))
    assert len(valid) == 1 and valid_names == names and len(names) == (3 if task == "MNLI" else 2)


def test_generic_files(tmp_path):
    (tmp_path / "train.csv").write_text('text,text_b,label\n"a, b",c,pos\nhi,,neg\nok,,pos\n')
    (tmp_path / "valid.jsonl").write_text('{"text": "x", "label": "neg"}\n')
    (tmp_path / "test.tsv").write_text('text\tlabel\nsome "quote text\t2\n')
    examples, names = read_examples(str(tmp_path / "train.csv"))
    assert names == ["neg", "pos"]
    assert examples == [Example("a, b", "c", 1), Example("hi", None, 0), Example("ok", None, 1)]
    assert read_examples(str(tmp_path / "valid.jsonl"), names)[0] == [Example("x", None, 0)]
    examples, names = read_examples(str(tmp_path / "test.tsv"))
    assert examples == [Example('some "quote text', None, 0)] and names == ["2"]


def test_labels_become_ids_in_sorted_order(tmp_path):
    """K labels are ids 0..K-1, whatever their values: integers sorted numerically (2 before 10, in
    jsonl numbers or csv text alike), anything else sorted as strings; none is invented."""
    (tmp_path / "sparse.jsonl").write_text("".join(json.dumps({"text": "t", "label": y}) + "\n"
                                                   for y in (8, 1, 10, 2, 5, 2.0, -3)))
    examples, names = read_examples(str(tmp_path / "sparse.jsonl"))
    assert names == ["-3", "1", "2", "5", "8", "10"] and [e.label for e in examples] == [4, 1, 5, 2, 3, 2, 0]
    (tmp_path / "sparse.csv").write_text("text,label\na,10\nb,2\n")
    assert read_examples(str(tmp_path / "sparse.csv"))[1] == ["2", "10"]
    (tmp_path / "names.tsv").write_text("text\tlabel\na\tb10\nb\tb2\nc\t10\nd\tB\n")
    assert read_examples(str(tmp_path / "names.tsv"))[1] == ["10", "B", "b10", "b2"]


def test_task_misuse(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"sentence": "x", "label": 1}\n')
    with pytest.raises(ValueError, match="has no column 'text' \\(its columns are \\['label', 'sentence'\\]\\)"):
        read_examples(str(tmp_path / "a.jsonl"))
    (tmp_path / "b.jsonl").write_text('{"text": "x", "label": "maybe"}\n')
    with pytest.raises(UnknownLabels, match="labels \\['maybe'\\] outside the known labels \\['no', 'yes'\\]"):
        read_examples(str(tmp_path / "b.jsonl"), ["no", "yes"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_examples(str(tmp_path / "c.jsonl"))
    with pytest.raises(FileNotFoundError, match="train.tsv' does not exist"):
        load_task("rte", "train", str(tmp_path))
    with pytest.raises(ValueError, match="unknown task 'squad'; choose one of demo, cola"):
        load_task("squad")
    with pytest.raises(ValueError, match="needs the folder"):
        load_task("sst-2")
    (tmp_path / "bad.tsv").write_text("text\tlabel\na\tb\tc\td\n")
    with pytest.raises(ValueError, match="cannot parse .*bad.tsv"):
        read_examples(str(tmp_path / "bad.tsv"))


def test_task_samples():
    tok = load_tokenizer(demo_data()[0])
    examples = [Example("The soup was good.", None, 1), Example("The film was bad " * 20, "The show was dull.", 0)]
    ds = TaskDataset(examples, tok, 24)
    x = ds[0]
    a = tok.encode("The soup was good.")
    n = len(a) + 2
    assert x["input_ids"].tolist() == [tok.cls, *a, tok.sep] + [tok.pad] * (24 - n)
    assert x["attention_mask"].tolist() == [1] * n + [0] * (24 - n)
    assert x["token_type_ids"].tolist() == [0] * 24 and x["label"].item() == 1 and x["label"].dtype == torch.int64
    y = ds[1]  # the longer text is trimmed; the pair fills the sequence
    seps = (y["input_ids"] == tok.sep).nonzero().flatten().tolist()
    b = tok.encode("The show was dull.")
    assert y["attention_mask"].all() and seps[1] == 23 and y["input_ids"][seps[0] + 1 : 23].tolist() == b
    assert y["token_type_ids"].tolist() == [0] * (seps[0] + 1) + [1] * (23 - seps[0])


def _rule(text):
    """The label from the text alone: adjective polarity, flipped by 'not'; the last clause rules."""
    clause = re.split(r" but | and |, |that ", text.lower().rstrip("."))[-1]
    positive = any(w in grammar.POSITIVE for w in clause.split())
    return int(positive != (" not " in f" {clause} "))


def test_demo_task_labels_follow_the_text_but_no_single_word():
    train, valid = demo_task()
    rows = [json.loads(line) for path in (train, valid) for line in open(path)]
    assert len(rows) == 2500 and 0.45 < sum(r["label"] for r in rows) / len(rows) < 0.55
    assert all(_rule(r["text"]) == r["label"] for r in rows)
    positives, by_word = sum(r["label"] for r in rows), collections.defaultdict(list)
    for r in rows:
        for w in set(re.findall(r"[a-z]+", r["text"].lower())):
            by_word[w].append(r["label"])

    def accuracy(labels):  # the best rule "label = f(word present)"
        p_in, n_in = sum(labels), len(labels) - sum(labels)
        return (max(p_in, n_in) + max(positives - p_in, len(rows) - positives - n_in)) / len(rows)

    assert max(map(accuracy, by_word.values())) < 0.6  # no one word tells the label
    examples, names = load_task("demo", "valid")
    assert len(examples) == 500 and names == ["0", "1"]
