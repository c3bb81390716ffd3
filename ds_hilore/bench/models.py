"""The bench's models: presets (published ``config.json`` numbers, random weights) or a local
checkpoint, LoRA adapters by default, and the chunked token log-probs of the GRPO loss.

NOTE [ The paper-cpu preset ]
The paper's regime on a 2-core CPU, fp32, LoRA r = 16, SDPA attention: many layers, long
responses, activations far above the headroom a budget leaves, recompute a large share of the
update, a vocabulary small enough that the LM head does not dominate. Qwen2-style, hidden 256,
MLP 1024, 8 layers, vocabulary 4,096; 8 sequences of 256 tokens per microbatch, 2 per step
(``SHAPES``: the data flags it fills when the command line leaves them out).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

__all__ = ["PRESETS", "SHAPES", "build_model", "is_model", "lm_of", "logprobs"]

_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True,
               rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
PRESETS: dict[str, dict[str, Any]] = {  # published config.json numbers; random weights
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False, max_position_embeddings=4096),
    "paper-cpu": dict(model_type="qwen2", hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=4096, tie_word_embeddings=False, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=4096),
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32064, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       max_position_embeddings=4096),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, vocab_size=262144, tie_word_embeddings=True,
                       sliding_window=512, rms_norm_eps=1e-6, max_position_embeddings=32768),
}
# the data flags a regime preset fills (NOTE [ The paper-cpu preset ])
SHAPES: dict[str, dict[str, Any]] = {
    "paper-cpu": dict(seq_len=256, micro_batch=8, group_size=8, grad_accum=2),
}


def is_model(name: str) -> bool:
    """A preset name or a local checkpoint directory (one with a config.json)."""
    return name in PRESETS or os.path.isfile(os.path.join(name, "config.json"))


def build_model(model: str, dtype: str, device: str, seed: int, layers: int | None = None,
                lora_r: int | None = 16) -> torch.nn.Module:
    """The training-mode model ``model`` (a preset, or a local checkpoint directory; never
    downloads) in ``dtype`` ("fp32" | "bf16") on ``device``, cut to ``layers`` decoder layers,
    with LoRA adapters of rank ``lora_r`` on every linear layer (None: full fine-tuning).
    The same ``seed`` builds the same weights on every rank."""
    import transformers

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.manual_seed(seed)
    if model in PRESETS:
        fields = dict(PRESETS[model])
        if layers is not None:
            fields["num_hidden_layers"] = layers
        cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        lm = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        lm = lm.to(torch_dtype)
    else:
        lm = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True,
                                                               dtype=torch_dtype)
        if layers is not None:
            _cut(lm, layers)
    if lora_r:
        lm = _with_lora(lm, lora_r)
    lm.train()
    return lm.to(device)


def _cut(lm: torch.nn.Module, layers: int) -> None:
    decoder = lm.get_decoder()
    decoder.layers = decoder.layers[:layers]
    lm.config.num_hidden_layers = len(decoder.layers)
    if getattr(lm.config, "layer_types", None):
        lm.config.layer_types = lm.config.layer_types[:layers]


def _with_lora(lm: torch.nn.Module, r: int) -> torch.nn.Module:
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(lm, peft.LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear"))
    for name, p in model.named_parameters():  # non-zero B: every adapter has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT model or a DeepSpeed engine."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, T-1) log-probs of ``ids[:, 1:]`` (ids (B, T) int64), chunked over the vocabulary
    (no (B, T, V) logits). ``model``: a DeepSpeed engine or a module; the whole model runs
    (HiLoRe's scheduler starts a microbatch at its forward), the LM head on one position only,
    the decoder's last hidden state caught by a hook. Under ZeRO-3 the LM head's weight exists
    only inside the forward: there the forward computes the logits itself."""
    from ds_hilore.grpo import token_logprobs

    lm = lm_of(model)
    if hasattr(lm.get_output_embeddings().weight, "ds_numel"):  # partitioned by ZeRO-3
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1)
    captured = {}

    def keep(module, args, out):
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    hook = lm.get_decoder().register_forward_hook(keep)
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = captured["h"]  # (B, T, H)
    return token_logprobs(hidden[:, :-1], lm.get_output_embeddings(), ids[:, 1:])  # (B, T-1)
