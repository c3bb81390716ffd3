"""``hilore profile``: what each recovery unit of a model costs and what HiLoRe plans for a shape.

The command's flags (``add_arguments``) and its run (``run``): build a small random model of a
preset or load a local checkpoint, attach HiLoRe, run synthetic GRPO microbatches of one shape
-- the profiled ones all-R, then the calibrated ones, then leave-one-out -- and print per unit
the bytes kept by H / L, the recompute and codec times, the utilities, the codec's error, the
calibrated susceptibility and the planned action; then the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ds_hilore.bench.options import add_run_arguments
from ds_hilore.cli.common import EXIT_CONFIG_ERROR, BadFlag, load_checkpoint, model_source, say

__all__ = ["HELP", "PROFILE_HIDDEN", "PROFILE_LAYERS", "add_arguments", "run"]

HELP = "measure what each recovery unit costs and what HiLoRe plans for one shape"
DESCRIPTION = ("Build the model --model names (a preset or a transformers model type, small and "
               "with random weights; or a local checkpoint, never downloaded), attach HiLoRe, "
               "run synthetic GRPO microbatches of one shape -- the profiled ones all-R, then the "
               "calibrated ones -- and print per unit: bytes kept by H, L and a fast-forward, "
               "recompute / pack / unpack time, the utility of H and L against R, the codec's "
               "relative error, the calibrated susceptibility s of its group and the planned "
               "action; then the plan's mix, kept bytes and estimated error.")

PROFILE_LAYERS, PROFILE_HIDDEN = 4, 256  # size of a preset model of ``hilore profile``
MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="NAME_OR_DIR", required=True,
                         help="a preset (as hilore bench takes, e.g. paper-cpu), a local "
                              "checkpoint directory, or a transformers model type such as qwen2 "
                              "(`hilore units --list-models`)")
    parser.add_argument("--seq-len", metavar="N", type=int, required=True,
                         help="tokens per sequence (>= 2)")
    parser.add_argument("--micro-batch", metavar="B", type=int, required=True,
                         help="sequences per microbatch (>= 1; in GRPO groups of 2)")
    parser.add_argument("--layers", metavar="L", type=int, default=PROFILE_LAYERS,
                         help=f"decoder layers of a preset or model type (default {PROFILE_LAYERS})")
    parser.add_argument("--hidden", metavar="H", type=int, default=PROFILE_HIDDEN,
                         help=f"hidden width of a model type (default {PROFILE_HIDDEN}; a preset "
                              "has its own)")
    parser.add_argument("--lora-r", metavar="R", type=int, default=None,
                         help="train LoRA adapters of rank R on every linear layer (peft) "
                              "instead of the full model")
    parser.add_argument("--calibrate", metavar="K", type=int, default=4,
                         help="planned microbatches with a calibration pass after the profiled "
                              "ones (default 4; 0: the susceptibility keeps its prior)")
    parser.add_argument("--memory-budget", metavar="X", type=float, default=None,
                         help="budget as a multiple of GC's peak (default: the config's, 1.10)")
    parser.add_argument("--config", metavar="DS_CONFIG", default=None,
                         help="ds_config whose \"hilore\" block to profile with (codec, "
                              "profile_microbatches ...); default: built-in")
    add_run_arguments(parser, json_help="also write everything (profile, plan, susceptibility "
                      "samples) as JSON")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                         help="where to run (default auto: cuda if available)")
    parser.add_argument("--spearman", action="store_true", help=(
        "hold out one more microbatch and report how well the predicted risk ranks the measured "
        "gradient error of every packable unit's less and more exposed half of the sequences "
        "(two matched passes per unit)"))


# ---------------------------------------------------------------------------------- profile
def run(args: argparse.Namespace) -> int:
    """``hilore profile``: measure, plan, print (and ``--json``); the exit status."""
    import torch

    from ds_hilore import HiLoReConfigError, HiLoReError, attach
    from ds_hilore.bench import zoo

    begin = time.perf_counter()
    try:
        _check_profile_flags(args)
        source = model_source(args.model)
        device = _profile_device(args.device)
        config = _profile_config(args)
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        _progress(f"building {args.model} ({source.description})")
        model = _profile_model(args, source).to(device)
        runtime = attach(model, config)
    except BadFlag as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except zoo.ZooSkip as skip:
        print(f"error: --model {args.model}: no small {args.model} model can be built: "
              f"{skip.reason}. Pass another model type (`hilore units --list-models`), a preset or a local "
              "checkpoint directory.", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except OSError as error:
        print(f"error: --model {args.model}: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (HiLoReConfigError, HiLoReError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        if runtime.policy is None:
            raise HiLoReError("HiLoRe found no decoder layers to plan for in this model; "
                              "set layer_pattern in the \"hilore\" block of --config.")
        runtime.policy.passes.SETTLE = None  # every calibration --calibrate asks for is run
        report = _profile_run(model, runtime, args, device)
    except BadFlag as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except HiLoReError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        runtime.detach()
    report["model"]["source"] = args.model
    report["wall_s"] = time.perf_counter() - begin
    print(_profile_table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
            handle.write("\n")
        _progress(f"wrote {args.json}")
    return 0


def _progress(message: str) -> None:
    say("profile", message)


def _check_profile_flags(args: argparse.Namespace) -> None:
    """Raises ``BadFlag`` (one line: the flag, its value and the fix) for a value out of range."""
    import os

    checks = [
        ("--seq-len", args.seq_len, args.seq_len >= 2,
         "must be >= 2 (the loss predicts each next token); pass e.g. --seq-len 512"),
        ("--micro-batch", args.micro_batch, args.micro_batch >= 1,
         "must be >= 1; pass e.g. --micro-batch 8"),
        ("--layers", args.layers, args.layers >= 1, f"must be >= 1; pass e.g. --layers {PROFILE_LAYERS}"),
        ("--hidden", args.hidden, args.hidden >= 8 and args.hidden % 8 == 0,
         f"must be a positive multiple of 8 (4 heads of an even width); pass e.g. --hidden {PROFILE_HIDDEN}"),
        ("--lora-r", args.lora_r, args.lora_r is None or args.lora_r >= 1,
         "must be >= 1; pass e.g. --lora-r 16, or leave it out to train the full model"),
        ("--calibrate", args.calibrate, args.calibrate >= 0,
         "must be >= 0 (0: no calibration); pass e.g. --calibrate 4"),
        ("--memory-budget", args.memory_budget,
         args.memory_budget is None or (args.memory_budget >= 1.0 and args.memory_budget < float("inf")),
         "must be >= 1.0 (a multiple of gradient checkpointing's peak); pass e.g. --memory-budget 1.1"),
        ("--threads", args.threads, args.threads is None or args.threads >= 1,
         "must be >= 1; pass e.g. --threads 4, or leave it out"),
    ]
    for flag, value, ok, fix in checks:
        if not ok:
            raise BadFlag(f"{flag} {value}: {fix}.")
    if args.json is not None:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            raise BadFlag(f"--json {args.json}: no directory {folder!r} to write it in; "
                           "pass a path in an existing directory.")


def _profile_device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise BadFlag("--device cuda: no CUDA device is available here; pass --device cpu.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _profile_config(args: argparse.Namespace):
    """The "hilore" block to profile with: --config's (or the defaults), deciding by itself."""
    from ds_hilore import HiLoReConfig

    base = HiLoReConfig.from_ds_config(args.config) if args.config else HiLoReConfig()
    values = base.to_dict()
    if values.get("force_plan") is not None:
        _progress("ignoring force_plan of --config: profiling needs HiLoRe deciding by itself")
    values.update(enabled=True, force_plan=None, calibration_microbatches=args.calibrate)
    if args.memory_budget is not None:
        values.update(memory_budget=args.memory_budget, memory_budget_bytes=None, memory_fraction=None)
    return HiLoReConfig(**values)


def _profile_model(args: argparse.Namespace, source):
    from ds_hilore.bench import zoo
    from ds_hilore.bench.models import build_model

    if source.kind == "preset":
        model = build_model(source.value, "fp32", "cpu", args.seed, layers=args.layers, lora_r=None)
    elif source.kind == "dir":
        model = load_checkpoint(source.value)
    else:
        model = zoo.tiny_causal_lm(source.value, layers=args.layers, hidden=args.hidden, seed=args.seed)
    if args.lora_r is not None:
        model = _with_lora(model, args.lora_r, args.seed)
    return model


def _with_lora(model, r: int, seed: int):
    """LoRA adapters of rank ``r`` on every linear layer (peft's "all-linear": not the LM head);
    B initialised small and non-zero, so every adapter carries gradient from the first step."""
    import torch

    try:
        import peft
    except ImportError:
        raise BadFlag(f"--lora-r {r}: needs the peft package (pip install peft); "
                       "or leave --lora-r out to train the full model.") from None
    # as `hilore bench` (peft's default dropout): the profile shows what the bench plans with
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear")
    try:
        lora = peft.get_peft_model(model, config)
    except ValueError as error:
        raise BadFlag(f"--lora-r {r}: peft cannot wrap this model: "
                       f"{str(error).splitlines()[0]}; leave --lora-r out.") from None
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return lora.train()


def _grpo_microbatch(model, batch: int, seq: int, seed: int, device) -> None:
    """Forward and backward of one synthetic GRPO microbatch of (batch, seq) random tokens;
    rewards differ within each group of 2, so every advantage is non-zero (an odd last row: 1),
    scaled by the batch's std as TRL's scale_rewards="batch" does, so |A| differs between groups;
    completions have random lengths (at least a quarter of the positions): exposure varies."""
    import torch

    from ds_hilore import find_runtime
    from ds_hilore.grpo import exposure, group_advantages, policy_loss

    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(3 if vocab > 3 else 0, vocab, (batch, seq), generator=generator)  # (B, T)
    rewards = torch.rand(batch, generator=generator, dtype=torch.float64)  # (B,)
    advantages = torch.ones(batch, dtype=torch.float32)  # (B,)
    paired = batch - batch % 2
    if paired:
        advantages[:paired] = group_advantages(rewards[:paired], group_size=2, scale="batch").float()
    lengths = torch.randint(max(1, (seq - 1) // 4), seq, (batch,), generator=generator)  # (B,)
    mask = (torch.arange(seq - 1)[None, :] < lengths[:, None]).float().to(device)  # (B, T-1)
    ids, advantages = ids.to(device), advantages.to(device)
    runtime = find_runtime(model)
    if runtime is not None:  # on-policy, beta = 0: |A_i| x response tokens is exact before the forward
        runtime.expect(exposure.predicted(advantages, mask))
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    policy_loss(logp, logp.detach(), advantages, mask, model=model).loss.backward()


def _max_positions(model) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _profile_run(model, runtime, args: argparse.Namespace, device) -> dict:
    """Runs the profiled and the calibrated microbatches; returns the report (plain data)."""
    import torch

    from ds_hilore import HiLoReError

    scheduler = runtime.policy
    profiled = runtime.config.profile_microbatches
    total = profiled + max(args.calibrate, 1)  # the plan is built at the first planned forward
    for step in range(total):
        calibrated, begin = scheduler.calibrated, time.perf_counter()
        try:
            _grpo_microbatch(model, args.micro_batch, args.seq_len, args.seed * 100_003 + step, device)
        except HiLoReError:
            raise
        except (IndexError, RuntimeError) as error:
            limit = _max_positions(model)
            if step == 0 and limit is not None and args.seq_len > limit:
                raise BadFlag(f"--seq-len {args.seq_len}: the model's forward fails beyond its "
                               f"{limit} positions ({type(error).__name__}: "
                               f"{str(error).splitlines()[0]}); pass --seq-len {limit} or less.") from None
            raise
        runtime.end_step()
        phase = ("profiled, all R" if step < profiled else
                 "planned, calibration pass" if scheduler.calibrated > calibrated else "planned")
        _progress(f"[{step + 1}/{total}] microbatch {args.micro_batch}x{args.seq_len} ({phase}): "
                  f"{time.perf_counter() - begin:.1f} s")
    step = total
    while any(b.loo is not None for b in scheduler.buckets.values()):  # leave-one-out to its end
        begin = time.perf_counter()
        _grpo_microbatch(model, args.micro_batch, args.seq_len, args.seed * 100_003 + step, device)
        runtime.end_step()
        step += 1
        _progress(f"[{step}] microbatch {args.micro_batch}x{args.seq_len} (leave-one-out timing): "
                  f"{time.perf_counter() - begin:.1f} s")
    if args.spearman:
        begin = time.perf_counter()
        scheduler.hold_out()
        _grpo_microbatch(model, args.micro_batch, args.seq_len, args.seed * 100_003 + step, device)
        runtime.end_step()
        _progress(f"held-out microbatch: ranking check of the risk model: "
                  f"{time.perf_counter() - begin:.1f} s")
    return _profile_report(model, runtime, args, device, torch.get_num_threads())


def _profile_report(model, runtime, args: argparse.Namespace, device, threads: int) -> dict:
    from ds_hilore import HiLoReError
    from ds_hilore.plan.profile import BucketProfile
    from ds_hilore.plan.risk import RiskModel, group_of

    stats = runtime.stats
    keys = [k for k, p in stats["profiles"].items() if p is not None]
    if len(keys) != 1 or stats["plans"].get(keys[0]) is None:
        raise HiLoReError(f"expected one profiled and planned shape, found profiles {sorted(keys)}; "
                          "this is a bug in hilore profile.")
    key = keys[0]
    profile_dict, plan = stats["profiles"][key], dict(stats["plans"][key])
    profile = BucketProfile.from_dict(profile_dict)
    calibration = stats["calibration"]
    risk = RiskModel.from_dict({"samples": calibration["susceptibility"]})
    layers = 1 + max((c.layer for c in profile.units), default=0)
    codec = runtime._codec is not None
    rows = []
    for cost in profile.units:
        group = group_of(cost.kind, cost.layer, layers)
        packable = codec and cost.l_bytes < cost.h_bytes
        rows.append({
            "name": cost.name, "kind": cost.kind, "layer": cost.layer, "pos": cost.pos,
            "h_bytes": cost.h_bytes, "l_bytes": cost.l_bytes, "ff_bytes": cost.ff_bytes,
            "recompute_s": cost.recompute_s, "capture_s": cost.capture_s, "pack_s": cost.pack_s,
            "unpack_s": cost.unpack_s, "derive_s": cost.derive_s, "derived_bytes": cost.derived_bytes,
            "utility_h_s": cost.utility_h, "utility_l_s": cost.utility_l,
            "rel_error": cost.rel_error, "packable": packable, "sliceable": cost.sliceable,
            "group": group, "susceptibility": risk.susceptibility(group),
            "susceptibility_from": ("group" if risk.samples.get(group) else
                                    "kind" if any(v for g, v in risk.samples.items()
                                                  if g.split(":")[0] == cost.kind) else
                                    "all groups" if any(risk.samples.values()) else "prior"),
            "action": plan["actions"].get(cost.name, "R")})
    plan["mix"] = {a: sum(1 for x in plan["actions"].values() if x == a) for a in "HLSR"}
    plan["risk_budget"] = stats["risk_budget"]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    return {
        "model": {"class": type(base).__name__, "layers": layers,
                  "hidden": model.get_input_embeddings().embedding_dim, "lora_r": args.lora_r,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)},
        "shape": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "bucket": key},
        "device": str(device), "threads": threads, "codec": runtime.config.low_precision,
        "gc_peak_bytes": profile.gc_peak_bytes, "baseline_bytes": profile.baseline_bytes,
        "budget_bytes": stats["budget_bytes"], "planned_peak_bytes": stats["peak_bytes"],
        "profiled_microbatches": runtime.config.profile_microbatches, "profile_repeats": profile.repeats,
        "profiling_s": profile.seconds, "calibration_microbatches": calibration["microbatches"],
        "calibration_s": calibration["seconds"],
        "units": rows, "plan": plan,
        "susceptibility": {"prior": risk.prior, "samples": risk.to_dict()["samples"],
                           "groups": {g: risk.susceptibility(g) for g in sorted({r["group"] for r in rows})}},
        "profile": profile_dict, "config": runtime.config.to_dict(),
        "leave_one_out": stats.get("leave_one_out", {}).get(key),
        "ranking": stats.get("ranking"),
        "exposure_quartiles": stats.get("exposure_quartiles"),
    }


def _profile_table(report: dict) -> str:
    """The text ``hilore profile`` prints: header, one row per unit, the plan."""
    shape, plan = report["shape"], report["plan"]
    budget = report["budget_bytes"]
    lora = f", LoRA r={report['model']['lora_r']}" if report["model"].get("lora_r") else ""
    lines = [
        (f"{report['model']['class']} ({report['model'].get('source', '?')}{lora}): microbatch "
         f"{shape['micro_batch']}x{shape['seq_len']} (bucket {shape['bucket']}) on {report['device']}, "
         f"{len(report['units'])} recovery units, codec {report['codec']}"),
        f"GC peak {report['gc_peak_bytes'] / MIB:.1f} MiB (whole process), budget "
        + ("-" if budget is None else f"{budget / MIB:.1f} MiB")
        + f"; profiling {report['profiling_s']:.2f} s ({report['profiled_microbatches']} all-R "
        f"microbatches, medians of {report['profile_repeats']}), calibration "
        f"{report['calibration_s']:.2f} s ({report['calibration_microbatches']} microbatch"
        f"{'' if report['calibration_microbatches'] == 1 else 'es'})",
        "",
    ]
    columns = ("name", "kind", "H", "L", "ff", "recompute", "pack", "unpack", "U(H)", "U(L)",
               "err", "s", "action")
    units_row = ("", "", "MiB", "MiB", "MiB", "ms", "ms", "ms", "ms", "ms", "rel", "", "")
    table = []
    for row in report["units"]:
        packable = row["packable"]
        table.append((
            row["name"], row["kind"], f"{row['h_bytes'] / MIB:.3f}", f"{row['l_bytes'] / MIB:.3f}",
            f"{row['ff_bytes'] / MIB:.3f}", f"{row['recompute_s'] * 1e3:.2f}",
            f"{row['pack_s'] * 1e3:.2f}" if packable else "-",
            f"{row['unpack_s'] * 1e3:.2f}" if packable else "-",
            f"{row['utility_h_s'] * 1e3:+.2f}",
            f"{row['utility_l_s'] * 1e3:+.2f}" if packable else "-",
            f"{row['rel_error']:.4f}" if packable else "-",
            f"{row['susceptibility']:.3f}", row["action"]))
    widths = [max(len(str(r[i])) for r in (columns, units_row, *table)) for i in range(len(columns))]

    def fmt(cells) -> str:
        out = [f"{cells[0]:<{widths[0]}}", f"{cells[1]:<{widths[1]}}"]
        out += [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:])]
        return "  ".join(out).rstrip()

    lines += [fmt(columns), fmt(units_row), *map(fmt, table), ""]
    mix = plan["mix"]
    over = plan.get("peak_over_gc")  # NOTE [ A plan priced phase by phase ] in plan/allocate.py
    peak = "" if over is None else f", its peak priced {over / MIB:.2f} MiB over GC's"
    lines.append(f"plan: {mix['H']} H, {mix['L']} L, {mix['S']} S, {mix['R']} R; kept "
                 f"{plan['memory_bytes'] / MIB:.2f} MiB{peak}, "
                 f"{max(plan['headroom_bytes'], 0) / MIB:.2f} MiB headroom; saves {plan['utility_s'] * 1e3:.1f} ms per microbatch against all-R; "
                 f"estimated error {plan['risk']:.4f} (risk budget {plan['risk_budget']:.4f})")
    sus = report["susceptibility"]
    groups = ", ".join(f"{g} {s:.3f} ({len(sus['samples'].get(g, []))})" for g, s in sus["groups"].items())
    lines.append(f"s: susceptibility of the unit's group (kind, depth half), median of its calibration "
                 f"samples (count): {groups}; a group without samples takes its kind's, else all groups', "
                 f"before any the prior {sus['prior']:.1f}")
    loo = report.get("leave_one_out")
    if loo:
        saved = ", ".join(f"layer {k} {v * 1e3:+.1f} ms" for k, v in sorted(loo["utilities_s"].items()))
        lines.append(f"leave-one-out (time each kept layer saves under joint execution): {saved}; "
                     f"recomputed from then on: {loo['recomputed_layers'] or 'none'}")
    ranking = report.get("ranking")
    if ranking:
        rho = ranking["spearman"]
        lines.append(f"held-out ranking check: Spearman {'n/a' if rho is None else f'{rho:.2f}'} "
                     f"between predicted risk and measured gradient error over "
                     f"{len(ranking['slices'])} slices (each packable unit's less / more exposed half)"
                     + ("" if ranking.get("spearman_advantage") is None else
                        f"; advantage-only exposure: {ranking['spearman_advantage']:.2f}"))
    quartiles = report.get("exposure_quartiles")
    if quartiles:
        where = ", ".join(f"{a} {q['top']:.0%} / {q['bottom']:.0%}" for a, q in sorted(quartiles.items()))
        lines.append(f"by exposure, share on the most / least exposed quarter of the sequences: {where} "
                     "(H, L: bytes; R: recomputed slices)")
    lines.append("U(H) = recompute - capture - derive, U(L) = recompute - pack - unpack - derive: "
                 "the time a microbatch saves against R (derive: re-deriving pointwise tensors); "
                 "'-': not packable")
    return "\n".join(lines)
