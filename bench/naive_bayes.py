"""The baseline a text classifier must beat: bag-of-words multinomial naive Bayes on finetune.py's files.

    python bench/naive_bayes.py --train-data train.jsonl --valid-data valid.jsonl

Words are lower-cased runs of letters, digits and underscores; class scores are log P(class) + sum of
log P(word | class) with add-one smoothing over the training vocabulary (words never seen in training
are left out). Prints one JSON line: the validation accuracy, the majority class's and the sizes.
Written here (30 lines) rather than taking scikit-learn, a 40 MB dependency with SciPy, for one baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter, defaultdict

from tpzoo.data.tasks import read_examples  # the examples finetune.py reads, its label checks included


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class NaiveBayes:
    """Multinomial naive Bayes over ``words``, add-one smoothing."""

    def __init__(self, rows: list[tuple[str, int]]) -> None:
        self.prior: Counter = Counter(label for _, label in rows)
        self.rows = len(rows)
        self.counts: dict[int, Counter] = defaultdict(Counter)
        for text, label in rows:
            self.counts[label].update(words(text))
        self.vocab = set().union(*self.counts.values())
        self.totals = {label: sum(c.values()) + len(self.vocab) for label, c in self.counts.items()}

    def score(self, text: str, label: int) -> float:
        counts, total = self.counts[label], self.totals[label]
        return math.log(self.prior[label] / self.rows) + sum(math.log((counts[w] + 1) / total) for w in words(text)
                                                 if w in self.vocab)

    def predict(self, text: str) -> int:
        return max(self.prior, key=lambda label: self.score(text, label))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-data", required=True, help="csv, tsv or jsonl with text and label")
    parser.add_argument("--valid-data", required=True)
    args = parser.parse_args(argv)
    try:
        examples, names = read_examples(args.train_data)
        valid_examples, _ = read_examples(args.valid_data, names)
    except (OSError, ValueError) as e:
        print(f"naive_bayes.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    train, valid = ([(" ".join(filter(None, (e.text, e.text_b))), e.label) for e in split]
                    for split in (examples, valid_examples))
    model = NaiveBayes(train)
    accuracy = sum(model.predict(text) == label for text, label in valid) / len(valid)
    majority = Counter(label for _, label in valid).most_common(1)[0][1] / len(valid)
    print(json.dumps({"accuracy": round(accuracy, 4), "majority_class": round(majority, 4), "train": len(train),
                      "valid": len(valid), "classes": len(model.prior)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
