"""Tiny random-weight causal LMs of any architecture registered in transformers (no downloads).

    >>> from ds_hilore.bench import zoo
    >>> model = zoo.tiny_causal_lm("qwen3")            # 2 layers, hidden 64, dropout 0.1
    >>> inputs = zoo.tiny_batch(model)                 # (3, 16) ids, one left-padded row

``causal_lm_types()`` lists every ``model_type`` that ``AutoModelForCausalLM`` knows.
``tiny_causal_lm`` builds one from its default config with every size field it has made small;
an architecture that cannot be built small raises ``ZooSkip`` with the reason.

NOTE [ Sizing a config by its field names ]
transformers configs spell the same size many ways (``hidden_size`` / ``n_embd`` / ``d_model``,
``num_hidden_layers`` / ``n_layer`` ...). ``_SIZE_FIELDS`` maps each spelling to one value of
``Size``, set wherever the default config has the field -- also where it is ``None`` (a missing
``head_dim`` or ``num_key_value_heads`` would not build), except for the fields of
``_NONE_MEANS_OFF`` (DeepSeek's ``q_lora_rank``, sliding windows). Key/value heads keep the
default's kind (``_attention_kind``); per-layer lists keep every kind of layer
(``_per_layer_lists``); ``_ARCH_FIELDS`` holds what single architectures need besides. The
config is then built again from the defaults plus the overrides, so that ``__init__`` derives
the rest (rope tables, ``layer_types`` patterns) from the small sizes. Sub-configs
(``text_config``, ``vision_config`` ...) are sized the same way.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["MAX_PARAMETERS", "Size", "ZooSkip", "causal_lm_types", "tiny_batch", "tiny_causal_lm"]

MAX_PARAMETERS = 5_000_000


class ZooSkip(Exception):
    """This architecture cannot be built small from its config alone; ``reason`` says why."""

    def __init__(self, model_type: str, reason: str):
        super().__init__(f"{model_type}: {reason}")
        self.model_type = model_type
        self.reason = reason


@dataclass(frozen=True)
class Size:
    """The sizes every architecture gets (see NOTE [ Sizing a config by its field names ])."""

    layers: int = 2
    hidden: int = 64
    vocab: int = 128
    dropout: float = 0.1
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128              # dense MLP width
    expert_ffn: int = 32        # width of each MoE expert / shared expert
    experts: int = 4
    experts_per_token: int = 2
    positions: int = 256
    window: int = 8             # sliding / chunked attention: smaller than tiny_batch's seq 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _fields(names: str, value: Callable[[Size], Any]) -> tuple[tuple[str, ...], Callable[[Size], Any]]:
    return tuple(names.split()), value


_HEADS = ("num_attention_heads n_head n_heads num_heads decoder_attention_heads "
          "encoder_attention_heads attention_heads swa_num_attention_heads "
          "num_decoder_attention_heads")
_KV_HEADS = (  # set by _attention_kind, which keeps the default's kind of attention
    "num_key_value_heads n_kv_heads num_kv_heads kv_n_heads multi_query_group_num "
    "num_query_groups swa_num_key_value_heads")

# One row per size: every spelling a transformers config uses for it, and its small value.
_SIZE_FIELDS = (
    _fields("hidden_size n_embd n_embed d_model dim embed_dim emb_dim embedding_size "
            "word_embed_proj_dim lru_width hidden_size_global model_dim", lambda s: s.hidden),
    _fields("num_hidden_layers n_layer n_layers num_layers decoder_layers encoder_layers "
            "num_decoder_layers", lambda s: s.layers),
    _fields(_HEADS, lambda s: s.heads),
    _fields("head_dim kv_channels attention_head_dim attention_head_size d_kv d_head dim_head "
            "swa_head_dim linear_head_dim", lambda s: s.head_dim),
    _fields("rotary_dim", lambda s: s.head_dim // 2),  # partial rotary, as GPT-J / CodeGen ship
    _fields("intermediate_size ffn_dim n_inner ffn_hidden_size decoder_ffn_dim encoder_ffn_dim "
            "d_ff dim_ff dff d_inner feed_forward_size intermediate_size_mlp mlp_dim "
            "dense_intermediate_size prefix_dense_intermediate_size", lambda s: s.ffn),
    _fields("moe_intermediate_size shared_expert_intermediate_size "
            "shared_experts_intermediate_size moe_shared_expert_intermediate_size "
            "shared_intermediate_size expert_ffn_hidden_size", lambda s: s.expert_ffn),
    _fields("num_experts num_local_experts n_routed_experts moe_num_experts", lambda s: s.experts),
    _fields("num_experts_per_tok num_experts_per_token moe_topk moe_top_k moe_k top_k_experts",
            lambda s: s.experts_per_token),
    _fields("n_group num_expert_group topk_group n_shared_experts num_shared_experts "
            "moe_num_shared_experts first_k_dense_replace", lambda s: 1),
    # multi-head latent attention (DeepSeek-V2/V3 style; head_dim is the rope part) and its
    # sparse indexer
    _fields("kv_lora_rank q_lora_rank o_lora_rank", lambda s: 2 * s.head_dim),
    _fields("qk_rope_head_dim qk_nope_head_dim v_head_dim index_head_dim indexer_head_dim",
            lambda s: s.head_dim),
    _fields("qk_head_dim", lambda s: 2 * s.head_dim),
    _fields("index_n_heads indexer_n_heads indexer_kv_heads", lambda s: s.kv_heads),
    _fields("index_topk indexer_budget", lambda s: s.window),
    _fields("indexer_compress_ratio", lambda s: 2),
    # linear attention and state-space mixers: inner width 2 * hidden in heads of head_dim
    _fields("linear_key_head_dim linear_value_head_dim mamba_d_head mamba_head_dim mamba_headdim",
            lambda s: s.head_dim),
    _fields("linear_num_key_heads", lambda s: s.kv_heads),
    _fields("linear_num_value_heads linear_num_heads", lambda s: s.heads),
    _fields("mamba_n_heads mamba_num_heads n_mamba_heads", lambda s: 2 * s.hidden // s.head_dim),
    _fields("mamba_d_ssm attention_hidden_size", lambda s: 2 * s.hidden),
    _fields("mamba_d_state state_size ssm_state_size", lambda s: 16),
    _fields("mamba_n_groups mamba_ngroups n_groups", lambda s: 1),
    _fields("time_step_rank mamba_dt_rank", lambda s: 8),
    _fields("mamba_chunk_size", lambda s: 16),
    # vocabularies, positions, windows
    _fields("vocab_size vocab_size_per_layer_input unpadded_vocab_size pronunciation_vocab_size "
            "shape_vocab_size encoder_hash_byte_group_vocab", lambda s: s.vocab),
    _fields("hidden_size_per_layer_input", lambda s: s.head_dim),
    _fields("max_position_embeddings n_positions n_ctx max_seq_len max_target_positions "
            "max_source_positions seq_length context_length", lambda s: s.positions),
    _fields("sliding_window sliding_window_size attention_window_size attention_chunk_size",
            lambda s: s.window),
    # every layer computes its own keys and values, with the same shapes as its neighbours
    _fields("num_kv_shared_layers", lambda s: 0),
    _fields("per_layer_config", lambda s: {}),
    # layer-level randomness that would change the model's depth from one call to the next
    _fields("layerdrop encoder_layerdrop decoder_layerdrop", lambda s: 0.0),
)
_SIZE_OF_FIELD = {name: value for names, value in _SIZE_FIELDS for name in names}
# Fields whose None means "this feature is off": they stay None. Other None size fields are
# filled (a None head_dim or num_key_value_heads would not build).
_NONE_MEANS_OFF = frozenset("q_lora_rank o_lora_rank sliding_window sliding_window_size "
                            "attention_window_size attention_chunk_size index_topk".split())
_NO_DROPOUT = ("layerdrop",)  # name parts of float fields that look like dropouts but are not

# model_type -> config fields its small model needs besides the generic ones (a hybrid whose
# layer pattern is not a per-layer list, a field that rejects dropout, ...). Sub-config fields
# are given as nested dicts.
_ARCH_FIELDS: dict[str, dict[str, Any]] = {
    # hybrids whose default small cut has no attention layer (transformers then fails)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # constraints the generic sizes break
    "diffllama": {"attention_dropout": 0.0},  # rejects attention dropout
    "dots3_note": {"text_config": {"head_dim": 32}},  # = qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 32},
    "mamba2": {"num_heads": 8},  # SSM heads: num_heads * head_dim == expand * hidden
    "qwen4_exp": {"text_config": {"indexer_kv_heads": 1}},
    "qwen4_exp_text": {"indexer_kv_heads": 1},
    "zaya": {"num_experts_per_tok": 1},
    # defaults that do not build in transformers itself
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
}


def causal_lm_types() -> list[str]:
    """Every ``model_type`` that ``AutoModelForCausalLM`` can build, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_causal_lm(model_type: str, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                   dropout: float = 0.1, vocab: int = 128) -> torch.nn.Module:
    """A small ``AutoModelForCausalLM`` of ``model_type`` with random weights, fp32, training mode.

    Args:
        model_type: a key of ``causal_lm_types()``, e.g. ``"llama"``.
        layers, hidden, vocab: decoder layers, hidden width and vocabulary size.
        seed: ``torch.manual_seed`` for the weights.
        dropout: every dropout probability the config has.

    Returns:
        The model in training mode with eager attention, at most ``MAX_PARAMETERS`` parameters.

    Raises:
        ZooSkip: the architecture cannot be built small from its config (extra packages, inputs
            other than token ids, too big, no gradient checkpointing, build error).
    """
    if model_type not in causal_lm_types():
        raise KeyError(f"{model_type!r} is not a causal-LM model_type of transformers; "
                       "see ds_hilore.bench.zoo.causal_lm_types()")
    size = Size(layers=layers, hidden=hidden, vocab=vocab, dropout=dropout)
    config = _small_config(model_type, size)
    model = _build(model_type, config, seed)
    _check_model(model_type, model)
    return model


def tiny_batch(model: torch.nn.Module | None = None, batch: int = 3, seq: int = 16,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and attention mask, (batch, seq) int64; row 0 is left-padded by 3 tokens."""
    vocab = _vocab_size(model) if model is not None else 128
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)  # (B, T): clear of pad/bos/eos
    mask = torch.ones_like(ids)  # (B, T)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------------------------- config
def _small_config(model_type: str, size: Size):
    from transformers import AutoConfig

    try:
        with _quiet():
            default = AutoConfig.for_model(model_type)
            overrides = _overrides(default, size, _ARCH_FIELDS.get(model_type))
            return AutoConfig.for_model(model_type, **overrides)
    except ImportError as error:
        raise ZooSkip(model_type, f"needs extra packages: {_first_line(error)}") from None
    except Exception as error:  # noqa: BLE001 -- any config error is a reason to skip
        raise ZooSkip(model_type, f"config error: {type(error).__name__}: {_first_line(error)}") from None


def _overrides(config, size: Size, arch_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Field -> small value for one config and, recursively, its sub-configs."""
    from transformers import PretrainedConfig

    fields = config.to_dict()
    arch_fields = arch_fields or {}
    out: dict[str, Any] = {}
    for name, value in fields.items():
        sub = vars(config).get(name)  # not getattr: per-layer fields of heterogeneous configs raise
        if isinstance(sub, PretrainedConfig):
            out[name] = {**sub.to_dict(), **_overrides(sub, size, arch_fields.get(name))}
        elif isinstance(value, bool) or (value is None and name in _NONE_MEANS_OFF):
            continue
        elif name in _SIZE_OF_FIELD:
            out[name] = _sized(value, _SIZE_OF_FIELD[name](size))
        elif _is_dropout(name, value):
            out[name] = size.dropout
        elif _is_token_id(name):
            out[name] = _in_vocab(value, size.vocab)
    out.update(_attention_kind(fields, size))
    out.update({k: v for k, v in arch_fields.items() if not isinstance(v, dict) or k not in out})
    out.update(_per_layer_lists(fields, {**fields, **out}, size.layers))
    if "tie_word_embeddings" in fields:
        out["tie_word_embeddings"] = False  # the LM head's gradient is its own
    return out


def _attention_kind(fields: dict[str, Any], size: Size) -> dict[str, int]:
    """Key/value heads that keep the default's kind: multi-head, multi-query or grouped.

    Multi-head latent attention (DeepSeek-V2/V3) needs as many key/value heads as query heads.
    """
    heads = next((fields[n] for n in _HEADS.split() if isinstance(fields.get(n), int)), None)
    out = {}
    for name in _KV_HEADS.split():
        if name not in fields or isinstance(fields[name], bool):
            continue
        kv = fields[name]
        out[name] = size.heads if kv in (None, heads) else 1 if kv == 1 else size.kv_heads
    return out


def _sized(default, value):
    """``value``, or one ``value`` per entry where the default is a per-layer list of numbers."""
    if isinstance(default, list) and all(isinstance(v, (int, float)) for v in default):
        return [value] * len(default)
    return value


def _is_dropout(name: str, value) -> bool:
    return (isinstance(value, float) and ("dropout" in name or "pdrop" in name)
            and not any(part in name for part in _NO_DROPOUT))


def _is_token_id(name: str) -> bool:
    return name.endswith(("token_id", "token_index"))


def _in_vocab(value, vocab: int):
    if isinstance(value, int):
        return value if value < vocab else value % vocab
    if isinstance(value, list):
        return [_in_vocab(v, vocab) for v in value]
    return value


def _per_layer_lists(default: dict[str, Any], fields: dict[str, Any], layers: int) -> dict[str, list]:
    """Lists with one entry per layer, cut to ``layers`` entries that show every layer kind.

    Hybrid models describe their layers in lists (``layer_types``: sliding / full / linear
    attention, Mamba; ``mlp_layer_types``: dense / sparse). The kept layers cover as many
    distinct entries as they can -- greedily, the layer that adds the most unseen (list, entry)
    pairs first, earliest on ties -- so a 2-layer model of a 1-in-4 hybrid keeps both kinds;
    the same layers are kept in every list.
    """
    depth = next((default[n] for n in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
                  if isinstance(default.get(n), int)), None)
    if not depth or depth <= layers:
        return {}
    lists = {n: v for n, v in fields.items() if isinstance(v, list) and len(v) == depth}
    if not lists:
        return {}
    entries = [{(n, str(v[i])) for n, v in lists.items()} for i in range(depth)]
    keep: list[int] = []
    seen: set[tuple[str, str]] = set()
    for _ in range(layers):
        best = max((i for i in range(depth) if i not in keep), key=lambda i: (len(entries[i] - seen), -i))
        keep.append(best)
        seen |= entries[best]
    keep.sort()
    return {n: [v[i] for i in keep] for n, v in lists.items()}


# ---------------------------------------------------------------------------------- model
def _build(model_type: str, config, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    try:
        with _quiet():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ImportError as error:
        raise ZooSkip(model_type, f"needs extra packages: {_first_line(error)}") from None
    except Exception as error:  # noqa: BLE001 -- any build error is a reason to skip
        raise ZooSkip(model_type, f"build error: {type(error).__name__}: {_first_line(error)}") from None
    return model.float().train()


def _check_model(model_type: str, model: torch.nn.Module) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > MAX_PARAMETERS:
        raise ZooSkip(model_type, f"too big: {n_params / 1e6:.1f}M parameters from the small config "
                                  f"(limit {MAX_PARAMETERS / 1e6:.0f}M)")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ZooSkip(model_type, f"{type(model).__name__} does not support gradient checkpointing")
    forward = inspect.signature(model.forward).parameters
    if "input_ids" not in forward and "inputs_embeds" not in forward:
        raise ZooSkip(model_type, f"{type(model).__name__} takes no token ids (inputs: "
                                  f"{', '.join(list(forward)[:4])} ...)")
    try:
        with torch.no_grad(), _quiet():
            model(**tiny_batch(model, batch=1, seq=8))
    except Exception as error:  # noqa: BLE001 -- the model itself does not run on token ids
        raise ZooSkip(model_type, f"forward on token ids fails: {type(error).__name__}: "
                                  f"{_first_line(error)}") from None


def _vocab_size(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


# ---------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _quiet():
    """Silence the print()s and logging that some configs and models emit while built."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _first_line(error: BaseException) -> str:
    """The error's message on one line, with its cause where the message only announces it."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines())
    if text.endswith(":") and error.__cause__ is not None:
        text = f"{text} {_first_line(error.__cause__)}"
    return (text or repr(error))[:240]
