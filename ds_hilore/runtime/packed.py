"""Packed sequences: several sequences in one row of a microbatch, found at its first layer.

NOTE [ Packed sequences ]
A packed row holds several sequences: segment k is the token range [s_k, e_k), s_k
the positions where position_ids restart at 0 (and 0). The segments are the
microbatch's sequences wherever rows are otherwise: per-sequence slices (of storages
proven token-major: storage.segment_spans; others are kept whole), packing, exposure
(one value per segment), zero detection and elision, and the elision checks (the
gradient at the elided segments' token ranges). Per-sequence plans (set_plan rows) give
one action per segment, or one for the whole row.
Unlike rows, segments of one row can see each other: attention mixes them unless its
mask keeps each query inside its own segment. An earlier segment with zero
coefficients read by a later one gets gradient *inside* a layer, where no check at a
layer's output sees it -- eliding it would be wrong. So a segment is elided only when
(a) the attention mask of every layer is a tensor proving that no query attends
outside its segment (transformers builds such a mask from packed position_ids when no
attention_mask is passed; checked here on the device, with the segments), or (b) it
and every segment after it have zero coefficients: in a causal model nothing reads
the last tokens. Otherwise (a plain causal mask, or no mask tensor: SDPA's is_causal,
flash-attention's varlen) a zero segment followed by a non-zero one stays kept: exact.
(b) rests on causality, which a mask tensor can deny (a prefix-LM block lets earlier
queries read later keys): a mask tensor is checked for that too, and where one lets a
query read a later key, only a row whose every segment is zero elides anything.
The check at the last layer's output still decides between E and R as for rows
(NOTE [ Checked elision ] in elision.py); a layer mixing tokens outside its attention
(a convolution) would send gradient to an elided segment through the layer below's
output, which the per-layer flags catch: an error, never a silent wrong gradient.
"""

from __future__ import annotations

import torch


def packed_sequences(mb, frame, function) -> bool:
    """Whether the microbatch packs several sequences into one row (position_ids restart,
    as OpenRLHF and TRL's padding-free mode produce); if so, hands ``frame`` its segments.
    Read once per microbatch, and only for one-row inputs (and once more for a layer whose
    attention mask is another tensor than the first layer's). NOTE [ Packed sequences ]."""
    keywords = getattr(function, "keywords", None) or {}
    position_ids = keywords.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
            or position_ids.shape[0] != 1 or position_ids.shape[1] < 2 \
            or position_ids.shape[1] != frame.seq_len:
        return False
    mask = keywords.get("attention_mask")
    if mb.packed is None:  # the first layer: find the segments (one read)
        starts = position_ids[0] == 0
        starts[0] = True
        values = torch.cat([starts, _segments_mix(mask, starts)]).tolist()  # the one read
        bounds = [t for t, v in enumerate(values[:-2]) if v]
        if len(bounds) < 2:
            return False
        mb.segments = list(zip(bounds, bounds[1:] + [frame.seq_len]))
        mb.mask_independence = {_mask_key(mask): (not values[-2], not values[-1])}
    key = _mask_key(mask)
    if key not in mb.mask_independence:  # another mask (e.g. a sliding-window layer)
        starts = torch.zeros(frame.seq_len, dtype=torch.bool, device=position_ids.device)
        starts[[s for s, _ in mb.segments]] = True
        mixing, later = _segments_mix(mask, starts).tolist()
        mb.mask_independence[key] = (not mixing, not later)
    frame.set_segments(mb.segments, *mb.mask_independence[key])
    return True


def _mask_key(mask) -> tuple | None:
    if not isinstance(mask, torch.Tensor):
        return None
    return (mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), mask.dtype)


def _segments_mix(mask, starts: torch.Tensor) -> torch.Tensor:
    """(2,) bool on the device: whether the attention mask lets a query see a key of another
    segment, and whether it lets a query see a later key (not causal); ``starts``: (T,) True
    at each segment's first token. (True, False) -- mixing assumed, causal as a decoder's
    attention without a mask tensor is -- for anything but a (1, heads or 1, T, T) boolean
    mask (True: attend) or additive float mask (its dtype's minimum or -inf: masked)."""
    seq_len = starts.shape[0]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] != 1 \
            or tuple(mask.shape[-2:]) != (seq_len, seq_len) \
            or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return torch.tensor([True, False], device=starts.device)
    segment = starts.long().cumsum(0).to(mask.device)  # (T,) segment number of every token
    keys = torch.arange(seq_len, device=mask.device)  # (T,)
    mixing = torch.zeros((), dtype=torch.bool, device=mask.device)
    later = torch.zeros((), dtype=torch.bool, device=mask.device)
    chunk = max(1, (1 << 24) // seq_len)  # query rows at a time: bounded temporary memory
    for q0 in range(0, seq_len, chunk):
        block = mask[0, :, q0:q0 + chunk]  # (heads, q, T)
        allowed = block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min
        seen = allowed.any(0)  # (q, T)
        mixing = mixing | (seen & (segment[q0:q0 + chunk, None] != segment[None])).any()
        later = later | (seen & (keys[q0:q0 + chunk, None] < keys[None])).any()
    return torch.stack([mixing, later]).to(starts.device)
