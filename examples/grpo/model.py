"""The actor: a built-in preset (a small Qwen2 or Llama and a character tokenizer, built from
a transformers config, nothing downloaded) or a local checkpoint directory.

    model, tokenizer = load_actor("qwen2-small")          # random weights, char tokenizer
    model, tokenizer = load_actor("out/warm_start/3f2a")   # a directory: from_pretrained
"""

from __future__ import annotations

import dataclasses
import string
import warnings
from pathlib import Path

import torch
import transformers

__all__ = ["PRESETS", "Preset", "add_lora", "build_tokenizer", "load_actor"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model shape and the supervised warm start that gives it something to improve on."""

    arch: str  # a key of ARCHS
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    warm_start_steps: int  # supervised steps of the warm start
    warm_start_batch: int  # sequences per warm-start step
    warm_start_lr: float


ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}

PRESETS: dict[str, Preset] = {
    # tests: seconds per step; the warm start barely teaches it anything
    "qwen2-tiny": Preset("qwen2", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                         warm_start_steps=20, warm_start_batch=32, warm_start_lr=3e-3),
    # make demo: big enough for the actor update to dominate a step on a CPU
    "qwen2-small": Preset("qwen2", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=512,
                          warm_start_steps=120, warm_start_batch=32, warm_start_lr=1e-3),
    # make demo (--task count): qwen2-small's shape; answers of ~175 tokens, so 8 a warm-start step
    "qwen2-count": Preset("qwen2", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=512,
                          warm_start_steps=200, warm_start_batch=8, warm_start_lr=3e-3),
    "llama-small": Preset("llama", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=512,
                          warm_start_steps=120, warm_start_batch=32, warm_start_lr=1e-3),
}

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus <pad>, <eos>, <unk>; pads on the left
    (prompts are generated from, so they end where the completion starts)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left")


def build_preset(name: str, seed: int) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase]:
    """A randomly initialised model of preset ``name`` (seeded) and the character tokenizer."""
    preset = PRESETS[name]
    tokenizer = build_tokenizer()
    config_cls, model_cls = ARCHS[preset.arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=preset.hidden, num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
        intermediate_size=preset.intermediate, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return model_cls(config), tokenizer


def load_actor(name_or_path: str) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase]:
    """A local checkpoint directory (model and tokenizer, offline), fp32."""
    path = Path(name_or_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def add_lora(model: torch.nn.Module, dim: int, module_names: str, only_optimize_lora: bool):
    """DeepSpeed-Chat's ``--actor_lora_dim`` / ``--actor_lora_module_name`` with peft: LoRA on
    every linear layer whose name contains one of the comma-separated ``module_names``."""
    import peft

    wanted = [part.strip() for part in module_names.split(",") if part.strip()]
    targets = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and any(w in name for w in wanted)]
    if not targets:
        raise ValueError(f"--actor_lora_module_name {module_names!r} matches no linear layer of the "
                         "model; use names such as 'layers.' (every decoder layer) or 'mlp'.")
    config = peft.LoraConfig(r=dim, lora_alpha=dim, lora_dropout=0.0, target_modules=targets)
    with warnings.catch_warnings():  # peft reads transformers' deprecated alias; harmless
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = peft.get_peft_model(model, config)
    if not only_optimize_lora:  # peft freezes the base model; DeepSpeed-Chat trains it too then
        for p in model.parameters():
            p.requires_grad_(True)
    return model
