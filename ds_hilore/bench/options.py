"""The flags of ``hilore bench``: presets, parsing and checking (one line per bad value).

A preset names a model shape (published ``config.json`` numbers, random weights) and, for the
regime presets (``paper-cpu``), the data shape too: its ``SHAPES`` entry fills every shape flag
the command line leaves out.

NOTE [ The paper-cpu preset ]
The paper's regime on a 2-core CPU, fp32, LoRA r = 16, SDPA attention: many layers, long
responses, activations far above the headroom a budget leaves, recompute a large share of the
update, a vocabulary small enough that the LM head does not dominate. Qwen2-style, hidden 256,
MLP 1024, 8 layers, vocabulary 4,096; 8 sequences of 256 tokens per microbatch, 2 per step.
Measured (peaks by the op-level tracker, FLOPs by ``FlopCounterMode``, both deterministic; the
report prints them as ``regime``): no-GC's whole-process peak 2.16x GC's (582 vs 269 MiB), GC's
recompute 29 % of its update's FLOPs. The sequence length was halved from 512 (2.79x, same
FLOP share) so that ``nogc,gc,static,hr,hilore`` with 10 paired rounds stays near 90 optimizer
steps of a few seconds each on two idle cores.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.targets import default_tolerance

__all__ = ["DEFAULT_METHODS", "PRESETS", "SHAPES", "BenchError", "add_arguments", "check_args",
           "add_run_arguments", "parse_budgets", "parse_methods", "parse_rounds"]

DEFAULT_METHODS = tuple(METHODS)

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
# --elide-zero-rows: the ds_config's key (NOTE [ Stand-ins on accelerators ])
ELIDE_ZERO_ROWS = {"auto": "auto", "true": True, "whole": "whole", "false": False}
# shape flags -> value; the defaults for every model, then a regime preset's own

DEFAULT_SHAPE = dict(seq_len=256, micro_batch=8, group_size=8, grad_accum=2, zero_adv_share=0.5,
                     clip_share=0.1)
SHAPES: dict[str, dict[str, Any]] = {
    "paper-cpu": dict(seq_len=256, micro_batch=8, group_size=8, grad_accum=2),
}
MAX_ROUNDS = 200  # --rounds auto stops here at the latest


class BenchError(Exception):
    """A flag value the bench cannot run with; one line naming the flag and what is allowed."""


def parse_budgets(text: str) -> list[float]:
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--budgets {text}: not a comma-separated list of numbers; allowed: "
                         "multiples of GC's peak >= 1.0, e.g. --budgets 1.05,1.10,1.20") from None
    bad = [b for b in budgets if not b >= 1.0 or not math.isfinite(b)]
    if bad or not budgets:
        raise BenchError(f"--budgets {text}: budgets are multiples of GC's peak and must be >= 1.0 "
                         "(e.g. --budgets 1.05,1.10,1.20)")
    return budgets


def parse_methods(text: str | None) -> list[str]:
    names = list(DEFAULT_METHODS) if not text else [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise BenchError(f"--methods: unknown method {','.join(unknown) or '(none)'}; allowed: "
                         f"{', '.join(METHODS)}")
    for required in ("gc", "nogc"):  # the budget's unit and the gradient / speed reference
        if required not in names:
            names.insert(0, required)
    return names


def parse_rounds(text: str) -> int | str:
    """``--rounds``: a count >= 1, or "auto" (until the decisive comparisons are decided)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        rounds = int(text)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise BenchError(f"--rounds {text}: allowed: a number of paired rounds >= 1, or auto "
                         "(add rounds until hilore vs gc / static / the best in-budget rival, and any "
                         "rival level with that one, is decided, within --max-minutes)")
    return rounds


def _shape(args) -> dict[str, Any]:
    """Each shape flag: given, else the preset's, else the default."""
    preset = SHAPES.get(args.model, {})
    return {k: (getattr(args, k) if getattr(args, k, None) is not None else preset.get(k, v))
            for k, v in DEFAULT_SHAPE.items()}


def _check_shape(shape: dict[str, Any]) -> None:
    for flag, low in (("seq_len", 4), ("micro_batch", 1), ("group_size", 1), ("grad_accum", 1)):
        if shape[flag] < low:
            raise BenchError(f"--{flag.replace('_', '-')} {shape[flag]}: must be >= {low}")
    b, g = shape["micro_batch"], shape["group_size"]
    if b % g:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        raise BenchError(f"--group-size {g} does not divide --micro-batch {b} (a group never "
                         f"spans two microbatches); allowed: --group-size one of "
                         f"{','.join(map(str, divisors))}, or --micro-batch a multiple of {g}")
    for flag in ("zero_adv_share", "clip_share"):
        if not 0.0 <= shape[flag] <= 1.0:
            raise BenchError(f"--{flag.replace('_', '-')} {shape[flag]}: allowed: a share "
                             "between 0 and 1")


def check_args(args) -> dict[str, Any]:
    """The bench's configuration from parsed arguments; ``BenchError`` on a bad value."""
    if args.model is None:
        raise BenchError("--model is required (a preset or a local checkpoint directory), or "
                         "--report IN.json to print a saved report")
    if args.model not in PRESETS and not os.path.isdir(args.model):
        raise BenchError(f"--model {args.model}: unknown preset and not a directory; allowed: "
                         f"{', '.join(PRESETS)} or a local checkpoint directory")
    shape = _shape(args)
    _check_shape(shape)
    groups = shape["micro_batch"] * shape["grad_accum"] // shape["group_size"]
    if args.drop_zero_advantage and round(shape["zero_adv_share"] * groups) >= groups:
        raise BenchError(f"--drop-zero-advantage with --zero-adv-share {shape['zero_adv_share']}: "
                         f"all {groups} groups of a step have A = 0, no completion is left to "
                         f"train on; allowed: --zero-adv-share below {(groups - 0.5) / groups:g}")
    if args.layers is not None and args.layers < 1:
        raise BenchError(f"--layers {args.layers}: must be >= 1")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise BenchError(f"--max-minutes {args.max_minutes}: allowed: minutes > 0")
    tolerance = getattr(args, "grad_error_tolerance", None)
    if tolerance is not None and not 0.0 <= tolerance < 1.0:
        raise BenchError(f"--grad-error-tolerance {tolerance:g}: allowed: 0 <= X < 1 (the "
                         "relative error packing may add to a step's gradient)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here; allowed: cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {"model": args.model, **shape, "drop_zero_advantage": bool(args.drop_zero_advantage),
            "budgets": parse_budgets(args.budgets), "methods": parse_methods(args.methods),
            "rounds": parse_rounds(args.rounds), "max_minutes": args.max_minutes,
            "layers": args.layers, "full": bool(args.full), "dtype": args.dtype, "device": device,
            "lora_r": None if args.full else args.lora_r, "codec_backend": args.codec_backend,
            "seed": args.seed, "batches": 2,
            "grad_error_tolerance": default_tolerance() if tolerance is None else tolerance,
            "elide_zero_rows": ELIDE_ZERO_ROWS["false" if getattr(args, "no_elision", False)
                                               else getattr(args, "elide_zero_rows", "auto")],
            "ds_init": bool(getattr(args, "ds_init", False)),
            "strict": bool(getattr(args, "strict", False))}


def add_run_arguments(parser, json_help: str = "write the report as JSON") -> None:
    """The flags ``hilore bench`` and ``hilore profile`` share, spelled and defaulted once."""
    parser.add_argument("--json", metavar="PATH", default=None, help=json_help)
    parser.add_argument("--threads", metavar="T", type=int, default=None,
                        help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def add_arguments(parser) -> None:
    parser.add_argument("--model", metavar="PRESET_OR_DIR", default=None,
                        help=f"a preset ({', '.join(PRESETS)}; random weights) or a local "
                             "checkpoint directory (never downloads)")
    d = DEFAULT_SHAPE
    parser.add_argument("--seq-len", metavar="N", type=int, default=None,
                        help=f"tokens per sequence: prompt T/4, then a response (default {d['seq_len']})")
    parser.add_argument("--micro-batch", metavar="B", type=int, default=None,
                        help=f"sequences per microbatch (default {d['micro_batch']})")
    parser.add_argument("--group-size", metavar="G", type=int, default=None,
                        help=f"GRPO completions per prompt; divides B (default {d['group_size']})")
    parser.add_argument("--grad-accum", metavar="K", type=int, default=None,
                        help=f"microbatches accumulated per optimizer step (default {d['grad_accum']})")
    parser.add_argument("--zero-adv-share", metavar="X", type=float, default=None,
                        help=f"share of groups without reward spread, A = 0 (default {d['zero_adv_share']})")
    parser.add_argument("--clip-share", metavar="X", type=float, default=None,
                        help=f"share of response tokens off-policy beyond the clip range "
                             f"(default {d['clip_share']})")
    parser.add_argument("--drop-zero-advantage", action="store_true",
                        help="the filtered variant: A = 0 completions dropped before the update")
    parser.add_argument("--grad-error-tolerance", metavar="X", type=float, default=None,
                        help="the HiLoRe allocators' error budget (the ds_config's "
                             "grad_error_tolerance, 0 <= X < 1; default: its default, "
                             f"{default_tolerance()})")
    parser.add_argument("--elide-zero-rows", choices=list(ELIDE_ZERO_ROWS), default="auto",
                        help="every HiLoRe run's \"elide_zero_rows\": true (every sequence with "
                             "zero loss coefficients), whole (only microbatches of such "
                             "sequences, their layers' backward skipped: what accelerators get "
                             "by default), false, auto (the default: true on CPU, whole on "
                             "accelerators)")
    parser.add_argument("--no-elision", action="store_true",
                        help="the same as --elide-zero-rows false")
    parser.add_argument("--budgets", default="1.05,1.10,1.20",
                        help="memory budgets, multiples of GC's peak >= 1.0 (default 1.05,1.10,1.20)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default all; nogc and "
                             "gc are always run)")
    parser.add_argument("--rounds", "--repeats", dest="rounds", metavar="N|auto", default="7",
                        help="paired rounds (every run once per round, the order rotating), or "
                             "auto: until hilore vs gc / static / the best in-budget rival (and any "
                             "rival level with it) is decided or --max-minutes is reached (default 7)")
    parser.add_argument("--max-minutes", metavar="M", type=float, default=None,
                        help="the whole bench's time: runs the decisive comparisons do not "
                             "need are dropped when their warm-up would leave no time for 6 "
                             "rounds, and no round starts that would end past M minutes "
                             "(default: none; auto without it: 30)")
    parser.add_argument("--plot", metavar="OUT.png", default=None, help="write the frontier plot (PNG)")
    parser.add_argument("--layers", metavar="L", type=int, default=None, help="cut the model to L decoder layers")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--lora-r", metavar="R", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights' dtype (default fp32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available")
    parser.add_argument("--codec-backend", choices=("compile", "eager"), default="compile",
                        help="HiLoRe's codec kernels (default compile)")
    parser.add_argument("--ds-init", action="store_true",
                        help="ds_ac: start a one-rank DeepSpeed group (gloo on CPU, nccl on CUDA) "
                             "when none is up; without it ds_ac is skipped then")
    parser.add_argument("--strict", action="store_true",
                        help="a method that fails (setup, a step, the FLOP count) ends the bench "
                             "with its error instead of being reported as skipped")
    add_run_arguments(parser)
    parser.add_argument("--report", metavar="IN.json", nargs="+", default=None,
                        help="print the table and targets of a saved report (with --plot: redraw "
                             "it) instead of running; several reports (runs of one command): "
                             "their paired verdicts side by side")
