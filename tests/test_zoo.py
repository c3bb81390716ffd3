"""ds_hilore.bench.zoo: small random models of any transformers causal-LM architecture, from configs."""

import pytest
import torch

from ds_hilore.bench import zoo


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_causal_lm_types_are_transformers_causal_lms():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = zoo.causal_lm_types()
    assert types == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {"llama", "qwen3_moe", "gpt_neox", "opt", "gemma2"} <= set(types)


def test_llama_is_small_eager_fp32_in_training_mode_with_dropout():
    model = zoo.tiny_causal_lm("llama")
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.head_dim) == (4, 16)
    assert config.num_key_value_heads == 4  # llama's default is multi-head: kept
    assert config.attention_dropout == 0.1
    assert config._attn_implementation == "eager"
    assert not config.tie_word_embeddings
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert _n_params(model) <= zoo.MAX_PARAMETERS


def test_seed_fixes_the_weights():
    a, b, c = (zoo.tiny_causal_lm("qwen2", seed=s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_sizes_layers_hidden_dropout_vocab():
    model = zoo.tiny_causal_lm("gpt2", layers=3, hidden=32, dropout=0.0, vocab=256)
    config = model.config
    assert (config.n_layer, config.n_embd, config.vocab_size) == (3, 32, 256)
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.0
    assert config.bos_token_id < 256 and config.eos_token_id < 256  # 50256 by default


def test_moe_is_small():
    config = zoo.tiny_causal_lm("qwen3_moe").config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)


def test_sliding_window_is_shorter_than_the_batch():
    config = zoo.tiny_causal_lm("gemma2").config
    assert config.sliding_window == 8 < zoo.tiny_batch().get("input_ids").shape[1]
    assert sorted(set(config.layer_types)) == ["full_attention", "sliding_attention"]


def test_hybrid_keeps_every_layer_kind():
    config = zoo.tiny_causal_lm("qwen3_next").config  # 3 linear-attention layers, then 1 full
    assert config.layer_types == ["linear_attention", "full_attention"]


@pytest.mark.parametrize("default, expected", [
    ({"num_hidden_layers": 8, "layer_types": ["a", "a", "a", "b"] * 2}, ["a", "b"]),
    ({"num_hidden_layers": 4, "layer_types": ["a", "a", "b", "b"], "mlp": ["d", "s", "s", "s"]},
     {"layer_types": ["a", "b"], "mlp": ["d", "s"]}),
    ({"num_hidden_layers": 3, "layer_types": ["a", "a", "a"]}, ["a", "a"]),
    ({"num_hidden_layers": 2, "layer_types": ["a", "b"]}, None),  # already small: untouched
])
def test_per_layer_lists_keep_distinct_kinds(default, expected):
    out = zoo._per_layer_lists(default, default, layers=2)
    if expected is None:
        assert out == {}
    elif isinstance(expected, dict):
        assert out == expected
    else:
        assert out == {"layer_types": expected}


@pytest.mark.parametrize("kv, expected", [(32, 4), (None, 4), (1, 1), (8, 2)],
                         ids=["multi-head", "unset", "multi-query", "grouped"])
def test_key_value_heads_keep_the_attention_kind(kv, expected):
    fields = {"num_attention_heads": 32, "num_key_value_heads": kv}
    assert zoo._attention_kind(fields, zoo.Size()) == {"num_key_value_heads": expected}


@pytest.mark.parametrize("model_type, reason", [
    ("cpmant", "CpmAntForCausalLM does not support gradient checkpointing"),
    ("xlnet", "XLNetLMHeadModel does not support gradient checkpointing"),
])
def test_what_cannot_be_built_small_is_skipped_with_the_reason(model_type, reason):
    with pytest.raises(zoo.ZooSkip) as skip:
        zoo.tiny_causal_lm(model_type)
    assert skip.value.reason == reason and skip.value.model_type == model_type


def test_unknown_model_type_says_where_the_names_are():
    with pytest.raises(KeyError, match=r"causal_lm_types\(\)"):
        zoo.tiny_causal_lm("lama")


def test_tiny_batch_is_left_padded_and_inside_the_vocab():
    model = zoo.tiny_causal_lm("llama", vocab=64)
    inputs = zoo.tiny_batch(model, batch=2, seq=8, seed=3)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == torch.int64
    assert 3 <= int(ids.min()) and int(ids.max()) < 64
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1] and bool(mask[1].all())
    assert torch.equal(ids, zoo.tiny_batch(model, batch=2, seq=8, seed=3)["input_ids"])
