"""Recovery units found from each layer's execution, and the defects that discovery closes.

Every exactness check is bitwise against the model without checkpointing (CPU fp32, dropout on);
each test names the defect it pins.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import transformers
from models import batch, loss_and_grads, tiny_model

import ds_hilore
from ds_hilore import HiLoReError
from ds_hilore.runtime.bundle import placeholder
from ds_hilore.runtime.storage import row_block
from ds_hilore.runtime.weights import WeightRecognizer, WeightRef

EXACT = {"low_precision": "none"}
PLANS = ["H", "R", {"*.attn": "H", "*.mlp": "R"}, {"*.attn": "R", "*.mlp": "H"}]


def _grads(model, x, seed=3):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


class PostNormBlock(nn.Module):
    """MiniMax's layer shape: the residual is the *normed* input, read after the attention."""

    def __init__(self, d=16):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = nn.Sequential(nn.Linear(d, d), nn.Dropout(0.2))
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = self.input_layernorm(x)
        residual = x  # an output of the attention unit's first child, read after the unit
        x = residual * 0.7 + self.self_attn(x) * 1.3
        x = self.post_attention_layernorm(x)
        return x * 0.5 + self.mlp(x)


def test_a_unit_output_read_after_the_unit_is_kept_for_the_fast_forward():
    # the MiniMax defect: a fast-forward handed on only the unit's last output, and the layer
    # body read `residual` -- zeros -- so attn-H/mlp-R gave wrong gradients without an error
    torch.manual_seed(0)
    model = nn.Sequential(PostNormBlock(), PostNormBlock()).train()
    x = torch.randn(3, 7, 16)
    ref = _grads(model, x)
    runtime = ds_hilore.attach(model, dict(EXACT, layer_pattern="[0-9]"))
    assert runtime.units == ()  # no probe input for a plain module: found at first use
    first = _grads(model, x)  # the discovery call runs as plain autograd
    assert all(torch.equal(a, b) for a, b in zip(ref, first))
    assert [u.name for u in runtime.units] == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert runtime.units[0].children == ("input_layernorm", "self_attn", "post_attention_layernorm")
    assert runtime.units[1].children == ("mlp",)
    for plan in PLANS:
        runtime.set_plan(plan)
        got = _grads(model, x)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), plan


class _OtherRanks:
    """``runtime.collective`` of 2 ranks, the other one simulated (NOTE [ One split for every
    rank ]): rank 0 ranks a layer's candidate splits ``ranking`` (None: as this rank does),
    and the other rank's verification of the splits after call ``failed`` fails."""

    def __init__(self, ranking=None, failed=()):
        self.ranking, self.failed = ranking, set(failed)
        self.mine: list[list[int]] = []  # this rank's own rankings, one per layer discovered

    def broadcast_object(self, obj):
        if sys._getframe(1).f_code.co_name != "_choose":
            return obj
        self.mine.append(list(obj))
        return list(obj) if self.ranking is None else list(self.ranking)

    def all_reduce_max(self, values):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "verify" and caller.f_locals["k"] in self.failed:
            return [2]  # not reproduced there
        return list(values)

    def all_reduce_max_float(self, values):
        return list(values)


CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@pytest.mark.parametrize("ranking, failed, after", [([1, 2, 0], (), 1), (None, (2,), 0)],
                         ids=["rank_0_ranks_another_first", "another_rank_fails_the_first"])
def test_every_rank_splits_a_layer_as_rank_0_ranked_it_where_every_rank_verifies_it(
        ranking, failed, after):
    torch.manual_seed(0)
    model = nn.Sequential(PostNormBlock(), PostNormBlock()).train()
    x = torch.randn(3, 7, 16)
    ref = _grads(model, x)
    runtime = ds_hilore.attach(model, dict(EXACT, layer_pattern="[0-9]"))
    collective = runtime.collective = _OtherRanks(ranking, failed)
    _grads(model, x)  # discovery: every layer of the kind is split alike
    assert collective.mine == [[2, 0, 1]]  # alone, this rank splits after the second norm
    assert runtime.units[0].children == CHILDREN[:after + 1]  # where every rank splits
    assert runtime.units[1].children == CHILDREN[after + 1:]
    assert runtime.units[2].children == CHILDREN[:after + 1]  # the other layer alike
    for plan in PLANS:
        runtime.set_plan(plan)
        got = _grads(model, x)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), plan


def test_minimax_is_exact_under_every_plan():
    config = transformers.MiniMaxConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=64, layer_types=["full_attention", "full_attention"],
        attention_dropout=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MiniMaxForCausalLM(config).train()
    inputs = batch()
    _, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, EXACT)
    assert [u.kind for u in runtime.units] == ["attn", "mlp"] * 2
    for plan in PLANS:
        runtime.set_plan(plan)
        _, grads = loss_and_grads(model, inputs)
        assert [n for n in ref if not torch.equal(ref[n], grads[n])] == [], plan


def test_placeholders_are_nan_so_a_wrong_use_shows():
    assert placeholder(torch.zeros(2, 3)).isnan().all()
    assert placeholder(((4,), torch.bfloat16, torch.device("cpu"))).isnan().all()
    assert (placeholder(torch.zeros(2, dtype=torch.long)) == torch.iinfo(torch.long).min).all()


class CountingBlock(nn.Module):
    """Keeps state across calls: every call adds one to a buffer its output depends on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x * self.calls)  # the linear saves an input that differs on a re-run


def test_a_layer_that_keeps_state_across_calls_is_refused_with_its_class():
    model = nn.Sequential(CountingBlock()).train()
    ds_hilore.attach(model, dict(EXACT, layer_pattern="0"))
    with pytest.raises(HiLoReError) as err:
        model(torch.randn(2, 3, 8, requires_grad=True))
    assert "CountingBlock" in str(err.value) and "state across calls" in str(err.value)


_CALLS = [0]


@torch.library.custom_op("hilore_test::fused_attn", mutates_args=())
def _fused_attn(q: torch.Tensor, dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's fused attention in miniature: an output and a philox-like RNG state, which,
    without dropout, is left uninitialised (here: different on every call)."""
    _CALLS[0] += 1
    return q.tanh(), torch.full((2,), _CALLS[0], dtype=torch.long)


@_fused_attn.register_fake
def _(q, dropout_p):
    return torch.empty_like(q), q.new_empty((2,), dtype=torch.long)


class _FusedAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, dropout_p):
        out, state = torch.ops.hilore_test.fused_attn(q, dropout_p)
        ctx.save_for_backward(out, state)  # as the kernels do: the state goes to the backward
        return out

    @staticmethod
    def backward(ctx, grad):
        out, _ = ctx.saved_tensors
        return grad * (1 - out * out), None


class FusedAttnBlock(nn.Module):
    def __init__(self, dropout_p, d=8):
        super().__init__()
        self.dropout_p = dropout_p
        self.q = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        x = x + _FusedAttn.apply(self.q(x), self.dropout_p)
        return x + self.mlp(x)


@pytest.mark.parametrize("plan", ["H", "R"])
def test_rng_state_of_a_dropout_free_kernel_is_not_compared(plan):
    # CUDA's flash / memory-efficient attention save a philox seed and offset that, without
    # dropout, nothing reads and nobody initialises: discovery refused every layer on CUDA
    torch.manual_seed(0)
    model = nn.Sequential(FusedAttnBlock(0.0), FusedAttnBlock(0.0)).train()
    x = torch.randn(3, 5, 8)
    ref = _grads(model, x)
    ds_hilore.attach(model, dict(EXACT, layer_pattern="[0-9]", force_plan=plan))
    _grads(model, x)  # the discovery call
    got = _grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_rng_state_of_a_kernel_with_dropout_must_reproduce():
    # with dropout the state is read: a re-run that does not reproduce it is refused
    model = nn.Sequential(FusedAttnBlock(0.1)).train()
    ds_hilore.attach(model, dict(EXACT, layer_pattern="0"))
    with pytest.raises(HiLoReError, match="FusedAttnBlock"):
        model(torch.randn(2, 3, 8, requires_grad=True))


def test_parallel_block_is_split_with_the_shared_input_kept():
    # Cohere: the MLP reads input_layernorm's output, a child of the attention unit
    model = tiny_model("gpt_neox", layers=2)
    runtime = ds_hilore.attach(model, EXACT)
    assert [u.kind for u in runtime.units] == ["attn", "mlp"] * 2
    cfg = transformers.CohereConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    cohere = transformers.CohereForCausalLM(cfg).train()
    runtime = ds_hilore.attach(cohere, EXACT)
    layer = runtime._layers[0]
    assert runtime.units[0].children == ("input_layernorm", "self_attn")
    assert runtime.units[1].children == ("mlp",)
    assert layer.split.cut == frozenset({(0, 0)})  # the norm's output, not the attention's


def test_override_that_is_not_contiguous_is_refused():
    model = tiny_model("llama", layers=1)
    with pytest.raises(HiLoReError, match="must all run before"):
        ds_hilore.attach(model, dict(EXACT, attn_children=["post_attention_layernorm", "self_attn"],
                                     mlp_children=["input_layernorm", "mlp"]))


# ---- per-sequence slices only where batch-first is proven (NOTE [ Batch-first ]) -----------
def test_slices_only_proven_batch_first_layouts():
    B, T, H = 2, 6, 4
    x = torch.randn(B, T, H)
    assert row_block(x, B, T) == T * H  # (B, T, H)
    assert row_block(x.view(B * T, H), B, T) == T * H  # flattened linear input: a view
    assert row_block(torch.randn(T, B, H), B, T) is None  # (T, B, H): dim 0 is 6, a multiple
    assert row_block(torch.randn(B * T, H), B, T) is None  # (B*T, H) without history: unproven
    permuted = x.view(B * T, H)[torch.randperm(B * T)]  # MoE buffer: tokens permuted
    assert row_block(permuted, B, T) is None
    assert row_block(torch.randn(T, T, H), T, T) is None  # B == T: undecidable, kept whole
    q = torch.randn(B, 3, T, H, requires_grad=True)
    folded = (q * 1).transpose(1, 2).reshape(B * T, 3 * H)  # copy + view: recorded input (B, T, 3, H)
    assert row_block(folded, B, T) == T * 3 * H


# ---- weights: casts proven in full, never poisoned; offsets relative to the parameter ------
def test_cast_recognition_is_not_poisoned_by_a_same_shape_weight():
    torch.manual_seed(0)
    layer = nn.Module()
    layer.a, layer.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    for p in layer.parameters():
        p.requires_grad_(False)
    recognize = WeightRecognizer([layer])
    cast_b = layer.b.weight.to(torch.bfloat16)  # compared first against a's weight: no match
    assert recognize(cast_b, layer).param is layer.b.weight
    cast_a = layer.a.weight.to(torch.bfloat16)
    assert recognize(cast_a, layer).param is layer.a.weight  # a failed comparison is not cached
    assert recognize(cast_b.t(), layer).param is layer.b.weight  # known by its storage now
    activation = torch.randn(8, 8).to(torch.bfloat16)
    assert recognize(activation, layer) is None
    activation[0, 0] = cast_a[0, 0]
    tail = cast_a.clone()
    tail[-1, -1] += 1  # differs only in the last element: a sampled check would miss it
    assert recognize(tail, layer) is None


def test_weight_ref_offset_is_relative_to_the_parameter():
    p = nn.Parameter(torch.arange(12.0).view(3, 4))
    row = p.detach()[1]  # storage offset 4 into p
    ref = WeightRef(p, None, row, p)
    flat = torch.zeros(100)
    flat[50:62] = p.detach().view(-1)
    p.data = flat[50:62].view(3, 4)  # re-gathered elsewhere in a flat buffer (ZeRO-3)
    assert torch.equal(ref.get(), torch.tensor([4.0, 5.0, 6.0, 7.0]))


# ---- backward-time contract -----------------------------------------------------------------
def test_second_order_backward_is_refused():
    model = tiny_model("llama", layers=1)
    ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    out = model(**batch()).logits.square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(HiLoReError, match="second-order backward"):
        torch.autograd.grad(out, params, create_graph=True)


def test_every_n_layers_leaves_the_others_to_plain_autograd():
    model = tiny_model("llama", layers=4)
    inputs = batch()
    _, ref = loss_and_grads(model, inputs)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="R"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                        every_n_layers=2)
    _, grads = loss_and_grads(model, inputs)
    assert [n for n in ref if not torch.equal(ref[n], grads[n])] == []
    recomputed = runtime.stats["recomputed_units"]
    assert recomputed == 4  # layers 0 and 2, two units each; layers 1 and 3 keep everything
    assert [layer.module.gradient_checkpointing for layer in runtime._layers] == [True, False] * 2


def test_router_logits_recorded_means_no_elision():
    # an MoE auxiliary loss reaches the layer through the router logits, not its output: the
    # check at the output cannot see it, so such layers keep every sequence
    from ds_hilore.grpo import policy_loss

    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.5)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).train()
    ids = batch()["input_ids"]

    def grads():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        adv = torch.tensor([1.0, 0.0, -1.0])  # sequence 1: ω ≡ 0
        loss = policy_loss(logp, None, adv, torch.ones_like(logp, dtype=torch.bool),
                           loss_type="grpo", model=model).loss + out.aux_loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    got = grads()
    assert [n for n in ref if not torch.equal(ref[n], got[n])] == []
    assert runtime.stats["actions"]["E"] == 0 and runtime.stats["recomputed_units"] == 0


def test_packed_sequences_are_exact_and_handled_per_row(caplog):
    # OpenRLHF / TRL padding-free: one row, position_ids restarting per sequence; a sequence
    # with zero coefficients shares its row with others, so nothing is elided -- and exact
    from ds_hilore.grpo import policy_loss

    model = tiny_model("llama", layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (1, 24), generator=g)
    position_ids = torch.cat([torch.arange(8), torch.arange(10), torch.arange(6)])[None]

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        logits = model(input_ids=ids, position_ids=position_ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.ones_like(logp, dtype=torch.bool)
        mask[:, 7:17] = False  # the second sequence: no coefficient at all
        policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, loss_type="grpo",
                    model=model).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan={"*.attn": "H", "*.mlp": "R"}))
    with caplog.at_level("WARNING", logger="ds_hilore"):
        first, second = grads(), grads()
    assert [n for n in ref if not torch.equal(ref[n], first[n])] == []
    assert [n for n in ref if not torch.equal(ref[n], second[n])] == []
    assert sum("packed sequences" in r.message for r in caplog.records) == 1  # said once
    assert runtime.stats["actions"]["E"] == 0
