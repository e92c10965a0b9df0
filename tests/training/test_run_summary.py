"""The parameter count of the run summary's model line (``tpzoo.training.run_summary``): the model the engine built,
counted as Hugging Face counts it, whatever the family's default model is: for every model case (a BERT with and
without its binary head, the classifiers, tied and untied output layers), the count of its own head
(``num_parameters(config, case.head)``), the vocabulary's padding rows left out."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from families import CASES

from tpzoo.engine import Engine, EngineConfig
from tpzoo.models import num_parameters
from tpzoo.parallel import ParallelPlan, init_mesh
from tpzoo.training.run_summary import parameter_count, setup_lines

pytestmark = pytest.mark.tier("unit")

# a vocabulary the default multiple of 128 pads (101 -> 128): padding rows are not parameters
SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=101,
             max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module", autouse=True)
def lone_group():
    """The one-rank group init_mesh starts, ended with the module: the next tests of this process find none."""
    started = not dist.is_initialized()
    init_mesh()
    yield
    if started:
        dist.destroy_process_group()


def engine_of(name: str) -> tuple[Engine, object]:
    case = CASES[name]
    config = case.config(**SIZES, **({"num_labels": 3} if case.inputs == "classification" else {}))
    engine = Engine(lambda plan, **stage: case.build(config, plan, **stage), config,
                    EngineConfig(micro_batch_size=1, global_batch_size=1), ParallelPlan(init_mesh()))
    return engine, config


@pytest.mark.parametrize("name", CASES)
def test_parameter_count_is_the_built_models(name):
    engine, config = engine_of(name)
    assert parameter_count(engine) == num_parameters(config, CASES[name].head)


def test_summary_counts_a_bert_without_its_binary_head_without_it():
    with_head, without = (engine_of(name) for name in ("bert", "bert-mlm"))
    h = SIZES["hidden_size"]
    assert parameter_count(with_head[0]) - parameter_count(without[0]) == h * h + h + 2 * h + 2  # pooler, head
    counts = [re.search(r"([\d.]+)M parameters", setup_lines(config, engine)[0]).group(1)
              for engine, config in (with_head, without)]
    assert counts == [f"{parameter_count(engine) / 1e6:.2f}" for engine, _ in (with_head, without)]
