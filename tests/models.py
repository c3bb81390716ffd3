"""Tiny transformers models with random weights, built from configs (no downloads)."""

from __future__ import annotations

import inspect

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 128

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(attention_dropout=0.1)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(attention_dropout=0.1)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(attention_dropout=0.1)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(attention_dropout=0.1, resid_pdrop=0.1, embd_pdrop=0.0, pad_token_id=0)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                 dict(attention_dropout=0.1, hidden_dropout=0.1, use_parallel_residual=True,
                      rotary_pct=0.5)),
}


def tiny_model(arch: str = "llama", *, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int | None = None, intermediate: int = 64, dropout: bool = True,
               seed: int = 0, **overrides) -> torch.nn.Module:
    """A small causal LM of the given architecture in training mode, fp32, eager attention."""
    config_cls, model_cls, extra = ARCHS[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, intermediate_size=intermediate,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if arch != "gpt_neox":
        kwargs["num_key_value_heads"] = kv_heads or heads // 2
    if dropout:
        kwargs.update(extra)
    elif arch == "phi3":
        kwargs.update(pad_token_id=0)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    model.train()
    return model


def with_lora(model: torch.nn.Module, r: int = 4) -> torch.nn.Module:
    import peft
    targets = ["query_key_value", "dense"] if "NeoX" in type(model).__name__ else \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
         "gate_up_proj"]
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    cfg = peft.LoraConfig(r=r, lora_alpha=8, lora_dropout=0.1,
                          target_modules=[t for t in targets if t in present])
    lora = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    for name, p in lora.named_parameters():  # non-zero B so every LoRA path carries gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    lora.train()
    return lora


def batch(batch_size: int = 3, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    return {"input_ids": ids, "attention_mask": mask}


def loss_and_grads(model, inputs, *, seed: int = 123, autocast: torch.dtype | None = None,
                   row_weights: torch.Tensor | None = None):
    """Loss and gradients of every trainable parameter and of the input embeddings.

    ``torch.manual_seed(seed)`` right before the forward gives every run the same dropout masks.
    ``row_weights`` (B,) weighs each sequence's loss; a weight 0 makes a sequence's gradient
    exactly zero, as GRPO's A = 0 groups do. Models whose forward takes no ``inputs_embeds``
    get ``input_ids`` (and no ``<inputs_embeds>`` gradient).
    """
    model.zero_grad(set_to_none=True)
    embedding = model.get_input_embeddings().weight  # bypassed when inputs_embeds are passed
    embeds = None
    if "inputs_embeds" in inspect.signature(model.forward).parameters:
        embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
        feed = {"inputs_embeds": embeds}
    else:
        feed = {"input_ids": inputs["input_ids"]}
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model(**feed, attention_mask=inputs["attention_mask"]).logits
        weights = torch.linspace(-1.0, 1.0, logits.shape[-1])
        per_token = (logits.float().log_softmax(-1) * weights).sum(-1)  # (B, T)
        if row_weights is not None:
            per_token = per_token * row_weights[:, None]
        loss = per_token.mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.requires_grad and p.grad is not None and (embeds is None or p is not embedding)}
    if embeds is not None:
        grads["<inputs_embeds>"] = embeds.grad.clone()
    return loss.detach(), grads


def gc_loss_and_grads(model, inputs, **kwargs):
    """``loss_and_grads`` under HF's own non-reentrant gradient checkpointing."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        return loss_and_grads(model, inputs, **kwargs)
    finally:
        model.gradient_checkpointing_disable()


# NOTE [ Exact relative to the machine's own checkpointing ]
# An exact recovery (H, R, E) must give the gradients of the model without checkpointing. On
# some CPUs even HF's non-reentrant checkpointing does not, in the last bits: wrapping a layer
# in a checkpoint changes the order in which its input's gradient is accumulated (measured on
# an AMD EPYC without AVX512-FP16: OPT's gradients off by up to 2.4e-7, with HiLoRe's H and R
# off by exactly the same amounts, tensor by tensor). So "exact" is asserted per tensor against
# what the machine's own checkpointing achieves: bitwise where HF checkpointing is bitwise,
# otherwise no further from no checkpointing than HF checkpointing is. GC_SLACK keeps that
# bound from hinging on the last bit of the deviation itself; it is not a tolerance for error.
GC_SLACK = 1e-3


def beyond_gc(ref: dict, gc: dict, got: dict, slack: float = GC_SLACK) -> list[str]:
    """Gradients in ``got`` further from ``ref`` (no checkpointing) than ``gc`` (HF checkpointing).

    Args:
        ref, gc, got: name -> tensor, as ``loss_and_grads`` returns (loss included if wanted).

    Returns:
        One line per offending tensor (empty: ``got`` is as exact as HF checkpointing here).
    """
    problems = [f"{name}: no gradient, but one without checkpointing" for name in ref.keys() - got.keys()]
    problems += [f"{name}: a gradient, but none without checkpointing" for name in got.keys() - ref.keys()]
    for name, expected in ref.items():
        if name not in got or torch.equal(got[name], expected):
            continue
        allowed = _max_abs_diff(gc[name], expected) if name in gc else 0.0
        diff = _max_abs_diff(got[name], expected)
        if not diff <= allowed * (1.0 + slack):  # also catches NaN
            problems.append(f"{name}: max |diff| {diff:.3g} vs HF checkpointing's {allowed:.3g}")
    return problems


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def fixed_profile_times(monkeypatch, codec_s: float) -> None:
    """Every unit's measured times replaced by fixed ones: 1 s to recompute, nothing to capture
    or derive, ``codec_s`` to pack and as much to unpack; so the plans made from a profile do
    not depend on the machine's load."""
    from ds_hilore.plan.profile import Profiler

    result = Profiler.result

    def fixed(self, *args, **kwargs):
        profile = result(self, *args, **kwargs)
        for cost in profile.units:
            cost.recompute_s, cost.capture_s, cost.derive_s = 1.0, 0.0, 0.0
            cost.pack_s = cost.unpack_s = codec_s
        return profile

    monkeypatch.setattr(Profiler, "result", fixed)


def equal_utilities(monkeypatch):
    """Every unit's measured times replaced by one that makes H, and only H, pay the same
    second: the knapsack then keeps as many units as the memory allows, whatever the load."""
    fixed_profile_times(monkeypatch, codec_s=2.0)


def gc_timed_slower(monkeypatch):
    """Leave-one-out's run of gradient checkpointing itself recorded a million times slower
    than measured: a plan that keeps something is never found no faster than GC (NOTE [ Never
    slower than GC ] in ds_hilore/plan/validate.py), whatever the load, so tests of what a plan
    stores see it stored. The layers' variants keep their measured times."""
    from ds_hilore.plan.validate import LeaveOneOut

    record = LeaveOneOut.record

    def slower_gc(self, variant, seconds, tokens=None):
        return record(self, variant, seconds * 1e6 if variant == LeaveOneOut.GC else seconds, tokens)

    monkeypatch.setattr(LeaveOneOut, "record", slower_gc)


def packing_pays(monkeypatch):
    """Every unit's measured times replaced by ones that make H pay 1 s and L 0.98 s (its
    codec costs 0.02 s): the knapsack then fills the memory with H and L whatever the load,
    packing only where H does not fit (and the risk budget allows)."""
    fixed_profile_times(monkeypatch, codec_s=0.01)


def one_torch_thread():
    """A module fixture body (wrap it with ``pytest.fixture``): one torch thread while the
    module's tests run -- on a small shared CPU two threads make a tiny model's microbatch
    many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def planner_model():
    """The small Qwen2 the allocator's and exposure's tests plan on."""
    return tiny_model("qwen2", layers=2, hidden=64, intermediate=128, dropout=False)


class CountOps(TorchDispatchMode):
    """Counts the aten ops run under it whose name starts with one of ``prefixes``
    (e.g. "aten.mm.")."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func).startswith(self.prefixes)
        return func(*args, **(kwargs or {}))
