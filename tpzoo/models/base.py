"""What every model family shares: a model is ``embedding`` + ``layers`` + ``head``, each piece built
under its own seed, and any consecutive run of it can be built alone (a pipeline stage).

    model = GPTModel(config)                                         # the whole model, plain PyTorch
    stage = GPTModel(config, pre_process=False, layers=range(4, 8), post_process=False)

``stage.layers`` then holds layers 4..7 with exactly the weights those layers have in the whole
model: piece "embedding", "layer.i" and "head" is each built from the default CPU generator seeded
with ``piece_seed(seed, piece)`` (the caller's RNG state is left alone). ``layers`` is a ModuleDict
keyed by the global layer number, so a stage's state-dict names are the whole model's. ``place``
receives each piece as soon as it is built, with its path ("embedding", "layers.3", "head"), and
returns what the model keeps: ``tpzoo.models.build_model`` shards it there, one piece at a time, so
that no rank ever holds more than one piece's full weights (``tpzoo.parallel.parallelize``).

A stage without ``pre_process`` takes the previous stage's hidden states [b, s, h] where the first
stage takes token ids; a stage without ``post_process`` returns hidden states. Extra inputs (BERT's
attention mask) go to every stage as the same keyword arguments. A model whose head reads the word
embedding back (``ties_output_to_embedding``) gets from here its output weight: with an untied config
``head.output_layer`` [V, h], drawn last in the head; on a last stage without the embedding,
``head.word_embeddings``, the embedding's table drawn again under its seed.

A family subclasses ``StagedModel`` with ``build_embedding``, ``build_layer(i)``, ``build_head`` and
``forward`` from the block library, and states its ``sharding`` plan next to them.
"""

from __future__ import annotations

import hashlib
import inspect
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from tpzoo.models.config import ModelConfig
from tpzoo.models.kv_cache import KVCache
from tpzoo.models.norms import norm
from tpzoo.models.weights import linear
from tpzoo.sharding_plan import ShardingPlan

Place = Callable[[str, nn.Module], nn.Module]


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


def reads_token_types(model: type) -> bool:
    """Whether ``model``'s forward takes token types (BERT's segments A and B; a decoder reads none)."""
    return "token_type_ids" in inspect.signature(model.forward).parameters


def in_order(layers: Sequence[nn.Module], hidden: Tensor, *args: Any, training: bool = False) -> Tensor:
    """The layers in order, each given ``args`` (mask, cache): a ``StagedModel``'s ``layer_runner`` by default."""
    for layer in layers:
        hidden = layer(hidden, *args)
    return hidden


@runtime_checkable
class PipelineStage(Protocol):
    """What the engine needs of a model or a stage of one (``StagedModel`` provides it).

    ``label_keys``: the batch keys whose per-element losses the last stage returns, in order, when
    they are given (GPT: labels; BERT: labels, next_sentence_label); the engine divides each by its
    own count in the global batch. ``boundary_shape``: the hidden states one stage hands the next
    (whole sequences: the engine cuts them under sequence parallelism).
    """

    label_keys: tuple[str, ...]
    pre_process: bool
    post_process: bool
    layer_numbers: list[int]

    def boundary_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, ...]: ...

    def __call__(self, x: Tensor, **extras: Tensor) -> Tensor | tuple[Tensor, ...]: ...


class StagedModel(nn.Module):
    """Base of every family's models: ``embedding``, ``layers``, ``head`` (see module docstring).

    ``seed``: the weights' seed; ``place``: where each piece goes once built (default: kept as built).
    Subclasses set ``model_type``, ``config_class``, ``label_keys`` and ``sharding`` and define
    ``build_embedding()``, ``build_layer(i)``, ``build_head()`` and ``forward``; ``layer_runner`` runs the
    layers (``run_layers``: in order; a plan may recompute spans of them, ``tpzoo.parallel.recompute``).
    """

    model_type: ClassVar[str] = ""  # the family name its configs carry
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    sharding: ClassVar[ShardingPlan] = ShardingPlan({})  # how tensor parallelism splits it
    label_keys: tuple[str, ...] = ("labels",)
    ties_output_to_embedding: ClassVar[bool] = False  # an LM head whose output layer is the word embedding
    causal: ClassVar[bool] = False  # attention to earlier tokens only (decoders)

    def __init__(self, config: ModelConfig, *, seed: int = 1234, pre_process: bool = True, post_process: bool = True,
                 layers: Iterable[int] | None = None, place: Place | None = None) -> None:
        super().__init__()
        self.check_config(config)
        place = place or (lambda path, module: module)
        self.config, self.seed = config, seed
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = _layer_range(layers, config.num_layers)
        self.layer_runner: Callable[..., Tensor] = in_order
        self.embedding: nn.Module | None = None
        self.head: nn.Module | None = None
        if pre_process:
            with building(seed, "embedding"):
                self.embedding = place("embedding", self.build_embedding())
        self.layers = nn.ModuleDict()
        for i in self.layer_numbers:
            with building(seed, f"layer.{i}"):
                self.layers[str(i)] = place(f"layers.{i}", self.build_layer(i))
        if post_process:
            with building(seed, "head"):
                head = self.build_head()
                if self.ties_output_to_embedding and not config.tie_word_embeddings:
                    head.output_layer = linear(config.hidden_size, config.vocab_size, False, config.init_method_std)
            if self.holds_tied_copy:
                with building(seed, "embedding"):
                    head.word_embeddings = self.build_embedding().word_embeddings
            self.head = place("head", head)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """TypeError / ValueError unless ``config`` is a config of this model's family."""
        if not isinstance(config, cls.config_class):
            raise TypeError(f"{cls.__name__} takes a {cls.config_class.__name__}, got {type(config).__name__}")
        if config.model_type != cls.model_type:
            raise ValueError(f"{cls.__name__} needs a config with model_type={cls.model_type!r}, "
                             f"got model_type={config.model_type!r}")

    @property
    def holds_tied_copy(self) -> bool:
        """A last stage without the embedding whose head reads the word embedding: it holds a copy of it."""
        return (self.ties_output_to_embedding and self.config.tie_word_embeddings and self.post_process
                and not self.pre_process)

    def norm(self) -> nn.Module:
        """A fresh norm of the config's kind (``normalization``) over h."""
        c = self.config
        return norm(c.normalization, c.hidden_size, c.layernorm_epsilon)

    def build_embedding(self) -> nn.Module:
        raise NotImplementedError

    def build_layer(self, layer_number: int) -> nn.Module:
        raise NotImplementedError

    def build_head(self) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def loss_names(cls, data: object) -> dict[str, str]:
        """The metric name of each label key's part of the training loss (``StepResult.losses``), logged
        besides ``loss``; ``data``: the training dataset. Default {}: one part, the loss itself."""
        return {}

    def boundary_shape(self, micro_batch_size: int, seq_length: int) -> tuple[int, ...]:
        """The hidden states between stages: [mbs, s, h]."""
        return (micro_batch_size, seq_length, self.config.hidden_size)

    @property
    def is_whole(self) -> bool:
        """True when this is the whole model (not a pipeline stage)."""
        return self.pre_process and self.post_process and len(self.layers) == self.config.num_layers

    def tied_weight(self) -> Tensor | None:
        """The word embedding's weight where the head reads it from the embedding this model holds, else None."""
        tied = self.ties_output_to_embedding and self.config.tie_word_embeddings and self.pre_process
        return self.embedding.word_embeddings.weight if tied else None

    def run_layers(self, hidden: Tensor, mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """The layers in order: [b, s, h] -> [b, s, h], through ``layer_runner``."""
        return self.layer_runner(list(self.layers.values()), hidden, mask, cache, training=self.training)

    def extra_repr(self) -> str:
        layers = f"{self.layer_numbers[0]}..{self.layer_numbers[-1]}" if self.layer_numbers else "none"
        return (f"pre_process={self.pre_process}, post_process={self.post_process}, "
                f"layers={layers} of {self.config.num_layers}")
