"""What every model family shares: a model is ``embedding`` + ``layers`` + ``head``, each piece
built under its own seed, and any consecutive run of it can be built alone (a pipeline stage).

    model = GPTModel(config, plan)                             # the whole model
    stage = GPTModel(config, plan, pre_process=False, layers=range(4, 8), post_process=False)

``stage.layers`` then holds layers 4..7 with exactly the weights those layers have in the whole
model, at any tp: piece "embedding", "layer.i" and "head" is each built from the default CPU
generator seeded with ``piece_seed(plan.seed, piece)`` (the caller's RNG state is left alone),
and every parallel layer draws its full weight before keeping its shard. ``layers`` is a
ModuleDict keyed by the global layer number, so a stage's state-dict names are the whole model's.

A stage without ``pre_process`` takes the previous stage's hidden states [b, s(/tp), h] where
the first stage takes token ids; a stage without ``post_process`` returns hidden states. Extra
inputs (BERT's attention mask) go to every stage as the same keyword arguments.

A family subclasses ``StagedModel`` with ``build_embedding``, ``build_layer(i)``, ``build_head``
and ``forward`` from the blocks of ``tpzoo.models``; ``PipelineStage`` is what the engine reads.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from functools import partial
from typing import ClassVar, Iterable, Iterator, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from tpzoo.models.compile import compile_model
from tpzoo.models.config import ModelConfig
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.norms import build_norm
from tpzoo.models.recompute import recompute, run_span
from tpzoo.parallel import ParallelMesh, ParallelPlan, as_plan
from tpzoo.parallel.param_facts import mark


def piece_seed(seed: int, piece: str) -> int:
    """A 63-bit seed for model piece ``piece`` ("embedding", "layer.3", "head") of weights seed ``seed``."""
    digest = hashlib.sha256(f"tpzoo:{seed}:{piece}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def building(seed: int, piece: str) -> Iterator[None]:
    """Run the block with the default CPU generator seeded for ``piece``; restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(piece_seed(seed, piece))
        yield


def _layer_range(layers: Iterable[int] | None, num_layers: int) -> list[int]:
    indices = list(range(num_layers)) if layers is None else list(layers)
    if indices and (indices != list(range(indices[0], indices[0] + len(indices)))
                    or indices[0] < 0 or indices[-1] >= num_layers):
        raise ValueError(f"layers must be consecutive layer numbers within 0..{num_layers - 1} "
                         f"(num_layers={num_layers}), got {indices}")
    return indices


@runtime_checkable
class PipelineStage(Protocol):
    """What the engine needs of a model or a stage of one (``StagedModel`` provides it).

    ``label_keys``: the batch keys whose per-element losses the last stage returns, in order, when
    they are given (GPT: labels; BERT: labels, next_sentence_label); the engine divides each by its
    own count in the global batch. ``boundary_shape``: the hidden states one stage hands the next.
    """

    label_keys: tuple[str, ...]
    pre_process: bool
    post_process: bool
    layer_numbers: list[int]

    def boundary_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, ...]: ...

    def __call__(self, x: Tensor, **extras: Tensor) -> Tensor | tuple[Tensor, ...]: ...


class StagedModel(nn.Module):
    """Base of every family's models: ``embedding``, ``layers``, ``head`` (see module docstring).

    ``plan``: a ``ParallelPlan`` (mesh and run options), a bare mesh (default options) or None
    (``get_mesh()``). Subclasses set ``model_type``, ``config_class`` and ``label_keys`` and define
    ``build_embedding()``, ``build_layer(i)``, ``build_head()`` and ``forward``. Parameters live on
    ``plan.mesh.device``. With ``plan.compile`` the layers and the head are compiled
    (``tpzoo.models.compile``).
    """

    model_type: ClassVar[str] = ""  # the family name its configs carry
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    label_keys: tuple[str, ...] = ("labels",)
    ties_output_to_embedding: ClassVar[bool] = False  # an LM head whose output layer is the word embedding
    causal: ClassVar[bool] = False  # attention to earlier tokens only (decoders)
    norm_kind: ClassVar[str] = "layernorm"  # the norm of ``norm()``: layernorm | rmsnorm

    def __init__(self, config: ModelConfig, plan: ParallelPlan | ParallelMesh | None = None, *,
                 pre_process: bool = True, post_process: bool = True, layers: Iterable[int] | None = None) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        if config.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__} needs a config with model_type={self.model_type!r}, "
                             f"got model_type={config.model_type!r}")
        plan = as_plan(plan)
        self.config, self.plan, self.mesh = config, plan, plan.mesh
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = _layer_range(layers, config.num_layers)
        self.embedding: nn.Module | None = None
        self.head: nn.Module | None = None
        if pre_process:
            with building(plan.seed, "embedding"):
                self.embedding = self.build_embedding()
        self.layers = nn.ModuleDict()
        for i in self.layer_numbers:
            with building(plan.seed, f"layer.{i}"):
                self.layers[str(i)] = self.build_layer(i)
        if post_process:
            with building(plan.seed, "head"):
                self.head = self.build_head()
        if self.ties_output_to_embedding and config.tie_word_embeddings and pre_process and not post_process:
            # the last stage holds a copy of this weight (``head.word_embeddings``): a pipeline sums the two
            # copies' gradients, and counts them once in the gradient norm (tpzoo.engine.grads)
            mark(self.embedding.word_embeddings.weight, pp_tied=True)
        self.to(plan.mesh.device)
        if plan.compile:
            compile_model(self)

    def build_embedding(self) -> nn.Module:
        raise NotImplementedError

    def build_layer(self, layer_number: int) -> nn.Module:
        raise NotImplementedError

    def build_head(self) -> nn.Module:
        raise NotImplementedError

    def norm(self) -> nn.Module:
        """A fresh norm of the family's kind over h, sequence-parallel aware by the plan."""
        c, plan = self.config, self.plan
        return build_norm(self.norm_kind, c.hidden_size, c.layernorm_epsilon, plan.sequence_parallel, plan.kernels)

    @classmethod
    def loss_names(cls, data: object) -> dict[str, str]:
        """The metric name of each label key's part of the training loss (``StepResult.losses``), logged
        besides ``loss``; ``data``: the training dataset. Default {}: one part, the loss itself."""
        return {}

    def boundary_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, ...]:
        """The hidden states between stages: [mbs, s, h], or [mbs, s/tp, h] with sequence parallelism."""
        tp = self.plan.tp_size if self.plan.sequence_parallel else 1
        return (micro_batch_size, seq_length // tp, self.config.hidden_size)

    @property
    def is_whole(self) -> bool:
        """True when this is the whole model (not a pipeline stage)."""
        return self.pre_process and self.post_process and len(self.layers) == self.config.num_layers

    def run_layers(self, hidden: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """The layers in order: [b, s(/tp), h] -> [b, s(/tp), h]; in training (grad on) the spans the plan
        recomputes (``ParallelPlan.recompute_units``: ``recompute_activations``, Megatron-LM's full
        uniform/block recompute) keep only their input and rerun in backward (``recompute``)."""
        layers = list(self.layers.values())
        training = self.training and torch.is_grad_enabled()
        for first, end, rerun in self.plan.recompute_units(len(layers)):
            span = partial(run_span, layers[first:end])
            if rerun and training:
                hidden = recompute(span, self.mesh.rng, hidden, mask, cache)
            else:
                hidden = span(hidden, mask, cache)
        return hidden

    def extra_repr(self) -> str:
        layers = f"{self.layer_numbers[0]}..{self.layer_numbers[-1]}" if self.layer_numbers else "none"
        return (f"tp={self.mesh.tp_size}, pre_process={self.pre_process}, post_process={self.post_process}, "
                f"layers={layers} of {self.config.num_layers}")
