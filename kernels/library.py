"""The Triton kernels as PyTorch operators, ``torch.ops.tpzoo.*``, forward and backward.

Each op is a ``torch.library.custom_op`` with a fake implementation (shape, dtype and strides
of every output, the float32 statistics included) and an autograd formula that calls the
backward op, so torch.compile (aot_eager and inductor, fullgraph=True) keeps the kernels in its
graph as opaque calls, and torch.export and dispatch modes (FlopCounterMode) see them by name.

Why ``custom_op`` and not ``triton_op`` + ``wrap_triton`` (which would show inductor the kernels
themselves): traced under Triton's interpreter, the way the test suite runs every kernel on the
CPU, ``wrap_triton`` runs the interpreted kernel on fake tensors and fails, so nothing compiled
could be tested. Registering these ops imports no triton: each implementation imports its kernel
module on first call (``dispatch.kernel_module``).

Every output is a new contiguous tensor (none aliases an input); scalars are float or bool;
optional tensors (mask, bias) are ``Tensor?``. The math of each op: ``ops`` and the kernel modules.
The cross entropy's ops (``tpzoo::cross_entropy_stats``/``_grad``) are registered with the
vocab-parallel autograd function that runs the tp all-reduces between them
(``tpzoo.parallel.cross_entropy``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import kernel_module


def _empty_like(t: Tensor, shape: tuple[int, ...] | torch.Size | None = None,
                dtype: torch.dtype | None = None) -> Tensor:
    """A contiguous empty tensor on t's device: the fake of a kernel output."""
    return t.new_empty(t.shape if shape is None else shape, dtype=t.dtype if dtype is None else dtype)


# --- softmax ------------------------------------------------------------------------------------

@torch.library.custom_op("tpzoo::scaled_masked_softmax", mutates_args=())
def scaled_masked_softmax(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(scale * x) over the last dim of x [b, heads, sq, sk], -inf where mask (bool) is True."""
    return kernel_module("softmax", x.device).forward(x, mask, scale, False)


@torch.library.custom_op("tpzoo::scaled_causal_softmax", mutates_args=())
def scaled_causal_softmax(x: Tensor, scale: float) -> Tensor:
    """softmax(scale * x) over keys k <= q + sk - sq of x [b, heads, sq, sk]."""
    return kernel_module("softmax", x.device).forward(x, None, scale, True)


@torch.library.custom_op("tpzoo::scaled_softmax_backward", mutates_args=())
def scaled_softmax_backward(y: Tensor, dy: Tensor, scale: float, causal: bool) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y)) from the softmax output y."""
    return kernel_module("softmax", y.device).backward(y, dy, scale, causal)


@scaled_masked_softmax.register_fake
def _(x, mask, scale):
    return _empty_like(x)


@scaled_causal_softmax.register_fake
def _(x, scale):
    return _empty_like(x)


@scaled_softmax_backward.register_fake
def _(y, dy, scale, causal):
    return _empty_like(y)


def _softmax_setup(causal: bool):
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.scale, ctx.causal, ctx.n_inputs = inputs[-1], causal, len(inputs)
    return setup_context


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    dx = torch.ops.tpzoo.scaled_softmax_backward(y, dy, ctx.scale, ctx.causal)
    return (dx,) + (None,) * (ctx.n_inputs - 1)


scaled_masked_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup(False))
scaled_causal_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup(True))


# --- LayerNorm, RMSNorm ---------------------------------------------------------------------------

@torch.library.custom_op("tpzoo::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): LayerNorm over the last dim; float32 mean, rstd of shape x.shape[:-1]."""
    return kernel_module("norms", x.device).forward(x, weight, bias, eps, False)


@torch.library.custom_op("tpzoo::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd): RMSNorm over the last dim; float32 rstd of shape x.shape[:-1]."""
    y, _, rstd = kernel_module("norms", x.device).forward(x, weight, None, eps, True)
    return y, rstd


@torch.library.custom_op("tpzoo::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, mean: Tensor,
                        rstd: Tensor) -> list[Tensor]:
    """[dx, dweight] or, with a bias, [dx, dweight, dbias]; each in its input's dtype."""
    dx, dw, db = kernel_module("norms", x.device).backward(dy, x, weight, bias, mean, rstd)
    return [dx, dw] if db is None else [dx, dw, db]


@torch.library.custom_op("tpzoo::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dweight), each in its input's dtype."""
    dx, dw, _ = kernel_module("norms", x.device).backward(dy, x, weight, None, None, rstd)
    return dx, dw


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return _empty_like(x), _empty_like(x, x.shape[:-1], torch.float32), _empty_like(x, x.shape[:-1], torch.float32)


@rms_norm.register_fake
def _(x, weight, eps):
    return _empty_like(x), _empty_like(x, x.shape[:-1], torch.float32)


@layer_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd):
    return [_empty_like(t) for t in (x, weight, bias) if t is not None]


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return _empty_like(x), _empty_like(weight)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias, *output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    grads = torch.ops.tpzoo.layer_norm_backward(dy, x, weight, bias, mean, rstd)
    return grads[0], grads[1], None if bias is None else grads[2], None


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.tpzoo.rms_norm_backward(dy, x, weight, rstd)
    return dx, dw, None


layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)
rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# --- GELU -------------------------------------------------------------------------------------------

@torch.library.custom_op("tpzoo::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor | None, tanh: bool) -> Tensor:
    """GELU(x + bias), bias [x.shape[-1]] or None; tanh picks the tanh form, else the erf form."""
    return kernel_module("activations", x.device).forward(x, bias, tanh)


@torch.library.custom_op("tpzoo::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(dy: Tensor, x: Tensor, bias: Tensor | None, tanh: bool) -> list[Tensor]:
    """[dx] or, with a bias, [dx, dbias]: dx = dy * GELU'(x + bias), dbias = sum_rows dx."""
    dx, db = kernel_module("activations", x.device).backward(dy, x, bias, tanh)
    return [dx] if db is None else [dx, db]


@bias_gelu.register_fake
def _(x, bias, tanh):
    return _empty_like(x)


@bias_gelu_backward.register_fake
def _(dy, x, bias, tanh):
    return [_empty_like(t) for t in (x, bias) if t is not None]


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    grads = torch.ops.tpzoo.bias_gelu_backward(dy, x, bias, ctx.tanh)
    return grads[0], None if bias is None else grads[1], None


bias_gelu.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)
