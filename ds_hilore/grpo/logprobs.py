"""Token log-probs from the last hidden state without materialising the (B, T, V) fp32 logits.

# NOTE [ Chunked log-probs ]
The LM head is the other memory giant of a GRPO update: with V ≈ 152k the fp32
logits of a (B, T) microbatch and their gradient are each B·T·V·4 bytes, alive together at the
start of the backward. A policy loss needs only one number per position, log p(target_t), so

    forward : for each chunk of positions, logits = h_c Wᵀ + b (fp32), keep
              logits[target] - logsumexp(logits)                             -> (N,) fp32
    backward: recompute the chunk's logits, p = softmax(logits),
              ∂/∂logits = g · (onehot(target) - p),
              ∂h_c = (∂/∂logits) W,   ∂W += (∂/∂logits)ᵀ h_c,   ∂b += Σ (∂/∂logits)

Only one chunk's (c, V) logits (plus one temporary of the same size) exist at a time, in forward
and in backward; what is saved for backward is the hidden state (which the head's matmul would
save anyway), the targets and a reference to the weight. The price is one extra head matmul per
chunk in backward (the recompute), the same trade as activation checkpointing.

A position whose gradient g is zero adds nothing to any of the three gradients (its ∂/∂logits
is g · (...) = 0), and in a GRPO update most are: prompt and padding positions (masked out of
the loss), tokens clipped off-policy, every position of a sequence whose advantage is zero
(β = 0). The backward reads once where g is not zero and recomputes, softmaxes and multiplies
the logits of those positions only, gathered into chunks of ``chunk_size``; the rows of ∂h at
the others are zero. Where every g is non-zero, the chunks are the forward's, as before (a
gathered chunk's matmul may round differently from the forward's chunk; the backward uses only
its own recompute, and the same positions give the same chunks in every run).

Precision: the matmul runs in ``promote_types(hidden.dtype, weight.dtype)`` with autocast off
(the recompute in backward must see exactly the forward's logits, and backward runs outside the
caller's autocast region); logits and the softmax are fp32; the weight and bias gradients are
accumulated over chunks in fp32 and cast once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["token_logprobs"]

DEFAULT_CHUNK_SIZE = 256  # positions per chunk: 256 · 152k · 4 B ≈ 156 MB of fp32 logits


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    dtype = torch.promote_types(h.dtype, weight.dtype)
    b = None if bias is None else bias.to(dtype)
    logits = nn.functional.linear(h.to(dtype), weight.to(dtype), b).float()  # (c, V) fp32
    if temperature != 1.0:
        logits.div_(temperature)  # fresh tensor from the matmul: in place saves a (c, V) copy
    return logits


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """See NOTE [ Chunked log-probs ]. Inputs are flattened: hidden (N, H), targets (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,) fp32
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk_size):
                e = s + chunk_size
                logits = _chunk_logits(hidden[s:e], weight, bias, temperature)  # (c, V) fp32
                picked = logits.gather(1, targets[s:e, None]).squeeze(1)  # (c,)
                out[s:e] = picked - torch.logsumexp(logits, dim=-1)
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        grad_h = torch.zeros_like(hidden) if need_h else None  # (N, H); rows of zero g stay 0
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        grad_out = grad_out.float()
        live = torch.nonzero(grad_out).squeeze(1)  # (M,) positions with a gradient: the one read
        every = live.shape[0] == hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, live.shape[0], ctx.chunk_size):
                e = s + ctx.chunk_size
                rows = slice(s, e) if every else live[s:e]  # the forward's chunk, or gathered
                h, t, g = hidden[rows], targets[rows, None], grad_out[rows, None]  # (c, H) (c, 1) (c, 1)
                dlogits = torch.softmax(_chunk_logits(h, weight, bias, ctx.temperature), dim=-1)  # (c, V)
                dlogits.mul_(-g).scatter_add_(1, t, g)  # g · (onehot - p)
                if ctx.temperature != 1.0:
                    dlogits.div_(ctx.temperature)
                if need_h:
                    grad_h[rows] = (dlogits.to(dtype) @ weight.to(dtype)).to(hidden.dtype)
                if need_w:
                    grad_w.addmm_(dlogits.t(), h.float())
                if need_b:
                    grad_b.add_(dlogits.sum(0))
                del dlogits
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def token_logprobs(
    hidden: Tensor,
    lm_head: nn.Linear | Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> Tensor:
    """Log-probs of ``targets`` under ``softmax(lm_head(hidden) / temperature)``, in chunks.

    Equal to ``log_softmax(lm_head(hidden).float() / temperature).gather(-1, targets)`` in value
    and gradient (up to fp32 rounding), but never holds more than ``chunk_size`` positions of
    fp32 logits, in forward or backward (NOTE [ Chunked log-probs ]).

    Args:
        hidden: (..., H) last hidden states, fp32 or bf16; position t predicts ``targets[..., t]``
            (shift before calling: ``hidden[:, :-1]`` with ``input_ids[:, 1:]``).
        lm_head: an ``nn.Linear`` (its bias is used) or its weight tensor (V, H); trainable or frozen.
        targets: (...) integer token ids in [0, V), same leading shape as ``hidden``. Padded
            positions need a valid id; mask them in the loss.
        bias: (V,) bias when ``lm_head`` is a tensor.
        chunk_size: positions per chunk (over the flattened leading dims).
        temperature: logits are divided by it, as TRL does before its log-softmax.

    Returns:
        (...) fp32 log-probs, differentiable w.r.t. ``hidden``, the weight and the bias.

    Raises:
        TypeError / ValueError: wrong head type, shapes, dtypes, or target ids outside the vocabulary.

    Note:
        Under ZeRO-3 the head's weight must be gathered (call it inside the model's forward or
        ``deepspeed.zero.GatheredParameters``); a partitioned weight has size 0.
    """
    weight, bias = _head_params(lm_head, bias)
    _check(hidden, weight, bias, targets, chunk_size, temperature)
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    t = targets.reshape(-1).long()  # (N,)
    out = _ChunkedTokenLogprobs.apply(h, weight, bias, t, int(chunk_size), float(temperature))
    return out.reshape(lead)


def _head_params(lm_head, bias):
    if isinstance(lm_head, nn.Linear):
        if bias is not None:
            raise ValueError("token_logprobs: pass `bias=` only with a weight tensor; an nn.Linear brings its own.")
        return lm_head.weight, lm_head.bias
    if isinstance(lm_head, Tensor):
        return lm_head, bias
    raise TypeError(
        f"token_logprobs: lm_head must be an nn.Linear or its (V, H) weight tensor, got {type(lm_head).__name__}; "
        "for a tied head pass `model.get_output_embeddings().weight`."
    )


def _check(hidden, weight, bias, targets, chunk_size, temperature):
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not x.is_floating_point():
            raise TypeError(f"token_logprobs: {name} must be a floating tensor (fp32 or bf16), got {x.dtype}.")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"token_logprobs: weight must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)} (a ZeRO-3 partitioned weight has size 0: gather it first)."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"token_logprobs: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}.")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"token_logprobs: targets must hold integer token ids, got {targets.dtype}.")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"token_logprobs: targets {tuple(targets.shape)} must match hidden's leading dims "
            f"{tuple(hidden.shape[:-1])}; shift first (hidden[:, :-1] predicts input_ids[:, 1:])."
        )
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(
            f"token_logprobs: target ids must lie in [0, {weight.shape[0]}); replace ignored positions "
            "(e.g. -100) by any valid id and mask them in the loss."
        )
    if int(chunk_size) < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}.")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}.")
