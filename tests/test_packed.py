"""Packed sequences (one row, restarting position_ids): slices, exposure and elision per segment.

NOTE [ Packed sequences ] in ds_hilore/runtime/packed.py. Segments here: tokens [0, 8), [8, 18),
[18, 24) of one row of 24 (24 is no other dimension of the tiny models, so layouts are
unambiguous). ``use_cache=False`` without an attention_mask: transformers builds a
block-diagonal causal mask from the packed position_ids (segments never see each other); an
all-ones attention_mask gives the plain causal mask (later segments attend to earlier ones).
"""

import pytest
import torch
from models import tiny_model

import ds_hilore
from ds_hilore import grpo
from ds_hilore.runtime.codecs import get_codec
from ds_hilore.runtime.storage import Counters, Stored, segment_spans

EXACT = {"low_precision": "none"}
# a codec on (nothing is packed under plans H / R): units record the token weights of exposure
EXPOSED = {"low_precision": "int8", "codec_backend": "eager"}
SEGMENTS = [(0, 8), (8, 18), (18, 24)]
T = 24
IDS = torch.randint(1, 128, (1, T), generator=torch.Generator().manual_seed(0))
POSITION_IDS = torch.cat([torch.arange(e - s) for s, e in SEGMENTS])[None]  # (1, T)
MIXED = {"*.attn": "H", "*.mlp": "R"}
MIXED_2 = {"model.layers.0.attn": "R", "model.layers.0.mlp": "H", "model.layers.1.*": "H"}


def _forward(model, causal: bool, seed: int = 3):
    """Logits of the packed row; dropout masks fixed by ``seed``."""
    kwargs = {"input_ids": IDS, "position_ids": POSITION_IDS, "use_cache": False}
    if causal:  # a plain causal mask over the whole row: segments mix
        kwargs["attention_mask"] = torch.ones_like(IDS)
    torch.manual_seed(seed)
    return model(**kwargs).logits.float()


def _logp(logits):
    return logits[:, :-1].log_softmax(-1).gather(-1, IDS[:, 1:, None])[..., 0]  # (1, T - 1)


def _grpo(model, causal: bool, zero=(), entropy: float = 0.0, advantage: float = 1.0):
    """GRPO loss of the packed row; segments in ``zero`` get no coefficient at all (ω ≡ 0 on
    their hidden positions: logp column j belongs to hidden position j)."""
    logits = _forward(model, causal)
    logp = _logp(logits)
    mask = torch.ones_like(logp, dtype=torch.bool)
    for k in zero:
        s, e = SEGMENTS[k]
        mask[:, s:e] = False
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    out = grpo.policy_loss(logp, old, torch.tensor([advantage]), mask, model=model)
    loss = out.loss
    if entropy:  # a loss term ω does not see: it reaches every position
        loss = loss - entropy * -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    return loss, out


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _unequal(ref, got):
    assert ref.keys() == got.keys()
    return [n for n in ref if not torch.equal(ref[n], got[n])]


def _sliced(runtime):
    """Every per-segment storage of the live microbatch."""
    return [st for f in runtime._mb.live_frames() for u in f.units for st in u.stored if st.sliceable]


def _held(runtime) -> int:
    return sum(sum(f.unit_summary(pos)[1].values())
               for f in runtime._mb.live_frames() for pos in range(len(f.units)))


# ---------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("plan", ["H", "R", "mixed", "mixed_2"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_row_is_exact_per_segment(arch, plan, causal):
    plan = {"mixed": MIXED, "mixed_2": MIXED_2}.get(plan, plan)
    reference = tiny_model(arch, layers=2)  # dropout on, fp32, eager attention
    _grpo(reference, causal)[0].backward()
    model = tiny_model(arch, layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan=plan))
    loss, _ = _grpo(model, causal)
    frames = runtime._mb.live_frames()
    # a layer's first call runs through its frame, all R included: it learns there whether its
    # rows can be run apart (NOTE [ A layer that keeps nothing ])
    assert [f.segments for f in frames] == [SEGMENTS] * 2
    assert all(f.segments_independent is not causal for f in frames)
    sliced = _sliced(runtime)
    if plan != "R":  # activations are split per segment: token-major storages only
        assert sliced and all(st.rows == 3 and st.row_states() == ["H"] * 3 for st in sliced)
    loss.backward()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert runtime.stats["actions"]["E"] == 0


def test_per_segment_plan_packs_and_elides_segments():
    # set_plan rows give one action per segment: segment 1 packed (int8), segment 2 elided
    # (predicted zero; ω proves it); the H segment stays bitwise, the gradient stays close
    config = {"low_precision": "int8", "codec_backend": "eager", "min_pack_numel": 0}
    reference = tiny_model("llama", layers=2, dropout=False)
    _grpo(reference, causal=False, zero=[2])[0].backward()
    model = tiny_model("llama", layers=2, dropout=False)
    runtime = ds_hilore.attach(model, dict(config, force_plan="H"))
    runtime.set_plan("H", rows={u.name: ("H", "L", "E") for u in runtime.units})
    loss, _ = _grpo(model, causal=False, zero=[2])
    sliced = _sliced(runtime)
    assert {tuple(st.row_states()) for st in sliced} <= {("H", "L", "E"), ("H", "H", "E")}
    assert any(st.row_states() == ["H", "L", "E"] for st in sliced)
    loss.backward()
    ref, got = _grads(reference), _grads(model)
    assert ref.keys() == got.keys()
    for name in ref:  # measured: at most 0.0068 (int8 on one segment of three), ~3x room
        assert float((got[name] - ref[name]).norm() / ref[name].norm()) < 0.02, name
    assert runtime.stats["recomputed_units"] == 0


def test_a_one_action_plan_applies_to_every_segment():
    # a plan made for the one row elides every segment; ω then says otherwise: R (exact)
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal=False)[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, EXACT)
    runtime.set_plan("H", rows={"model.layers.0.mlp": ("E",)})  # the row: all its segments
    logits = _forward(model, causal=False)
    frame = runtime._mb.frame(0)
    assert frame.plan.rows[1] == ("E",) * 3
    assert [st.row_states() for st in frame.units[1].stored if st.sliceable] != []
    assert all(st.row_states() == ["E"] * 3 for st in frame.units[1].stored if st.sliceable)
    del logits, frame
    _grpo(model, causal=False)[0].backward()
    assert _unequal(_grads(reference), _grads(model)) == []


# ---------------------------------------------------------------------------- elision

@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("plan", ["H", "mixed"])
def test_zero_segment_is_elided_exactly_and_its_bytes_freed(zero, plan):
    # block-diagonal mask: a segment with ω ≡ 0 meets only zeros in backward, wherever it is
    plan = {"mixed": MIXED}.get(plan, plan)
    reference = tiny_model("qwen2", layers=2)
    _grpo(reference, causal=False, zero=[zero])[0].backward()
    model = tiny_model("qwen2", layers=2)
    runtime = ds_hilore.attach(model, dict(EXPOSED, force_plan=plan))
    logits = _forward(model, causal=False)
    before = _held(runtime)
    sliced = _sliced(runtime)
    s, e = SEGMENTS[zero]
    share = sum((st.spans[zero][1] - st.spans[zero][0]) * st.base.element_size() for st in sliced)
    assert all(st.spans[zero][1] - st.spans[zero][0] == (e - s) * (st.spans[-1][1] // T)
               for st in sliced)
    logp = _logp(logits)
    mask = torch.ones_like(logp, dtype=torch.bool)
    mask[:, s:e] = False
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    loss = grpo.policy_loss(logp, old, torch.tensor([1.0]), mask, model=model).loss
    # the segment's bytes are gone, exactly its share of every per-segment storage
    assert share > 0 and before - _held(runtime) == share
    expected = ["H"] * 3
    expected[zero] = "E"
    assert all(st.row_states() == expected for st in sliced)
    assert runtime._mb.zero_rows == [zero]
    assert runtime.stats["microbatches"][-1]["exact_zero_sequences"] == 1
    assert all(len(v) == 3 and v[zero] == 0.0 and min(v[k] for k in range(3) if k != zero) > 0
               for v in runtime.exposure.values())
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert runtime.stats["recomputed_units"] == (0 if plan == "H" else 2)  # R units only


@pytest.mark.parametrize("zero", [0, 1])
def test_a_zero_segment_read_by_a_later_one_is_not_elided(zero):
    # plain causal mask: later segments attend to the zero segment, so inside every layer its
    # keys and values get gradient -- which no check at a layer's output sees. It is kept.
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal=True, zero=[zero])[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXPOSED, force_plan="H"))
    loss, _ = _grpo(model, causal=True, zero=[zero])
    assert runtime._mb.zero_rows == []
    assert all(st.row_states() == ["H"] * 3 for st in _sliced(runtime))
    assert all(v[zero] == 0.0 for v in runtime.exposure.values())  # exposure still says 0
    loss.backward()
    assert _unequal(_grads(reference), _grads(model)) == []


def test_zero_segments_at_the_end_are_elided_under_a_causal_mask():
    # nothing reads the last tokens of a causal model: a zero tail is elided even when mixing
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal=True, zero=[0, 2])[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    loss, _ = _grpo(model, causal=True, zero=[0, 2])
    assert runtime._mb.zero_rows == [2]  # segment 0 is read by segment 1: kept
    assert all(st.row_states() == ["H", "H", "E"] for st in _sliced(runtime))
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert runtime.stats["recomputed_units"] == 0


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_reaching_an_elided_segment_falls_back_to_recompute(causal, caplog):
    # an entropy bonus ω does not see reaches the elided segment at the last layer's output:
    # the check catches it and every layer is recomputed (exact)
    zero = [2] if causal else [1]
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal, zero=zero, entropy=0.01)[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    loss, _ = _grpo(model, causal, zero=zero, entropy=0.01)
    assert runtime._mb.zero_rows == zero
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert "get gradient from other loss terms" in caplog.text
    assert runtime.stats["recomputed_units"] == 4


def test_an_all_zero_packed_row_skips_recompute():
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal=True, advantage=0.0)[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="R"))
    _grpo(model, causal=True, advantage=0.0)[0].backward()
    runtime.end_step()
    assert runtime.stats["recomputed_units"] == 0
    assert runtime.stats["microbatches"][-1]["exact_zero_sequences"] == 3
    assert _unequal(_grads(reference), _grads(model)) == []


# ---------------------------------------------------------------------------- exposure

def test_exposure_per_segment_matches_the_formula():
    model = tiny_model("llama", layers=2, dropout=False)
    runtime = ds_hilore.attach(model, dict(EXPOSED, force_plan="H"))
    unit_inputs = {}
    for i, layer in enumerate(model.model.layers):
        for child, kind in (("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")):
            getattr(layer, child).register_forward_pre_hook(
                lambda m, a, name=f"model.layers.{i}.{kind}": unit_inputs.__setitem__(name, a[0].detach()))
    loss, out = _grpo(model, causal=False, zero=[1])
    omega = torch.zeros(1, T)
    omega[:, :T - 1] = out.coefficients.abs()  # hidden positions 0 .. T-2
    covered = torch.zeros(1, T)
    covered[:, :T - 1] = 1.0
    assert len(runtime.exposure) == 4
    for name, values in runtime.exposure.items():
        norms = unit_inputs[name].float().norm(dim=-1) * covered  # (1, T)
        a = norms / (norms.sum() / covered.sum())
        expected = torch.stack([(omega * a)[0, s:e].sum() for s, e in SEGMENTS])
        torch.testing.assert_close(torch.tensor(values), expected, rtol=1e-6, atol=0)
        assert values[1] == 0.0
    loss.backward()


# ---------------------------------------------------------------------------- storage

def test_segment_spans_accept_only_proven_token_major_layouts():
    segments = [(0, 3), (3, 7)]
    x = torch.randn(1, 7, 5)
    assert segment_spans(x, segments, 7) == ((0, 15), (15, 35))
    assert segment_spans(x.view(7, 5), segments, 7) == ((0, 15), (15, 35))  # flattened (1, T, H)
    assert segment_spans(torch.randn(1, 7, 7), segments, 7) is None  # which 7 is T?
    assert segment_spans(torch.randn(1, 7, 2, 7), segments, 7) is None  # (1, heads = T, T, d)
    assert segment_spans(torch.randn(1, 4, 7, 5), segments, 7) is None  # head-major
    assert segment_spans(torch.randn(7, 5), segments, 7) is None  # nothing proves dim 0 is T
    assert segment_spans(torch.randn(1, 5, 7).transpose(1, 2), segments, 7) is None  # not contiguous
    assert segment_spans(torch.randn(1, 7, 10)[..., :5], segments, 7) is None  # part of a storage


def test_stored_packs_and_elides_segments_of_a_packed_row():
    codec = get_codec("int8", "eager")
    segments = [(0, 3), (3, 7), (7, 12)]
    x = torch.randn(1, 12, 32)
    spans = segment_spans(x, segments, 12)
    stored = Stored(x, 3, spans, 32, codec, True, Counters())
    stored.set_rows([0, 1, 2], "L")  # one run
    assert len({id(p) for p in stored.parts}) == 1
    stored.set_rows([1], "E")  # the run is re-cut: segment 1's payload and scales are freed
    assert stored.row_states() == ["L", "E", "L"]
    expected = codec.unpack(codec.pack(x.view(-1, 32))).view(1, 12, 32)
    expected[:, 3:7] = 1.0  # the stand-in
    assert torch.equal(stored.view((x.size(), x.stride(), 0)), expected)
    runs = {id(p): p for p in stored.parts if p is not None}.values()
    assert sorted((r.start, r.stop) for r in runs) == [(0, 1), (2, 3)]
    assert sum(r.packed.payload.numel() for r in runs) == 8 * 32  # tokens 0-2 and 7-11
    assert sum(r.packed.scales.numel() for r in runs) == 8


def test_a_zero_advantage_segment_handed_as_coefficients_is_elided_exactly():
    # OpenRLHF-style per-token advantages of a packed row: the middle sequence's group had
    # identical rewards (A = 0); ω = -A_t / n handed to the runtime by the caller's own loss
    advantages = torch.cat([torch.full((8,), 1.0), torch.zeros(10), torch.full((5,), -0.5)])[None]

    def step(model, runtime=None):
        logp = _logp(_forward(model, causal=False))
        omega = -advantages / advantages.numel()  # (1, T - 1) = ∂loss/∂logp
        if runtime is not None:
            runtime.set_coefficients(omega, logp=logp)
        return (omega * logp).sum()

    reference = tiny_model("qwen2", layers=2)
    step(reference).backward()
    model = tiny_model("qwen2", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan={"*.attn": "H", "*.mlp": "R"}))
    loss = step(model, runtime)
    assert runtime._mb.zero_rows == [1]
    assert all(st.row_states() == ["H", "E", "H"] for st in _sliced(runtime))
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert runtime.stats["recomputed_units"] == 2  # the R units; elision held


# ---------------------------------------------------------------------------- masks and calls
def _prefix_lm(model, zero=(2,)):
    """GRPO loss of the packed row under a prefix-LM mask (causal, and the first 20 tokens see
    each other: earlier queries read later keys, segment 2's first two tokens among them)."""
    allowed = torch.ones(T, T).tril().bool()
    allowed[:20, :20] = True
    torch.manual_seed(3)
    logits = model(input_ids=IDS, position_ids=POSITION_IDS, attention_mask=allowed[None, None],
                   use_cache=False).logits.float()
    logp = _logp(logits)
    mask = torch.ones_like(logp, dtype=torch.bool)
    for k in zero:
        mask[:, SEGMENTS[k][0]:SEGMENTS[k][1]] = False
    return grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, model=model).loss


@pytest.mark.parametrize("layers", [None, "model.layers.1"])
def test_a_zero_tail_read_by_earlier_queries_is_not_elided(layers):
    """The zero tail's rule rests on causality; a mask letting earlier queries read later keys
    denies it, so nothing is elided (with HiLoRe on the last layer only, no check below it
    would have seen the gradient those keys get inside the layer)."""
    reference = tiny_model("llama", layers=2)
    _prefix_lm(reference).backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H", layer_pattern=layers))
    loss = _prefix_lm(model)
    assert runtime._mb.zero_rows == []
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []


def test_downgrade_to_e_refuses_a_segment_later_ones_read_and_checks_a_tail():
    """``runtime.downgrade(unit, "E", rows)`` on a causal packed row: a middle segment is
    refused with the reason, a zero tail is elided and checked like the runtime's own."""
    reference = tiny_model("llama", layers=2)
    _grpo(reference, causal=True, zero=[1, 2])[0].backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    runtime.config.elide_zero_rows = False  # the caller decides alone
    loss, _ = _grpo(model, causal=True, zero=[1, 2])
    with pytest.raises(ds_hilore.HiLoReError, match=r"rows=\[1\]\): sequences packed into one row"):
        runtime.downgrade("model.layers.0.attn", "E", rows=[1])
    for unit in runtime.units:
        runtime.downgrade(unit.name, "E", rows=[2])
    assert all(st.row_states() == ["H", "H", "E"] for st in _sliced(runtime))
    loss.backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []


def test_per_sequence_coefficients_of_a_packed_row_name_the_layout_it_needs():
    """A loss computed per sequence, (K, L) log-probs cut out of the row, hands K rows of
    coefficients for a forward of one row: the error says how to hand them, and the automatic
    source (from the gradient) trains it, exactly."""
    def step(model):
        logits = _forward(model, causal=False)
        row = logits[0, :-1].log_softmax(-1).gather(-1, IDS[0, 1:, None])[..., 0]  # (T - 1,)
        logp = torch.stack([row[s:s + 5] for s, _ in SEGMENTS])  # (K, 5)
        return grpo.policy_loss(logp, logp.detach(), torch.tensor([1.0, 0.0, -1.0]),
                                torch.ones_like(logp, dtype=torch.bool), model=model).loss

    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H"))
    with pytest.raises(ds_hilore.HiLoReError, match=r"3 rows of coefficients for a forward of one "
                       r"packed row \(3 sequences, 24 tokens\).*exposure_source"):
        step(model)
    runtime.detach()
    reference = tiny_model("llama", layers=2)
    step(reference).backward()
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, dict(EXACT, force_plan="H", exposure_source="hidden_grad"))
    step(model).backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []


@pytest.mark.parametrize("packed", [True, False])
def test_rows_elided_at_capture_without_coefficients_are_recomputed(packed):
    """``exposure_source`` "analytic" and a loss that hands none: nothing proves what the plan
    elided at capture, so those units are recomputed (exact)."""
    weights = torch.tensor([1.0, 0.3, -0.5])

    def step(model):
        if packed:
            logp = _logp(_forward(model, causal=False))  # (1, T - 1)
            return (logp * weights.repeat_interleave(torch.tensor([8, 10, 5]))[None]).mean()
        ids = IDS.view(3, 8)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (logp * weights[:, None]).mean()

    reference = tiny_model("llama", layers=2, dropout=False)
    step(reference).backward()
    model = tiny_model("llama", layers=2, dropout=False)
    runtime = ds_hilore.attach(model, dict(EXACT, exposure_source="analytic"))
    runtime.set_plan("H", rows={u.name: ("H", "E", "H") for u in runtime.units})
    step(model).backward()
    runtime.end_step()
    assert _unequal(_grads(reference), _grads(model)) == []
    assert runtime.stats["recomputed_units"] == 4


def test_one_short_segment_does_not_keep_a_packed_row_whole():
    """``min_pack_numel`` is per sequence slice: a one-token segment (a pad) among long ones
    does not make the row's storages unpackable."""
    lengths = [12, 11, 1]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    model = tiny_model("llama", layers=2)
    runtime = ds_hilore.attach(model, {"low_precision": "int8", "codec_backend": "eager",
                                       "force_plan": "L", "min_pack_numel": 200})
    logits = model(input_ids=IDS, position_ids=position_ids, use_cache=False).logits
    assert any("L" in st.row_states() for st in _sliced(runtime))
    assert runtime.stats["bytes"]["L"] > 0
    logits.float().sum().backward()
    runtime.end_step()
