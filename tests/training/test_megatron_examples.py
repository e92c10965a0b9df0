"""Megatron-LM's example launch lines run unchanged: the argument arrays of
examples/gpt3/train_gpt3_175b_distributed.sh (the version with ``--rampup-batch-size 16 16 5859375`` that
issue #17 quotes) and examples/bert/train_bert_340m_distributed.sh, as written there, only their numbers
scaled down (a 2-layer model, 4 gloo ranks at tp 2 x pp 2, 8 iterations, evaluations and saves every 2).
Run by bash with ``torchrun`` = ``python -m torch.distributed.run``, from the repository root as
Megatron-LM's README runs them, on the script's positional arguments: checkpoint folder, TensorBoard
folder, vocab file(s), data prefix. The GPT-2 BPE vocab.json/merges.txt and the BERT WordPiece vocab.txt
are made by the ``tokenizers`` library from local text (tests/real_text.py); the data by ``python -m
tpzoo.data preprocess`` with Megatron-LM's tools/preprocess_data.py flags.

Each journey launches twice with ``--save`` and ``--load`` on the same folder: first as a job stopped by
its scheduler would be (the same line plus ``--exit-interval 4``: ``--load`` names a folder without a
checkpoint yet, so it starts from scratch), then the identical line, which resumes at iteration 4 and
runs to ``--train-iters 8``. Checked, each its own case: it trains (finite losses, the val loss of the same
batches falls; fp16 loss scaling),
evaluates, saves, writes TensorBoard events into ``--tensorboard-dir`` (read back with tensorboard's
EventAccumulator), resumes, and for GPT the batch ramp-up (batch 4 for 4 iterations, then 8).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import background
import pytest
from doc_helpers import ROOT, clean_env
from families import CAUSAL_LM
from pretrain_helpers import script
from real_text import documents, write_jsonl
from tpzoo.training.batch_schedule import BatchSchedule, parse_step_schedule

pytestmark = pytest.mark.tier("journey")


# torchrun of the scripts; one OpenMP thread per rank (4 ranks on 2 cores)
PRELUDE = f'torchrun() {{ "{sys.executable}" -m torch.distributed.run "$@"; }}\n'
STOPPED_AT, ITERS = 4, 8

# examples/gpt3/train_gpt3_175b_distributed.sh before Megatron-LM's c9e03d0c3b (--rampup-batch-size),
# from its first variable on; numbers scaled down, MASTER_PORT a free port (formatted in)
GPT3_175B = """
GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT={port}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 32
    --num-attention-heads 4
    --seq-length 32
    --max-position-embeddings 32
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --rampup-batch-size 4 4 16
    --train-iters 8
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-3
    --lr-decay-style cosine
    --min-lr 6.0e-4
    --lr-warmup-fraction .125
    --lr-decay-iters 8
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2
	--pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 2
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${{DISTRIBUTED_ARGS[@]}} pretrain_gpt.py \\
    ${{GPT_MODEL_ARGS[@]}} \\
    ${{TRAINING_ARGS[@]}} \\
    ${{MODEL_PARALLEL_ARGS[@]}} \\
    ${{DATA_ARGS[@]}} \\
    ${{EVAL_AND_LOGGING_ARGS[@]}}"""

# the current examples/gpt3/train_gpt3_175b_distributed.sh: the step schedule instead of the ramp-up (Megatron-LM's
# 532ad926b4), thresholds in tokens: 512 / --seq-length 32 = 16 samples, the batch sizes of the ramp-up above. The
# script's unquoted ${TRAINING_ARGS[@]} hands the schedule over as one word per step.
GPT3_175B_CURRENT = GPT3_175B.replace("    --rampup-batch-size 4 4 16\n",
                                      '    --step-batch-size-schedule "0:4 512:8"\n')

# examples/bert/train_bert_340m_distributed.sh from its first variable on; numbers scaled down
BERT_340M = """
GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT={port}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/bert-vocab.json
DATA_PATH=$4 #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

BERT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 32
    --num-attention-heads 4
    --seq-length 32
    --max-position-embeddings 32
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --train-iters 8
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.005
    --lr-decay-iters 8
    --lr-decay-style linear
    --min-lr 1.0e-4
    --weight-decay 1e-2
    --lr-warmup-fraction .125
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2
	--pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 2
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

torchrun ${{DISTRIBUTED_ARGS[@]}} pretrain_bert.py \\
    ${{BERT_MODEL_ARGS[@]}} \\
    ${{TRAINING_ARGS[@]}} \\
    ${{MODEL_PARALLEL_ARGS[@]}} \\
    ${{DATA_ARGS[@]}} \\
    ${{EVAL_AND_LOGGING_ARGS[@]}}"""


@dataclass
class Journey:
    """The two launches of one example (its positional arguments after the two folders) and what they wrote."""
    root: Path
    positional: list[str]
    launches: list[subprocess.CompletedProcess] = field(default_factory=list)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def metrics(self) -> dict[int, dict]:
        """metrics.jsonl of the run (both launches) by iteration."""
        lines = (self.checkpoints / "metrics.jsonl").read_text().splitlines()
        return {r["iteration"]: r for r in map(json.loads, lines)}


def sh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(background.niced(args), capture_output=True, text=True, cwd=cwd, env=clean_env(1),
                          timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def preprocess(root: Path, flags: list[str]) -> None:
    """``python -m tpzoo.data preprocess`` of the corpus with Megatron-LM's flags."""
    done = sh([sys.executable, "-m", "tpzoo.data", "preprocess", "--input", "corpus.jsonl", "--json-keys", "text",
               "--output-prefix", "corpus", *flags, "--workers", "1"], root)
    assert done.returncode == 0, done.stderr[-3000:]


def launch_twice(root: Path, script: str, positional: list[str]) -> Journey:
    """The script stopped by ``--exit-interval`` at STOPPED_AT, then the identical script (a resume)."""
    journey = Journey(root, positional)
    for extra in (f" --exit-interval {STOPPED_AT}", ""):
        text = PRELUDE + script.format(port=free_port()) + extra
        args = ["bash", "-c", text, "example", str(journey.checkpoints), str(journey.tensorboard), *positional]
        journey.launches.append(sh(args, ROOT))
        if journey.launches[-1].returncode != 0:
            break
    return journey


def corpus(tmp_path_factory, name: str) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp(name)
    texts = documents()
    write_jsonl(root / "corpus.jsonl", texts)
    return root, texts


@background.fixture
def gpt3(tmp_path_factory) -> Journey:
    from tokenizers import ByteLevelBPETokenizer
    root, texts = corpus(tmp_path_factory, "gpt3")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=600, special_tokens=["<|endoftext|>"])
    vocab, merges = bpe.save_model(str(root))  # vocab.json, merges.txt
    preprocess(root, ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                      "--append-eod"])
    return launch_twice(root, GPT3_175B, [vocab, merges, str(root / "corpus_text_document")])


@background.fixture
def bert(tmp_path_factory) -> Journey:
    from tokenizers import BertWordPieceTokenizer
    root, texts = corpus(tmp_path_factory, "bert340m")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=600)
    (vocab,) = wordpiece.save_model(str(root))  # vocab.txt
    preprocess(root, ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences"])
    return launch_twice(root, BERT_340M, [vocab, str(root / "corpus_text_sentence")])


def check_launches(journey: Journey) -> None:
    for i, done in enumerate(journey.launches):
        assert done.returncode == 0, f"launch {i + 1} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert len(journey.launches) == 2


def check_trains(journey: Journey) -> None:
    check_launches(journey)
    metrics = journey.metrics()
    losses = [metrics[i]["loss"] for i in range(1, ITERS + 1)]
    assert all(map(math.isfinite, losses)), losses
    assert metrics[ITERS]["val_loss"] < metrics[2]["val_loss"], "the val loss (the same batches) did not fall"


def check_fp16(journey: Journey) -> None:
    check_launches(journey)
    scales = [journey.metrics()[i].get("loss_scale") for i in range(1, ITERS + 1)]
    assert all(s is not None and s >= 1 for s in scales), f"--fp16 trains with a loss scale: {scales}"


def check_evaluates(journey: Journey) -> None:
    check_launches(journey)
    val = {i: r["val_loss"] for i, r in journey.metrics().items() if "val_loss" in r}
    assert sorted(val) == [2, 4, 6, 8] and all(map(math.isfinite, val.values())), val


def check_saves(journey: Journey) -> None:
    check_launches(journey)
    folders = sorted(p.name for p in journey.checkpoints.glob("iter_*"))
    assert folders == [f"iter_{i:07d}" for i in (2, 4, 6, 8)], folders
    assert (journey.checkpoints / "latest").is_file()


def check_tensorboard(journey: Journey) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    check_launches(journey)
    events = EventAccumulator(str(journey.tensorboard)).Reload() if journey.tensorboard.is_dir() else None
    assert events is not None, f"no --tensorboard-dir {journey.tensorboard}"
    tags = events.Tags()["scalars"]
    loss = next((t for t in tags if t.split("/")[-1] in ("loss", "lm loss", "lm_loss")), None)
    assert loss, f"no loss among the scalars {tags}"
    assert sorted({e.step for e in events.Scalars(loss)}) == list(range(1, ITERS + 1))


def check_resumes(journey: Journey) -> None:
    check_launches(journey)
    first, second = (done.stdout for done in journey.launches)
    assert f"iteration {STOPPED_AT + 1}/" not in first, "the first launch ran past --exit-interval"
    assert re.search(rf"resumed from \S+ at iteration {STOPPED_AT}\b", second), second
    assert f"iteration {ITERS}/{ITERS}" in second and f"iteration {STOPPED_AT}/" not in second, second


def launch_line(script: str, journey: Journey, positional: list[str]) -> list[str]:
    """The arguments the script's torchrun line gives pretrain_gpt.py (bash expands the arrays; nothing runs)."""
    show = 'torchrun() { shift 9; printf "%s\\0" "$@"; }\n'  # past DISTRIBUTED_ARGS and the script
    args = ["bash", "-c", show + script.format(port=0), "example", str(journey.checkpoints), str(journey.tensorboard),
            *positional]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout.split("\0")[:-1]


def check_current_line(journey: Journey) -> None:
    """The current script's line (--step-batch-size-schedule) parses, passes pretrain.py's checks and gives the
    batch sizes the ramp-up line trained with."""
    pretrain = script("pretrain")
    check_launches(journey)
    argv = launch_line(GPT3_175B_CURRENT, journey, journey.positional)
    at = argv.index("--step-batch-size-schedule")
    assert argv[at + 1:at + 3] == ["0:4", "512:8"], "bash splits the unquoted schedule into words: " + str(argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = pretrain.parser("pretrain_gpt.py", CAUSAL_LM.family).parse_args(argv)  # its default --model
        except SystemExit:
            raise AssertionError(f"the current script's line is refused: {err.getvalue()}") from None
    pretrain.check_flags(args)
    steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)  # the line's --load: resolved later
    schedule, consumed, sizes = BatchSchedule(args.global_batch_size, steps=steps), 0, []
    for _ in range(ITERS):
        sizes.append(schedule.batch_at(consumed))
        consumed += sizes[-1]
    assert sizes == [journey.metrics()[i]["global_batch_size"] for i in range(1, ITERS + 1)], sizes


def check_rampup(journey: Journey) -> None:
    """--rampup-batch-size 4 4 16 to 8: batch 4 until 16 samples are consumed (iterations 1-4), then 8, also
    across the resume (the checkpoints' consumed samples)."""
    check_launches(journey)
    sizes = [journey.metrics()[i]["global_batch_size"] for i in range(1, ITERS + 1)]
    assert sizes == [4] * STOPPED_AT + [8] * (ITERS - STOPPED_AT), sizes
    for iteration, consumed in ((STOPPED_AT, 4 * STOPPED_AT), (ITERS, 4 * STOPPED_AT + 8 * (ITERS - STOPPED_AT))):
        meta = json.loads((journey.checkpoints / f"iter_{iteration:07d}" / "meta.json").read_text())
        assert meta["consumed_samples"] == consumed, (iteration, meta["consumed_samples"])


CHECKS = {f.__name__.removeprefix("check_"): f for f in (check_trains, check_fp16, check_evaluates, check_saves,
                                                         check_tensorboard, check_resumes)}


GPT3_CHECKS = {**CHECKS, "rampup": check_rampup, "current-line": check_current_line}


@pytest.mark.parametrize("check", GPT3_CHECKS)
def test_gpt3_175b_example(gpt3, check):
    GPT3_CHECKS[check](gpt3)


@pytest.mark.parametrize("check", CHECKS)
def test_bert_340m_example(bert, check):
    CHECKS[check](bert)
