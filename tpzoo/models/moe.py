"""The mixture-of-experts MLP (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024): each
token goes through k of N expert MLPs, chosen by a router, whose outputs are summed with the router's weights.
Plain PyTorch, dropless (every token reaches its k experts); split by tensor parallelism with ``MOE_PLAN``.

    logits = X W_r^T                            [T, N]   the router: a linear layer without bias
    p = softmax(logits) | sigmoid(logits)       [T, N]   ``score``, in float32
    w, e = top-k of p                           [T, k]   w / sum_j w_j when ``normalize`` (Mixtral; Qwen2-MoE: off)
    Y = sum_j w_j MLP_{e_j}(X)  [+ sigmoid(X g) MLP_s(X)]   the shared expert: always on, gated when ``shared_gate``

The experts are the block library's MLP (gated SwiGLU or GELU, gate and up rows interleaved) held stacked
(``Experts``), so expert e converts and splits as a dense MLP does. They run as one grouped multiply per linear
(``grouped_gemm``, ``tpzoo.models.grouped_mm``: the token counts per expert stay on the device) or one after another
on the tokens routed to them (the counts read on the host once a forward: the loop needs their sizes). Expert
parallelism (``tpzoo.parallel.experts``) keeps N/ep experts a rank and sends each token to its experts' rank; its
all-to-all reads the counts on the host (its splits). Dropless unless a capacity factor is given (``MoE``).

Tensor parallelism (``MOE_PLAN``; Megatron-LM's default expert tensor parallel size, tp) splits every expert as
the MLP is split, A = [A_1 ... A_p] by rows and B = [B_1; ...; B_p] by columns: rank r computes
sum_j w_j act(X A_{e_j,r}) B_{e_j,r}, a partial sum, and one all-reduce adds them for all experts at once
(``tpzoo.parallel.styles.experts``). The router sees the whole X on every rank and routes alike everywhere; under
sequence parallelism it routes this rank's tokens, which the experts all-gather with their routing and
reduce-scatter back.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from tpzoo.models.grouped_mm import check_grouped_sizes, grouped_mm
from tpzoo.models.mlp import MLP, MLP_PLAN, activate, activation_of
from tpzoo.models.weights import linear
from tpzoo.sharding_plan import prefixed

SCORES = ("softmax", "sigmoid")
# the load-balancing loss (Megatron-LM's --moe-router-load-balancing-type): per sequence, per micro-batch, none
LOAD_BALANCING = ("seq_aux_loss", "aux_loss", "none")
ROUTER_LOSSES = ("load_balancing_loss", "z_loss")  # the names of ``MoE.losses``, as the metrics log them
EXPERT_LOAD = "tokens_per_expert"  # ``MoE.losses``' [N]: the token slots routed to each expert
# the router and the shared expert's gate are left to the plan's default: replicated, their gradients partial sums
# in the sequence-parallel region (where they see this rank's tokens)
MOE_PLAN = {"experts": "experts", **prefixed("shared_expert", MLP_PLAN)}


# dispatch(rows [R, h], counts [N], run) -> the rows' expert outputs [R, h] (``local_dispatch``)
Run = Callable[[Tensor, Tensor], Tensor]
Dispatch = Callable[[Tensor, Tensor, Run], Tensor]


def local_dispatch(rows: Tensor, counts: Tensor, run: Run) -> Tensor:
    """Every expert on this rank: ``run`` the routed ``rows`` [R, h], expert by expert (``counts`` [N] each), as they
    are. Expert parallelism puts another in its place (``tpzoo.parallel.experts``)."""
    return run(rows, counts)


def _counts(slots: Tensor, n: int) -> Tensor:
    """[n]: how many of ``slots`` hold each of 0 ... n - 1, on their device (torch.bincount reads their maximum on the
    host)."""
    return torch.zeros(n, dtype=slots.dtype, device=slots.device).index_add_(0, slots, torch.ones_like(slots))


class Experts(nn.Module):
    """N MLPs held stacked, ``dense_h_to_4h`` [N, f, h] (gated: [N, 2f, h], each expert's gate and up rows interleaved
    as in ``MLP``) and ``dense_4h_to_h`` [N, h, f], without biases: Hugging Face's and a grouped matrix multiply's
    layout, each expert a slice of dim 0.

    forward(x [T, h], weights [T, k], indices [T, k]) -> [T, h], row t the sum over j of weights[t, j] times expert
    indices[t, j] on x[t]; summed in float32 when ``weights`` are (the router's), cast to x's dtype. The routed rows,
    sorted expert by expert, go through ``dispatch`` (``local_dispatch``: all experts here)."""

    graph_break = True  # torch.compile: ``routed`` runs eagerly (tpzoo.models.compile)
    grouped_gemm = False  # one grouped multiply for all experts (``tpzoo.parallel.ParallelPlan.grouped_gemm``)

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu",
                 capacity_factor: float | None = None, init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor!r}")
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.dispatch: Dispatch = local_dispatch
        self.gate, self.activation = activation_of(activation)
        rows = ffn_hidden_size * (2 if self.gate else 1)
        self.dense_h_to_4h = nn.Parameter(
            torch.empty(num_experts, rows, hidden_size, device="cpu").normal_(0.0, init_std))
        self.dense_4h_to_h = nn.Parameter(
            torch.empty(num_experts, hidden_size, ffn_hidden_size, device="cpu").normal_(0.0, out_init_std))

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` of those this module holds, on x [n, h] -> [n, h]: act(x A_e^T) B_e^T."""
        return activate(x @ self.dense_h_to_4h[e].t(), self.gate, self.activation) @ self.dense_4h_to_h[e].t()

    def run(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The held experts on ``rows`` [R, h], expert by expert (``counts`` [held] rows each, on rows' device) -> their
        outputs [R, h]: one grouped multiply per linear (``grouped_gemm``: nothing read on the host), or a loop over
        the experts (the counts read on the host: the loop needs their sizes)."""
        if not self.grouped_gemm:
            return torch.cat([self.expert(e, chunk) for e, chunk in enumerate(rows.split(counts.tolist()))])
        check_grouped_sizes(rows.dtype, hidden=rows.shape[-1], expert_ffn=self.dense_4h_to_h.shape[-1])
        ends = counts.cumsum(0).to(torch.int32)
        hidden = activate(grouped_mm(rows, self.dense_h_to_4h, ends), self.gate, self.activation)
        return grouped_mm(hidden, self.dense_4h_to_h, ends)

    @torch.compiler.disable  # the loop reads the token counts on the host: eager, between compiled graphs
    def routed(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The routed ``rows`` [T k, h], expert by expert (``counts`` [N]), through ``dispatch`` and the experts."""
        return self.dispatch(rows, counts, self.run)

    def over_capacity(self, slots: Tensor, weights: Tensor) -> Tensor:
        """The routed ``slots`` [T k] (their experts) with those beyond their expert's capacity ceil(T k / N x
        ``capacity_factor``) set to N (dropped): each expert keeps its heaviest slots (``weights`` [T k]; Megatron-LM's
        drop policy "probs"), the earlier one of equal weights."""
        n = self.num_experts
        capacity = math.ceil(slots.numel() / n * self.capacity_factor)
        heaviest = weights.argsort(descending=True, stable=True)
        by_expert = heaviest[slots[heaviest].argsort(stable=True)]             # expert by expert, heaviest first
        counts = _counts(slots, n)
        place = torch.empty_like(slots)
        starts = (counts.cumsum(0) - counts)[slots[by_expert]]
        place[by_expert] = torch.arange(slots.numel(), device=slots.device) - starts             # within its expert
        return torch.where(place < capacity, slots, n)

    def forward(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        k, drops = indices.shape[-1], self.capacity_factor is not None and self.training
        slots = indices.flatten()                                        # [T k]: (token, j) -> its expert
        if drops:
            slots = self.over_capacity(slots, weights.flatten())
        order = slots.argsort(stable=True)                               # the slots, expert by expert
        counts = _counts(slots, self.num_experts + 1)[:self.num_experts]   # [N], on x's device (dropped: N)
        if drops:
            order = order[:int(counts.sum())]                            # the kept slots (their number read here)
        tokens = order // k
        out = self.routed(x[tokens], counts) * weights.flatten()[order, None]
        return torch.zeros(x.shape, dtype=out.dtype, device=x.device).index_add(0, tokens, out).to(x.dtype)

    def extra_repr(self) -> str:
        held, _, h = self.dense_h_to_4h.shape
        return (f"experts={held} of {self.num_experts}, hidden={h}, ffn={self.dense_4h_to_h.shape[-1]}, "
                f"gated={self.gate is not None}, capacity_factor={self.capacity_factor}")


def _whole(t: Tensor) -> Tensor:
    """The sums over each sequence's tokens, when this rank holds them all (``MoE.sequence_sum``)."""
    return t


class _JoinLoss(torch.autograd.Function):
    """forward(out, loss) = out; backward: out's gradient, and a gradient of 1 for the scalar ``loss``, which so
    adds its gradient to the training loss's wherever that is computed (on the last pipeline stage, say), as
    Megatron-LM's MoEAuxLossAutoScaler does."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class MoE(nn.Module):
    """[b, s, h] -> [b, s, h]: ``num_experts`` experts of ``ffn_hidden_size`` features, ``top_k`` a token (module
    docstring); ``shared_ffn_hidden_size``: a shared expert of that width (None: none), its output gated by
    sigmoid(X g) when ``shared_gate``. Weights ~ N(0, ``init_std``^2), the second linears' ``out_init_std``.

    In training, ``aux_loss_coeff`` and ``z_loss_coeff`` add the router's losses of each sequence (``router_losses``;
    ``load_balancing``: seq_aux_loss, aux_loss or none, Megatron-LM's names) to the training loss's gradient with
    weight ``sequence_weight`` (the weight the training loss gives a sequence: set by the engine, None = 1 / b, the
    mean over the forward's sequences); ``losses`` adds up their sums over the
    sequences of every training forward (not a recompute's) until it is emptied, to log (``ROUTER_LOSSES``), and the
    token slots routed to each expert ([N], ``EXPERT_LOAD``: its load). ``capacity_factor``: in training, each
    expert takes at most ceil(T k / N x factor) of a micro-batch's T k slots, its heaviest (``Experts.over_capacity``);
    the others are dropped, which changes the math (None: dropless; evaluation and generation always are)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, ffn_hidden_size: int, *,
                 activation: str = "swiglu", score: str = "softmax", normalize: bool = True,
                 shared_ffn_hidden_size: int | None = None, shared_gate: bool = False, aux_loss_coeff: float = 0.0,
                 z_loss_coeff: float = 0.0, load_balancing: str = "seq_aux_loss", capacity_factor: float | None = None,
                 init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        if shared_gate and shared_ffn_hidden_size is None:
            raise ValueError("shared_gate=True gates the shared expert; give shared_ffn_hidden_size too")
        if aux_loss_coeff < 0 or z_loss_coeff < 0:
            raise ValueError(f"the router's loss coefficients must be >= 0, got aux_loss_coeff={aux_loss_coeff}, "
                             f"z_loss_coeff={z_loss_coeff}")
        if load_balancing not in LOAD_BALANCING or load_balancing == "none" and aux_loss_coeff:
            raise ValueError(f"load_balancing must be one of {', '.join(LOAD_BALANCING)}, and not none with "
                             f"aux_loss_coeff > 0; got {load_balancing!r} with aux_loss_coeff={aux_loss_coeff}")
        self.top_k, self.score, self.normalize, self.load_balancing = top_k, score, normalize, load_balancing
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.sequence_weight: float | None = None
        self.sequence_sum: Callable[[Tensor], Tensor] = _whole  # sequence parallelism: an all-reduce over tp
        self.losses: dict[str, Tensor] = {}
        self.router = linear(hidden_size, num_experts, False, init_std)
        self.experts = Experts(num_experts, hidden_size, ffn_hidden_size, activation=activation,
                               capacity_factor=capacity_factor, init_std=init_std, out_init_std=out_init_std)
        self.shared_expert = None if shared_ffn_hidden_size is None else MLP(
            hidden_size, shared_ffn_hidden_size, activation=activation, bias=False, init_std=init_std,
            out_init_std=out_init_std)
        self.shared_expert_gate = linear(hidden_size, 1, False, init_std) if shared_gate else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, h] -> (weights [T, k] float32, expert indices [T, k], router logits [T, N])."""
        logits = self.router(x)
        scores = logits.float().softmax(-1) if self.score == "softmax" else logits.float().sigmoid()
        weights, indices = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, indices, logits

    def router_losses(self, logits: Tensor, indices: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """(load balance, z-loss), each summed over the ``batch`` sequences of router ``logits`` [T, N] and chosen
        ``indices`` [T, k] (T = batch x s tokens), and the load: the slots of the whole sequences routed to each
        expert [N] (float, no gradient). Each is computed over a group of tokens, a sequence (``load_balancing``
        seq_aux_loss) or the micro-batch (aux_loss, Megatron-LM's default: then counted once per sequence of it):

            load balance   N sum_e f_e P_e   f_e: the share of the group's routed slots that chose e (no gradient),
                           P_e: the mean of p_e, p the scores (sigmoid ones divided by their sum); 1 when balanced.
                           Hugging Face's Mixtral computes the batch's, k times this on one sequence.
            z-loss         the mean of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022)

        Per sequence, the sum over a global batch is the same however it is split into micro-batches and
        data-parallel ranks; per micro-batch, however it is split over ranks. ``sequence_sum`` adds the parts of each
        group that other ranks hold."""
        n, groups = logits.shape[-1], 1 if self.load_balancing == "aux_loss" else batch
        logits = logits.float().view(groups, -1, n)                                   # [g, s, N]
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        scores = scores / scores.sum(-1, keepdim=True)
        chosen = torch.zeros_like(scores).scatter_(-1, indices.view(groups, -1, self.top_k), 1.0)
        z = logits.logsumexp(-1).square()
        sums = self.sequence_sum(torch.cat([chosen.sum(1), scores.sum(1), z.sum(1, keepdim=True)], -1))
        count, prob, z_sum = sums.split([n, n, 1], -1)                                 # [g, N], [g, N], [g, 1]
        tokens = count.sum(-1, keepdim=True) / self.top_k                              # whole groups
        balance = n * (count / (tokens * self.top_k) * prob / tokens).sum(-1)
        per_group = batch // groups
        return balance.sum() * per_group, (z_sum / tokens).sum() * per_group, count.sum(0).detach()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])                                  # [T, h]
        weights, indices, logits = self.route(flat)
        out = self.experts(flat, weights, indices).view_as(x)
        if self.training:
            balance, z, load = self.router_losses(logits, indices, x.shape[0])
            if torch._C._current_graph_task_id() == -1:  # not a recompute in backward (the forward counted them)
                for name, value in zip((*ROUTER_LOSSES, EXPERT_LOAD), (balance, z, load)):
                    self.losses[name] = self.losses.get(name, 0.0) + value.detach()
            if self.aux_loss_coeff or self.z_loss_coeff:
                weight = self.sequence_weight if self.sequence_weight is not None else 1.0 / x.shape[0]
                out = _JoinLoss.apply(out, (self.aux_loss_coeff * balance + self.z_loss_coeff * z) * weight)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def extra_repr(self) -> str:
        return (f"top_k={self.top_k}, score={self.score!r}, normalize={self.normalize}, "
                f"load_balancing={self.load_balancing!r}, aux_loss_coeff={self.aux_loss_coeff}, "
                f"z_loss_coeff={self.z_loss_coeff}")
