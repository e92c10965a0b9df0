"""The misuse cases of finetune.py, python -m tpzoo.data, python -m tpzoo.convert and python -m tpzoo.generate
(``TOOL_CASES``; pretrain.py's, and the table's format: ``misuse_cases``)."""

from __future__ import annotations

from families import CAUSAL_LM

FT = "--load {masked_lm} --epochs 1 --global-batch-size 8 --micro-batch-size 4 --seq-length 16"
FG = "--load {causal_lm} --epochs 1 --global-batch-size 8 --micro-batch-size 4 --seq-length 16"
FILES = "--train-data {train} --valid-data {valid}"
GEN = "--load {causal_lm} --prompt 'the cat'"

TOOL_CASES: dict[str, tuple[str, str, str]] = {
    # finetune.py
    "finetune-no-load": ("finetune", "--task demo", "--load is required"),
    "finetune-load-missing": ("finetune", "--load nowhere --task demo", "nowhere does not exist"),
    "finetune-load-empty-folder": ("finetune", "--load {empty_dir} --task demo", "holds no tpzoo checkpoint"),
    "finetune-load-file": ("finetune", "--load {a_file} --task demo", "holds no tpzoo checkpoint"),
    "finetune-load-hf-folder": ("finetune", "--load {hf} --task demo",
                                "convert it with python -m tpzoo.convert from-hf"),
    "finetune-no-data": ("finetune", FT, "no data: pass --task NAME"),
    "finetune-task-and-files": ("finetune", FT + " --task demo " + FILES, "either --task or --train-data"),
    "finetune-train-without-valid": ("finetune", FT + " --train-data {train}", "go together"),
    "finetune-train-data-folder": ("finetune", FT + " --train-data {task_dir} --valid-data {valid}", "is a folder"),
    "finetune-empty-train": ("finetune", FT + " --train-data {empty_jsonl} --valid-data {valid}", "is empty (0 bytes)"),
    "finetune-empty-valid": ("finetune", FT + " --train-data {train} --valid-data {empty_jsonl}", "is empty (0 bytes)"),
    "finetune-binary-train": ("finetune", FT + " --train-data {binary_jsonl} --valid-data {valid}",
                              "line 1 is not UTF-8 text"),
    "finetune-corrupt-train-line": ("finetune", FT + " --train-data {corrupt_train} --valid-data {valid}",
                                    "line 3, column"),
    "finetune-labels-mix-booleans-and-numbers": ("finetune", FT + " --train-data {mixed_labels_train} --valid-data "
                                                 "{valid}", "mixes label kinds: line 1 has True, line 3 1"),
    "finetune-numeric-text": ("finetune", FT + " --train-data {numeric_text_train} --valid-data {valid}",
                              "line 3: 'text' is a number (42), not text"),
    "finetune-null-text": ("finetune", FT + " --train-data {null_text_train} --valid-data {valid}",
                           "line 3: 'text' is missing or null, not text"),
    "finetune-all-empty-texts": ("finetune", FT + " --train-data {empty_texts_train} --valid-data {valid}",
                                 "holds no text: every row's 'text' is empty"),
    "finetune-seq-length-auto-empty-texts": ("finetune", FT.replace("--seq-length 16", "--seq-length auto")
                                             + " --train-data {empty_texts_train} --valid-data {valid}",
                                             "holds no text: every row's 'text' is empty"),
    "finetune-causal-numeric-text": ("finetune", FG + " --train-data {numeric_text_train} --valid-data {valid}",
                                     "line 3: 'text' is a number (42), not text"),
    "finetune-bad-label-in-train": ("finetune", FT + " --train-data {null_label_train} --valid-data {valid}",
                                    "null_label_train.jsonl"),
    "finetune-valid-label-unknown": ("finetune", FT + " --train-data {train} --valid-data {extra_label_valid}",
                                     "has labels ['7'] outside the known labels"),
    "finetune-no-label-column": ("finetune", FT + " --train-data {no_label_train} --valid-data {valid}",
                                 "has no column 'label'"),
    "finetune-one-label": ("finetune", FT + " --train-data {one_label_train} --valid-data {valid}",
                           "has only the label"),
    "finetune-ragged-csv": ("finetune", FT + " --train-data {ragged_csv} --valid-data {valid}",
                            "Expected 2 fields in line 3, saw 4"),
    "finetune-data-suffix": ("finetune", FT + " --train-data {tok} --valid-data {valid}", "the suffix must be"),
    "finetune-missing-train": ("finetune", FT + " --train-data nowhere.jsonl --valid-data {valid}",
                               "'nowhere.jsonl' does not exist"),
    "finetune-other-tokenizer": ("finetune", FT + " --task demo --tokenizer-model {other_tok}", "tokens but"),
    "finetune-missing-tokenizer": ("finetune", FT + " --task demo --tokenizer-model nowhere.model",
                                   "'nowhere.model' does not exist"),
    "finetune-glue-without-folder": ("finetune", FT + " --task sst-2", "needs the folder"),
    "finetune-glue-empty-folder": ("finetune", FT + " --task sst-2 --data-dir {empty_dir}",
                                   "empty_dir/train.tsv' does not exist"),
    "finetune-task-on-causal-lm": ("finetune", FG + " --task demo", "needs a checkpoint of a classifier family"),
    "finetune-causal-lm-no-text": ("finetune", FG + " --train-data {no_text_jsonl} --valid-data {texts}",
                                   "has no field 'text'"),
    "finetune-causal-lm-empty": ("finetune", FG + " --train-data {empty_jsonl} --valid-data {texts}",
                                 "is empty (0 bytes)"),
    "finetune-save-is-file": ("finetune", FT + " --task demo --save {a_file}", "is a file"),
    "finetune-log-dir-is-file": ("finetune", FT + " --task demo --log-dir {a_file}", "is a file"),
    "finetune-seq-length-word": ("finetune", FT + " --task demo --seq-length long", "argument --seq-length"),
    "finetune-seq-over-positions": ("finetune", FT + " --task demo --seq-length 4096",
                                    "exceeds --max-position-embeddings"),
    "finetune-zero-epochs": ("finetune", FT + " --task demo --epochs 0", "expected an integer >= 1, got 0"),
    "finetune-tp-over-world": ("finetune", FT + " --task demo --tp 2", "world size 1 is not divisible"),
    "finetune-batch-not-divisible": ("finetune", FT + " --task demo --global-batch-size 10",
                                     "global batch size 10 is not divisible"),
    "finetune-dropout-negative": ("finetune", FT + " --task demo --hidden-dropout=-0.1", "expected a number in [0, 1)"),
    "finetune-loss-scale-without-fp16": ("finetune", FT + " --task demo --initial-loss-scale 1024", "add --fp16"),
    "finetune-zero-max-skipped-steps": ("finetune", FT + " --task demo --max-skipped-steps 0",
                                        "argument --max-skipped-steps"),
    "finetune-fsdp-dp-1": ("finetune", FT + " --task demo --use-torch-fsdp2", "drop --use-torch-fsdp2 or launch more "
                           "ranks"),
    "finetune-unknown-task": ("finetune", FT + " --task sst3", "argument --task: invalid choice: 'sst3'"),
    # python -m tpzoo.data
    "data-preprocess-empty-input": ("data", "preprocess --input {empty_jsonl} --output-prefix o --tokenizer-model"
                                    " {tok}", "is empty (0 bytes)"),
    "data-preprocess-binary-input": ("data", "preprocess --input {binary_jsonl} --output-prefix o --tokenizer-model"
                                     " {tok}", "line 1 is not UTF-8 text"),
    "data-preprocess-corrupt-line": ("data", "preprocess --input {corrupt_jsonl} --output-prefix o --tokenizer-model"
                                     " {tok}", "line 3, column"),
    "data-preprocess-missing-input": ("data", "preprocess --input nowhere.jsonl --output-prefix o --tokenizer-model"
                                      " {tok}", "'nowhere.jsonl' does not exist"),
    "data-preprocess-garbage-tokenizer": ("data", "preprocess --input {corpus} --output-prefix o --tokenizer-model"
                                          " {corpus}", "is not a sentencepiece model"),
    "data-preprocess-partitions": ("data", "preprocess --input {corpus} --output-prefix o --tokenizer-model {tok}"
                                   " --partitions 2", "--partitions 2: tpzoo reads its input in one pass"),
    "data-preprocess-no-tokenizer": ("data", "preprocess --input {corpus} --output-prefix o",
                                     "preprocess needs a tokenizer"),
    "data-preprocess-zero-workers": ("data", "preprocess --input {corpus} --output-prefix o --tokenizer-model {tok}"
                                     " --workers 0", "argument --workers: expected an integer >= 1"),
    "data-preprocess-missing-key": ("data", "preprocess --input {corpus} --output-prefix o --tokenizer-model {tok}"
                                    " --json-key body", "key 'body' is not in"),
    "data-preprocess-number-key": ("data", "preprocess --input {train} --output-prefix o --tokenizer-model {tok}"
                                   " --json-key label", "line 1: 'label' is a number (1), not text"),
    "data-preprocess-output-under-file": ("data", "preprocess --input {corpus} --output-prefix {a_file}/o"
                                          " --tokenizer-model {tok}", "is a file"),
    "data-preprocess-output-is-folder": ("data", "preprocess --input {corpus} --output-prefix {empty_dir}/"
                                         " --tokenizer-model {tok}", "is a folder; give a file name prefix in it"),
    "data-train-tokenizer-empty-input": ("data", "train-tokenizer --input {empty_jsonl} --model-prefix t --vocab-size"
                                         " 100", "is empty (0 bytes)"),
    "data-train-tokenizer-binary-input": ("data", "train-tokenizer --input {binary_jsonl} --model-prefix t"
                                          " --vocab-size 100", "line 1 is not UTF-8 text"),
    "data-train-tokenizer-huge-vocab": ("data", "train-tokenizer --input {corpus} --model-prefix t --vocab-size 100000",
                                        "cannot train a 100000-token"),
    "data-train-tokenizer-negative-vocab": ("data", "train-tokenizer --input {corpus} --model-prefix t"
                                            " --vocab-size=-5", "argument --vocab-size: expected an integer >= 1"),
    "data-train-tokenizer-zero-sentences": ("data", "train-tokenizer --input {corpus} --model-prefix t --vocab-size"
                                            " 100 --max-sentences 0",
                                            "argument --max-sentences: expected an integer >= 1"),
    "data-train-tokenizer-prefix-under-file": ("data", "train-tokenizer --input {corpus} --model-prefix {a_file}/t"
                                               " --vocab-size 100", "is a file"),
    "data-inspect-truncated-bin": ("data", "inspect --data-path {truncated}", ".bin is cut short"),
    "data-inspect-garbage-idx": ("data", "inspect --data-path {garbage_idx}", "bad header"),
    "data-inspect-short-idx": ("data", "inspect --data-path {short_idx}", "is cut short"),
    "data-inspect-missing": ("data", "inspect --data-path nowhere", "nowhere.bin and nowhere.idx not found"),
    "data-inspect-folder": ("data", "inspect --data-path {truncated_dir}", "is a folder; pass the PREFIX of the "
                            "PREFIX.bin and PREFIX.idx in it, e.g."),
    "data-samples-truncated-bin": ("data", "samples --data-path {truncated} --seq-length 16", ".bin is cut short"),
    "data-samples-zero-seq-length": ("data", "samples --data-path {data} --seq-length 0",
                                     "argument --seq-length: expected an integer >= 1"),
    "data-samples-negative-index": ("data", "samples --data-path {data} --seq-length 16 --indices=-1",
                                    "argument --indices: expected an integer >= 0"),
    "data-samples-masked-lm-data-for-gpt": ("data", "samples --data-path {masked_lm_data} --seq-length 16",
                                            "without --append-eod"),
    "data-demo-export-is-file": ("data", "demo --export {a_file}", "is a file"),
    "data-no-command": ("data", "", "the following arguments are required: command"),
    # python -m tpzoo.convert
    "convert-no-direction": ("convert", "", "the following arguments are required"),
    "convert-bad-direction": ("convert", "sideways {hf} out", "invalid choice: 'sideways'"),
    "convert-source-missing": ("convert", "from-hf nowhere out", "nowhere is not a folder"),
    "convert-source-is-file": ("convert", "to-hf {a_file} out", "is not a folder"),
    "convert-out-is-file": ("convert", "from-hf {hf} {a_file}", "already exists and is not empty"),
    "convert-from-hf-empty-folder": ("convert", "from-hf {empty_dir} out", "has no config.json"),
    "convert-from-hf-garbage-config": ("convert", "from-hf {garbage_hf} out", "config.json is not valid JSON (line 1"),
    "convert-from-hf-unknown-architecture": ("convert", "from-hf {t5_hf} out", "has model_type 't5'"),
    "convert-from-hf-no-weights": ("convert", "from-hf {no_weights_hf} out", "has no model.safetensors"),
    "convert-from-hf-garbage-weights": ("convert", "from-hf {garbage_weights_hf} out",
                                        "model.safetensors is not a readable safetensors file"),
    "convert-from-hf-config-disagrees-with-weights": ("convert", "from-hf {wide_config_hf} out",
                                                      "weights disagree with config.json ("),
    "convert-from-hf-index-absolute-path": ("convert", "from-hf {absolute_index_hf} out",
                                            "a path outside the model folder"),
    "convert-from-hf-index-parent-path": ("convert", "from-hf {parent_index_hf} out",
                                          "names '../../hf/model.safetensors', a path outside the model folder"),
    "convert-from-hf-training-checkpoint": ("convert", "from-hf {causal_lm} out", "is not a Hugging Face model folder"),
    "convert-to-hf-of-hf-folder": ("convert", "to-hf {hf} out",
                                   f"is a Hugging Face config (model_type '{CAUSAL_LM.hf_model_type}')"),
    "convert-to-hf-empty-folder": ("convert", "to-hf {empty_dir} out", "holds no tpzoo checkpoint"),
    "convert-to-hf-garbage-config": ("convert", "to-hf {garbage_tz} out", "needs config.json and model.safetensors"),
    # python -m tpzoo.generate
    "generate-no-load": ("generate", "--prompt hi", "the following arguments are required: --load"),
    "generate-no-prompt": ("generate", "--load {causal_lm}", "the following arguments are required: --prompt"),
    # bytes of argv that are not UTF-8 reach Python as lone surrogates: here the byte 0xff
    "generate-prompt-not-utf8": ("generate", "--load {causal_lm} --prompt 'caf\udcff'",
                                 "argument --prompt: is not UTF-8 text (byte 0xff at character 3)"),
    "generate-load-missing": ("generate", "--load nowhere --prompt hi", "nowhere does not exist"),
    "generate-load-empty-folder": ("generate", "--load {empty_dir} --prompt hi", "holds no tpzoo checkpoint"),
    "generate-load-file": ("generate", "--load {a_file} --prompt hi", "holds no tpzoo checkpoint"),
    "generate-smaller-tokenizer": ("generate", GEN + " --tokenizer-model {other_tok}", "tokens but the model"),
    "generate-missing-tokenizer": ("generate", GEN + " --tokenizer-model nowhere.model",
                                   "'nowhere.model' does not exist"),
    "generate-load-hf-folder": ("generate", "--load {hf} --prompt hi",
                                "convert it with python -m tpzoo.convert from-hf"),
    "generate-masked-lm": ("generate", "--load {masked_lm} --prompt hi", "generation needs a causal LM"),
    "generate-negative-temperature": ("generate", GEN + " --temperature=-1",
                                      "argument --temperature: expected a number >= 0"),
    "generate-nan-temperature": ("generate", GEN + " --temperature nan",
                                 "argument --temperature: expected a number >= 0, got nan"),
    "generate-zero-top-p": ("generate", GEN + " --top-p 0", "0 < top_p <= 1"),
    "generate-negative-top-k": ("generate", GEN + " --top-k=-1", "argument --top-k: expected an integer >= 0"),
    "generate-negative-max-new-tokens": ("generate", GEN + " --max-new-tokens=-1",
                                         "argument --max-new-tokens: expected an integer >= 0"),
    "generate-word-max-new-tokens": ("generate", GEN + " --max-new-tokens many", "argument --max-new-tokens"),
    "generate-too-long": ("generate", GEN + " --max-new-tokens 100000", "exceeds max_position_embeddings"),
    "generate-empty-prompt": ("generate", "--load {causal_lm} --prompt ''", "encodes to no tokens"),
    "generate-tp-over-world": ("generate", GEN + " --tp 2", "world size 1 is not divisible"),
    "generate-zero-tp": ("generate", GEN + " --tp 0",
                         "argument --tensor-model-parallel-size/--tp: expected an integer >= 1"),
    "generate-zero-timeout": ("generate", GEN + " --distributed-timeout-minutes 0",
                              "argument --distributed-timeout-minutes: expected a number > 0"),
    "generate-unknown-flag": ("generate", GEN + " --beams 4", "unrecognized arguments: --beams"),
}
