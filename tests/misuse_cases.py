"""The misuse cases of the five commands, as a table (run by ``misuse_runner``, asserted by
``test_misuse``): ``CASES[name] = (command, argv, fragment)``. argv is one string with
``{placeholders}`` (the inputs ``misuse_runner.prepare`` makes) split by shlex; fragment is what the
command's one stderr line must contain (the other commands' cases: ``misuse_cases_tools``). ``RANK_CASES``
run at world size 2. The families, presets and
model classes named come from ``families``; ``{causal_lm}`` and ``{masked_lm}`` are checkpoints of its
``CAUSAL_LM`` and ``MASKED_LM``."""

from __future__ import annotations

from families import CAUSAL_LM, CAUSAL_LM_SMALL, MASKED_LM, MASKED_LM_BASE, MOE_LM, PRETRAIN_DEFAULT
from misuse_cases_tools import FT, GEN, TOOL_CASES

PROGS = {"pretrain": "pretrain.py", "finetune": "finetune.py", "data": "python -m tpzoo.data",
         "convert": "python -m tpzoo.convert", "generate": "python -m tpzoo.generate"}
# the model of every pretrain.py run here (tests/pretrain_helpers.py's TINY, two steps)
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --global-batch-size 8 "
        "--micro-batch-size 1 --hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 2 --log-interval 1 "
        "--train-iters 2")
T = TINY
DS = T + " --data-cache-path {cache} --dataset"  # into a cache of the runner's, not the user's

CASES: dict[str, tuple[str, str, str]] = {
    # pretrain.py: where checkpoints go
    "pretrain-save-holds-a-file-named-like-a-checkpoint": ("pretrain", T + " --save {file_iter_save}",
                                                           "iter_0000040 is a file, where a checkpoint's folder goes"),
    "pretrain-latest-names-a-file": ("pretrain", T + " --load {latest_names_file} --save elsewhere",
                                     "iter_0000040 is a file, not a checkpoint folder"),
    "pretrain-resume-into-a-file-named-like-a-checkpoint": ("pretrain", T + " --load {file_beside_checkpoints} "
                                                            "--train-iters 40 --save-interval 20",
                                                            "iter_0000040 is a file, where a checkpoint's folder goes"),
    "pretrain-resume-garbage-metrics": ("pretrain", T + " --train-iters 4 --load {garbage_metrics}",
                                        "metrics.jsonl line 2 is not a metrics record (no int iteration)"),
    "pretrain-resume-meta-train-iters-forty": ("pretrain", "--load {forty_train_iters}",
                                               "its meta.json records --train-iters 'forty', which must be an int"),
    # sizes no machine holds (the model's state, the sample index), refused before they are allocated
    "pretrain-train-iters-beyond-memory": ("pretrain", T + " --train-iters 1000000000000",
                                           "8,000,000,000,000 train samples of 16 tokens"),
    "pretrain-vocab-multiple-beyond-memory": ("pretrain", T + " --make-vocab-size-divisible-by 1000000000 "
                                              "--hidden-size 4096", "vocabulary padded to 1,000,000,000"),
    "pretrain-hidden-size-beyond-memory": ("pretrain", T + " --hidden-size 10000000", "hidden 10,000,000"),
    "pretrain-num-layers-beyond-memory": ("pretrain", T + " --num-layers 1000000 --hidden-size 1024",
                                          "(1,000,000 layers, hidden 1,024"),
    "pretrain-seed-too-large": ("pretrain", T + " --seed 99999999999999999999999",
                                "expected a seed in [0, 4294967295] (32 bits)"),
    # pretrain.py: data
    "pretrain-empty-dataset": ("pretrain", DS + " {empty_jsonl} --tokenizer-model {tok}", "is empty (0 bytes)"),
    "pretrain-binary-dataset": ("pretrain", DS + " {binary_jsonl} --tokenizer-model {tok}", "line 1 is not UTF-8 text"),
    "pretrain-missing-dataset": ("pretrain", DS + " nowhere.jsonl --tokenizer-model {tok}",
                                 "'nowhere.jsonl' does not exist"),
    "pretrain-dataset-suffix": ("pretrain", DS + " {tok} --tokenizer-model {tok}", "the suffix must be"),
    "pretrain-dataset-empty-folder": ("pretrain", DS + " {empty_dir} --tokenizer-model {tok}", "holds no .json/.jsonl"),
    "pretrain-dataset-no-tokenizer": ("pretrain", DS + " {corpus}", "--dataset needs --tokenizer-model"),
    "pretrain-dataset-and-data-path": ("pretrain", DS + " {corpus} --data-path {data} --tokenizer-model {tok}",
                                       "pass one data source"),
    "pretrain-dataset-no-text-key": ("pretrain", DS + " {no_text_jsonl} --tokenizer-model {tok}",
                                     "key 'text' is not in"),
    "pretrain-dataset-row-missing-text": ("pretrain", DS + " {missing_text_jsonl} --tokenizer-model {tok}",
                                          "missing_text.jsonl' line 2: 'text' is missing or null, not text"),
    "pretrain-dataset-array-lines": ("pretrain", DS + " {array_lines_jsonl} --tokenizer-model {tok}",
                                     "line 1 holds an array, not an object"),
    "pretrain-dataset-corrupt-line": ("pretrain", DS + " {corrupt_jsonl} --tokenizer-model {tok}", "line 3, column"),
    "pretrain-dataset-not-cached": ("pretrain", DS + " tpzoo-tests/never-cached --tokenizer-model {tok}",
                                    "is not in the datasets cache"),
    "pretrain-dataset-unknown-split": ("pretrain", DS + " {saved_dict} --dataset-split test --tokenizer-model {tok}",
                                       "split 'test' is not in save_to_disk folder"),
    "pretrain-dataset-split-of-files": ("pretrain", DS + " {corpus} --dataset-split test --tokenizer-model {tok}",
                                        "--dataset-split picks a split of a dataset name"),
    "pretrain-dataset-config-alone": ("pretrain", T + " --dataset-config small", "--dataset-config goes with --dataset"),
    "pretrain-truncated-bin": ("pretrain", T + " --data-path {truncated}", ".bin is cut short"),
    "pretrain-garbage-idx": ("pretrain", T + " --data-path {garbage_idx}", "bad header"),
    "pretrain-short-idx": ("pretrain", T + " --data-path {short_idx}", "is cut short"),
    "pretrain-missing-data-path": ("pretrain", T + " --data-path nowhere/corpus", "nowhere/corpus.bin"),
    "pretrain-data-path-folder": ("pretrain", T + " --data-path {empty_dir}", "is a folder; pass the PREFIX"),
    "pretrain-masked-lm-data-for-gpt": ("pretrain", T + " --data-path {masked_lm_data}", "without --append-eod"),
    "pretrain-data-path-odd-blend": ("pretrain", T + " --data-path 0.5 {data} 0.5",
                                     "pass PREFIX or WEIGHT PREFIX pairs with weights > 0"),
    "pretrain-train-data-path-blend": ("pretrain", T + " --train-data-path 0.5 {data} 0.5 {data}",
                                       "pass one PREFIX (a blend of weighted prefixes is --data-path's)"),
    "pretrain-valid-without-train": ("pretrain", T + " --valid-data-path {data}", "needs --train-data-path beside it"),
    "pretrain-two-data-sources": ("pretrain", T + " --mock-data --data-path {data}", "pass one data source, not"),
    "pretrain-mock-no-tokenizer": ("pretrain", T + " --mock-data", "--mock-data draws tokens from a tokenizer's"),
    "pretrain-tokenizer-type-refused": ("pretrain", T + " --tokenizer-type TikTokenizer",
                                        "--tokenizer-type TikTokenizer is a Megatron-LM tokenizer tpzoo does not"),
    "pretrain-gpt2-bpe-no-merges": ("pretrain", T + " --tokenizer-type GPT2BPETokenizer --vocab-file {tok}",
                                    "GPT2BPETokenizer lacks --merge-file: it takes --vocab-file and --merge-file"),
    "pretrain-null-vocab-below-data": ("pretrain", T + " --data-path {data} --tokenizer-type NullTokenizer "
                                       "--vocab-size 8", "holds token ids up to"),
    "pretrain-missing-tokenizer": ("pretrain", T + " --data-path {data} --tokenizer-model nowhere.model",
                                   "'nowhere.model' does not exist"),
    "pretrain-tokenizer-not-sentencepiece": ("pretrain", T + " --data-path {data} --tokenizer-model {corpus}",
                                             "is not a sentencepiece model"),
    "pretrain-tokenizer-empty-folder": ("pretrain", T + " --data-path {data} --tokenizer-model {empty_dir}",
                                        "holds no tokenizer.json"),
    "pretrain-tokenizer-of-other-data": ("pretrain", T + " --data-path {data} --tokenizer-model {other_tok}",
                                         "was tokenized with"),
    "pretrain-split-not-numbers": ("pretrain", T + " --split 1,x", "--split '1,x' must be"),
    "pretrain-split-negative": ("pretrain", T + " --split=-1,1,1", "must be up to three non-negative"),
    "pretrain-split-all-zero": ("pretrain", T + " --split 0,0,0", "must be up to three non-negative"),
    # pretrain.py: masked-LM samples (--mask-prob) and BERT's binary head, for the families that have them
    **{f"pretrain-mask-prob-{name}": ("pretrain", T + f" --model {MASKED_LM.family} --mask-prob {value}",
                                      f"argument --mask-prob: expected a number in (0, 1), got {value}")
       for name, value in (("zero", "0"), ("one", "1"), ("above-one", "1.5"))},
    "pretrain-mask-prob-causal-lm": ("pretrain", T + f" --model {CAUSAL_LM.family} --mask-prob 0.4",
                                     f"--mask-prob 0.4: --model {CAUSAL_LM.family} reads causal-lm data, which masks "
                                     f"no tokens"),
    "pretrain-bert-no-binary-head-causal-lm": ("pretrain", T + f" --model {CAUSAL_LM.family} --bert-no-binary-head",
                                               f"--bert-no-binary-head: --model {CAUSAL_LM.family} has no binary "
                                               f"(sentence-order) head to leave out"),
    # refused before torch loads: --print-config too
    "pretrain-bert-no-binary-head-causal-lm-print-config": ("pretrain", T + f" --model {CAUSAL_LM.family} "
                                                            "--bert-no-binary-head --print-config",
                                                            f"--bert-no-binary-head: --model {CAUSAL_LM.family} has "
                                                            f"no binary (sentence-order) head to leave out"),
    # pretrain.py: flags
    "pretrain-megatron-refused-flag": ("pretrain", T + " --mamba-num-heads 8",
                                       "--mamba-num-heads is a Megatron-LM flag tpzoo does not support: tpzoo has no"),
    "pretrain-moe-flag-on-a-dense-family": ("pretrain", T + f" --model {CAUSAL_LM.family} --num-experts 8",
                                            f"--model {CAUSAL_LM.family} disagrees with the architecture flags: "
                                            f"--num-experts 8 ({CAUSAL_LM.family}: no --num-experts); drop those flags "
                                            f"or pass --model {MOE_LM.family}"),
    "pretrain-moe-top-k-above-the-experts": ("pretrain", T + f" --model {MOE_LM.family} --num-experts 4 "
                                             "--moe-router-topk 5", "moe_router_topk=5 is more than num_experts=4"),
    "pretrain-ep-on-a-dense-family": ("pretrain", T + f" --model {CAUSAL_LM.family} --ep 2 --dp 2",
                                      f"--expert-model-parallel-size 2: --model {CAUSAL_LM.family} has no experts to "
                                      f"split; drop it"),
    "pretrain-ep-not-dividing-the-experts": ("pretrain", T + f" --model {MOE_LM.family} --num-experts 3 "
                                             "--moe-router-topk 2 --expert-model-parallel-size 2 --dp 2",
                                             "--expert-model-parallel-size 2 does not divide the 3 experts"),
    "pretrain-grouped-gemm-on-a-dense-family": ("pretrain", T + f" --model {CAUSAL_LM.family} --moe-grouped-gemm",
                                                f"--moe-grouped-gemm: --model {CAUSAL_LM.family} has no experts to "
                                                f"group; drop it"),
    "pretrain-capacity-factor-on-a-dense-family": ("pretrain", T + f" --model {CAUSAL_LM.family} "
                                                   "--moe-expert-capacity-factor 1.5",
                                                   "--moe-expert-capacity-factor does not apply to --model "
                                                   f"{CAUSAL_LM.family}"),
    "pretrain-moe-allgather-dispatcher": ("pretrain", T + f" --model {MOE_LM.family} --moe-token-dispatcher-type "
                                          "allgather", "invalid choice: 'allgather' (choose from 'alltoall')"),
    "pretrain-moe-no-balance-with-its-coefficient": ("pretrain", T + f" --model {MOE_LM.family} "
                                                     "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01",
                                                     "--moe-router-load-balancing-type none adds no load-balancing "
                                                     "loss for --moe-aux-loss-coeff 0.01 to weigh"),
    "pretrain-wandb-name-without-project": ("pretrain", T + " --wandb-exp-name tiny",
                                            "but W&B is off; add --wandb-project"),
    # test_misuse runs these with no W&B key anywhere and WANDB_MODE unset
    "pretrain-wandb-no-api-key": ("pretrain", T + " --wandb-project tiny", "run `wandb login`"),
    "pretrain-timing-log-level-3": ("pretrain", T + " --timing-log-level 3",
                                    "argument --timing-log-level: invalid choice"),
    "pretrain-lr-nan": ("pretrain", T + " --lr nan", "argument --lr: expected a number > 0"),
    "pretrain-lr-zero": ("pretrain", T + " --lr 0", "argument --lr: expected a number > 0, got 0"),
    "pretrain-min-lr-over-lr": ("pretrain", T + " --lr 0.001 --min-lr 0.01",
                                "--min-lr 0.01 must lie in [0, --lr 0.001]"),
    "pretrain-tp-over-world": ("pretrain", T + " --tp 2", "world size 1 is not divisible by tp x pp"),
    "pretrain-dp-over-world": ("pretrain", T + " --dp 2", "does not equal the world size 1"),
    "pretrain-batch-not-divisible": ("pretrain", T + " --global-batch-size 10 --micro-batch-size 4",
                                     "global batch size 10 is not divisible"),
    "pretrain-train-iters-and-samples": ("pretrain", T + " --train-samples 16",
                                         "--train-iters and --train-samples both set the run's length"),
    "pretrain-decay-samples-in-iteration-run": ("pretrain", T + " --lr-decay-samples 16",
                                                "--lr-decay-samples counts samples, but the run's length is "
                                                "--train-iters; give --lr-decay-iters"),
    "pretrain-warmup-fraction-and-iters": ("pretrain", T + " --lr-warmup-fraction 0.1",
                                           "--lr-warmup-fraction and --lr-warmup-iters both set the warmup"),
    "pretrain-optimizer-switch-on-resume": ("pretrain", T + " --load {causal_lm} --optimizer sgd",
                                            "--optimizer sgd cannot take over the adam state of --load"),
    "pretrain-rampup-increment": ("pretrain", T + " --rampup-batch-size 2 4 16", "global batch size 8 - start 2 = 6 "
                                  "must be >= 0 and divisible by the increment 4"),
    "pretrain-rampup-zero-samples": ("pretrain", T + " --rampup-batch-size 2 2 0", "--rampup-batch-size 2 2 0: a ramp "
                                     "from 2 to global batch size 8 needs SAMPLES > 0 to ramp over"),
    "pretrain-rampup-batch-vs-micro": ("pretrain", T + " --micro-batch-size 2 --rampup-batch-size 2 1 16",
                                       "global batch sizes [3, 5, 7] of the batch schedule are not multiples of micro "
                                       "batch size x dp = 2 x 1 = 2"),
    "pretrain-micro-over-global": ("pretrain", T + " --global-batch-size 4 --micro-batch-size 8",
                                   "global batch size 4 is not divisible"),
    "pretrain-heads-not-dividing": ("pretrain", T + " --hidden-size 30",
                                    "hidden_size=30 is not divisible by num_attention_heads=4"),
    "pretrain-seq-over-positions": ("pretrain", T + " --seq-length 4096", "exceeds --max-position-embeddings"),
    "pretrain-preset-other-family": ("pretrain", T + f" --preset {MASKED_LM_BASE}",
                                     f"is a {MASKED_LM.family} model but --model is {PRETRAIN_DEFAULT.family}"),
    "pretrain-query-groups-for-gpt": ("pretrain", T + " --num-query-groups 2", "--num-query-groups does not apply"),
    "pretrain-unknown-model": ("pretrain", T + " --model t5",
                               f"argument --model: unknown model family 't5'; known: {CAUSAL_LM.family}"),
    "pretrain-model-module-missing": ("pretrain", T + " --model no_such_module:FAMILY",
                                      "argument --model: no_such_module:FAMILY: no module 'no_such_module' to import; "
                                      "put the folder holding no_such_module on PYTHONPATH"),
    "pretrain-model-not-a-family": ("pretrain", T + " --model json:dumps", "argument --model: json:dumps: json has "
                                    "no tpzoo.models.Family named 'dumps' (found function)"),
    "pretrain-unknown-preset": ("pretrain", T + " --preset gpt3",
                                f"--preset gpt3: unknown preset; choose one of {CAUSAL_LM_SMALL}"),
    "pretrain-unknown-flag": ("pretrain", T + " --learning-rate 1", "unrecognized arguments: --learning-rate"),
    "pretrain-bf16-and-fp16": ("pretrain", T + " --bf16 --fp16", "argument --fp16: not allowed with argument --bf16"),
    "pretrain-dropout-one": ("pretrain", T + " --hidden-dropout 1", "expected a number in [0, 1), got 1"),
    "pretrain-negative-train-iters": ("pretrain", T + " --train-iters=-1", "expected an integer >= 0"),
    "pretrain-zero-eval-iters": ("pretrain", T + " --eval-iters 0", "expected an integer >= 1, got 0"),
    "pretrain-bad-schedule": ("pretrain", T + " --pipeline-schedule zigzag", "invalid choice: 'zigzag'"),
    "pretrain-fsdp-dp-1": ("pretrain", T + " --use-torch-fsdp2",
                           "but dp is 1 (world size 1, tp 1, pp 1): nothing to shard over; drop --use-torch-fsdp2 or "
                           "launch more ranks"),
    "pretrain-fsdp-distributed-optimizer": ("pretrain", T + " --use-torch-fsdp2 --use-distributed-optimizer --dp 2",
                                            "already shards the optimizer state over dp; drop "
                                            "--use-distributed-optimizer"),
    "pretrain-fsdp-zero-bubble": ("pretrain", T + " --use-torch-fsdp2 --pp 2 --dp 2 --pipeline-schedule "
                                  "interleaved-zero-bubble", "cannot run --pipeline-schedule interleaved-zero-bubble "
                                  "at pp 2"),
    "pretrain-vpp-without-pp": ("pretrain", T + " --vpp 2", "virtual_stages=2 needs an interleaved schedule"),
    "pretrain-zero-timeout": ("pretrain", T + " --distributed-timeout-minutes 0",
                              "argument --distributed-timeout-minutes: expected a number > 0"),
    "pretrain-zero-max-skipped-steps": ("pretrain", T + " --max-skipped-steps 0",
                                        "argument --max-skipped-steps: expected an integer >= 1"),
    "pretrain-zero-exit-interval": ("pretrain", T + " --exit-interval 0",
                                    "argument --exit-interval: expected an integer"),
    "pretrain-negative-exit-duration": ("pretrain", T + " --exit-duration-in-mins=-5",
                                        "argument --exit-duration-in-mins: expected a number > 0"),
    "pretrain-negative-loss-scale": ("pretrain", T + " --fp16 --loss-scale=-1",
                                     "argument --loss-scale: expected a number"),
    "pretrain-loss-scale-without-fp16": ("pretrain", T + " --loss-scale 128", "add --fp16"),
    "pretrain-min-over-initial-loss-scale": ("pretrain", T + " --fp16 --initial-loss-scale 4 --min-loss-scale 8",
                                             "exceeds initial_loss_scale"),
    "pretrain-zero-loss-scale-window": ("pretrain", T + " --fp16 --loss-scale-window 0",
                                        "argument --loss-scale-window: expected an integer >= 1"),
    # pretrain.py: paths
    "pretrain-save-is-file": ("pretrain", T + " --save {a_file}", "is a file"),
    "pretrain-log-dir-is-file": ("pretrain", T + " --log-dir {a_file}", "is a file"),
    "pretrain-save-under-file": ("pretrain", T + " --save {a_file}/run", "is a file"),
    "pretrain-cache-is-file": ("pretrain", T + " --dataset {corpus} --tokenizer-model {tok} --data-cache-path {a_file}",
                               "is a file"),
    "pretrain-load-missing": ("pretrain", T + " --load nowhere", "checkpoint nowhere does not exist"),
    "pretrain-load-empty-folder": ("pretrain", T + " --load {empty_dir}", "holds no tpzoo checkpoint"),
    "pretrain-load-file": ("pretrain", T + " --load {a_file}", "holds no tpzoo checkpoint"),
    "pretrain-load-other-shape": ("pretrain", T + " --load {causal_lm} --hidden-size 64", "hidden_size: checkpoint 32"),
    "pretrain-load-other-family": ("pretrain", T + f" --load {{causal_lm}} --model {MASKED_LM.family}",
                                   f"holds a {CAUSAL_LM.family} model"),
    "pretrain-load-other-tokenizer": ("pretrain", T + " --load {causal_lm} --tokenizer-model {other_tok}",
                                      "holds a model of"),
    "pretrain-load-hf-folder": ("pretrain", T + " --load {hf} --finetune",
                                f"is a Hugging Face folder (model_type '{CAUSAL_LM.hf_model_type}'); convert it "
                                "first: python -m tpzoo.convert"),
    "pretrain-load-model-folder-to-resume": ("pretrain", T + " --load {tz}", "is a model folder (weights, no training "
                                             "run to resume); add --finetune"),
    "pretrain-load-model-folder-other-family": ("pretrain", T + f" --load {{tz}} --finetune --model {MASKED_LM.family}",
                                                f"holds a {CAUSAL_LM.family} model but --model is {MASKED_LM.family}"),
    "pretrain-load-model-folder-other-shape": ("pretrain", T + " --load {tz} --finetune --hidden-size 64",
                                               "hidden_size: checkpoint 32"),
    # a model folder's or checkpoint's model is built as saved: its binary head stays
    **{f"pretrain-load-{name}-bert-no-binary-head": (
        "pretrain", T + f" --load {{{load}}}{finetune} --bert-no-binary-head",
        f"'s {MASKED_LM.model} has a binary head (it records options {MASKED_LM.options}), which loading it cannot "
        f"drop; drop the flag")
       for name, load, finetune in (("model-folder", "tz_masked_lm", " --finetune"), ("checkpoint", "masked_lm", ""))},
    "pretrain-load-bad-latest": ("pretrain", T + " --load {bad_latest}", "iter_0000009"),
    # pretrain.py: Megatron-LM's architecture, speed and checkpoint flags (tpzoo.training.architecture_args,
    # checkpoint_args)
    "pretrain-architecture-disagrees-with-model": ("pretrain", T + f" --model {CAUSAL_LM.family} --swiglu",
                                                   f"--model {CAUSAL_LM.family} disagrees with the architecture "
                                                   f"flags: --swiglu"),
    "pretrain-architecture-of-no-family": ("pretrain", T + " --position-embedding-type rope",
                                           "no model family has the architecture these flags describe; the nearest"),
    "pretrain-position-embedding-none": ("pretrain", T + " --position-embedding-type none",
                                         f"--position-embedding-type none ({CAUSAL_LM.family}: "
                                         f"--position-embedding-type learned_"),
    "pretrain-rotary-percent": ("pretrain", T + " --rotary-percent 0.5",
                                f"--model {PRETRAIN_DEFAULT.family} rotates every feature of a head"),
    "pretrain-rotary-base-without-rope": ("pretrain", T + " --rotary-base 500000",
                                          "--rotary-base applies to rotary positions"),
    "pretrain-kv-channels": ("pretrain", T + " --kv-channels 16", "hidden size / heads = 32 / 4 features each"),
    "pretrain-vocab-multiple-zero": ("pretrain", T + " --make-vocab-size-divisible-by 0",
                                     "argument --make-vocab-size-divisible-by: expected an integer >= 1"),
    "pretrain-flash-attn-and-local": ("pretrain", T + " --use-flash-attn --attention-backend local",
                                      "--use-flash-attn means --attention-backend sdpa"),
    "pretrain-no-fusion-with-triton": ("pretrain", T + " --kernels triton --no-masked-softmax-fusion",
                                       "mean --kernels torch, but --kernels is triton"),
    "pretrain-overlap-param-gather": ("pretrain", T + " --overlap-param-gather", "under --use-torch-fsdp2 only"),
    "pretrain-recompute-full-alone": ("pretrain", T + " --recompute-granularity full",
                                      "--recompute-granularity full needs --recompute-method"),
    "pretrain-recompute-two-ways": ("pretrain", T + " --recompute-activations --recompute-granularity selective",
                                    "both given; keep one"),
    "pretrain-recompute-method-selective": ("pretrain", T + " --recompute-granularity selective --recompute-method "
                                            "block", "for --recompute-granularity full only"),
    "pretrain-finetune-without-load": ("pretrain", T + " --finetune", "--finetune reads the checkpoint of --load"),
    # context parallelism and packed documents, refused before the mesh exists
    "pretrain-cp-not-dividing-the-sequence": ("pretrain", T + " --cp 3",
                                              "--context-parallel-size 3: sequence length 16 is not divisible by 2 x "
                                              "cp = 6 (a causal model's load-balanced cut); choose a multiple of 6"),
    "pretrain-cp-with-ep": ("pretrain", T + f" --model {MOE_LM.family} --cp 2 --ep 2",
                            "--context-parallel-size 2 with --expert-model-parallel-size 2: tpzoo does not combine"),
    "pretrain-cp-comm-type-unknown": ("pretrain", T + " --cp-comm-type allgather",
                                      "argument --cp-comm-type: invalid choice: 'allgather'"),
    "pretrain-document-flags-on-a-masked-lm": ("pretrain", T + f" --model {MASKED_LM.family} --reset-attention-mask",
                                               f"--reset-attention-mask: --model {MASKED_LM.family} reads masked-lm "
                                               f"data, whose samples are single documents"),
    # machines that come and go, HSDP, local SGD
    "pretrain-elastic-with-dp": ("pretrain", T + " --elastic --dp 2",
                                 "--elastic takes dp from each launch's world size, but --data-parallel-size is 2"),
    "pretrain-hsdp-without-fsdp": ("pretrain", T + " --num-distributed-optimizer-instances 2",
                                   "--num-distributed-optimizer-instances 2: tpzoo replicates FSDP's shards (HSDP) "
                                   "with --use-torch-fsdp2"),
    "pretrain-local-sgd-with-zero": ("pretrain", T + " --local-sgd-steps 4 --use-distributed-optimizer",
                                     "--local-sgd-steps 4: the distributed optimizer shards each replica's optimizer "
                                     "state over dp"),
    "pretrain-ft-flags-without-fault-tolerance": ("pretrain", T + " --ft-replica-groups 2",
                                                  "--ft-replica-groups 2 without --fault-tolerance"),
    "pretrain-ft-replica-id-beyond-groups": ("pretrain", T + " --fault-tolerance --ft-replica-id 2 "
                                             "--ft-replica-groups 2", "--ft-replica-id 2 and --ft-min-replicas 1 must "
                                             "be below and at most --ft-replica-groups 2"),
    "pretrain-ft-with-elastic": ("pretrain", T + " --fault-tolerance --elastic", "--fault-tolerance with --elastic"),
    "pretrain-ft-without-lighthouse": ("pretrain", T + " --fault-tolerance --ft-replica-groups 2",
                                       "--fault-tolerance needs the lighthouse's address in $TORCHFT_LIGHTHOUSE"),
    "pretrain-exit-on-missing-checkpoint": ("pretrain", T + " --save {empty_dir} --load {empty_dir} "
                                            "--exit-on-missing-checkpoint", "holds no checkpoint and "
                                            "--exit-on-missing-checkpoint is given"),
    **TOOL_CASES,
}

# cases at world size 2 (``run_on_rank`` on each rank of a spawn): rank 0 prints the one line, every rank exits 2
RANK_CASES: dict[str, tuple[str, str, str]] = {
    "pretrain-2-ranks-tp-4": ("pretrain", T + " --tp 4", "world size 2 is not divisible by tp x pp = 4 x 1"),
    "pretrain-2-ranks-dp-3": ("pretrain", T + " --dp 3",
                              "tp x pp x dp = 1 x 1 x 3 = 3 does not equal the world size 2"),
    "pretrain-2-ranks-fsdp-tp-2": ("pretrain", T + " --tp 2 --use-torch-fsdp2",
                                   "but dp is 1 (world size 2, tp 2, pp 1): nothing to shard over"),
    "pretrain-2-ranks-ep-not-dividing-dp": ("pretrain", T + f" --model {MOE_LM.family} --tp 2 --ep 2",
                                            "--expert-model-parallel-size 2 must divide the data-parallel size 1 "
                                            "(world size 2, tp 2, pp 1)"),
    "finetune-2-ranks-tp-4": ("finetune", FT + " --task demo --tp 4", "world size 2 is not divisible"),
    "generate-2-ranks-tp-4": ("generate", GEN + " --tp 4", "world size 2 is not divisible"),
    "pretrain-2-ranks-a2a-heads-not-dividing": ("pretrain", T + " --num-attention-heads 3 --hidden-size 48 --cp 2 "
                                                "--cp-comm-type a2a",
                                                "--cp-comm-type a2a splits the heads over tp x cp = 1 x 2 = 2 ranks, "
                                                "but num_attention_heads=3 is not divisible by 2"),
    "finetune-2-ranks-elastic-without-save": ("finetune", FT + " --task demo --elastic",
                                              "--elastic: finetune.py resumes a restarted run from its checkpoints; "
                                              "pass --save DIR"),
    "finetune-2-ranks-elastic-adapters-only": ("finetune", FT + " --task demo --elastic --save {empty_dir} "
                                               "--lora-rank 4 --save-adapters-only", "--elastic resumes from whole "
                                               "checkpoints, but --save-adapters-only saves the adapters alone"),
    "finetune-2-ranks-fault-tolerance": ("finetune", FT + " --task demo --fault-tolerance",
                                         "--fault-tolerance: finetune.py does not take a peer replica group's state"),
    "finetune-2-ranks-cp-2": ("finetune", FT + " --task demo --cp 2", "--context-parallel-size 2: finetune.py trains "
                              "at cp 1"),
    "generate-2-ranks-cp-2": ("generate", GEN + " --cp 2", "--context-parallel-size 2: generation decodes one "
                              "sequence whole"),
}
