#!/usr/bin/env bash
# One-shot GPU run of `hilore bench` in the paper's regime, on a fresh machine that has its own
# torch (and transformers, peft, accelerate, mpi4py) but no deepspeed and no package registry.
#
#   examples/bench/gpu.sh [WHEELS_DIR]     (default: $HILORE_WHEELS, else examples/bench/wheels,
#                                           filled beforehand by `make gpu-wheels`)
#
# Everything goes to one folder, $OUT (default output/gpu-bench): gpu.log (this script's whole
# output), versions.txt, device_check.json, bench.json, bench.png, run.json, run.png. Steps:
#   1. torch and its CUDA device, as found (never reinstalled);
#   2. what is missing -- deepspeed first -- installed from the wheels folder with
#      `pip install --no-index --no-deps`; this checkout goes on PYTHONPATH;
#   3. the versions used;
#   4. exactness (H and R against GC, bf16, bitwise; elision: NOTE [ Stand-ins on accelerators ])
#      and the CUDA peak, allocated and reserved,
#      against the budget (python -m ds_hilore.bench.device_check, at most 4 minutes);
#   5. the bench, paired rounds: one rank on this GPU (DeepSpeed ZeRO-2, NCCL), qwen2.5-1.5b
#      widths, all 28 layers, bf16, LoRA r=16, responses up to 2048 tokens after a prompt,
#      micro-batch 4, 2 microbatches per step, budget 1.10, nogc,gc,static,hr,hilore, until
#      decided or HILORE_GPU_MINUTES (default 14) less what step 6 needs is used;
#   6. the bench, the whole run: fresh nogc, gc and hilore engines, HILORE_RUN_STEPS (default
#      24) steps each at lengths 1024, 2048 and 2732 (several shape buckets), HiLoRe's warm-up
#      included (HILORE_RUN_MINUTES, default 4, then SIGINT: the steps done are reported).
# Fails loudly: any error stops the script (set -e) except a failed check of step 4, which is
# reported and makes the final exit status 1 after the bench has run; a method that fails on the
# device fails the bench (every rank's error ends it).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEELS="${1:-${HILORE_WHEELS:-$REPO/examples/bench/wheels}}"
OUT="${OUT:-$REPO/output/gpu-bench}"
PY="${PYTHON:-python3}"
MINUTES="${HILORE_GPU_MINUTES:-14}"
RUN_MINUTES="${HILORE_RUN_MINUTES:-4}"
RUN_STEPS="${HILORE_RUN_STEPS:-24}"
read -r -a EXTRA <<< "${HILORE_BENCH_FLAGS:-}"  # more bench flags, e.g. --elide-zero-rows false
START="$(date +%s)"

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.log") 2>&1
TEE=$!
trap 'exec >&- 2>&-; wait "$TEE" 2>/dev/null || true' EXIT  # the log's last lines written
cd "$REPO"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(mktemp -d)}"  # JIT ops, out of $OUT
export PYTHONUNBUFFERED=1

echo "== 1. torch and the device"
"$PY" - <<'PYEOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("error: torch sees no CUDA device (torch %s, built for CUDA %s)"
                     % (torch.__version__, torch.version.cuda))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PYEOF

echo "== 2. installing what is missing from $WHEELS (torch untouched)"
# import name:distribution name
NEEDED="deepspeed:deepspeed hjson:hjson cpuinfo:py-cpuinfo msgpack:msgpack einops:einops
        ninja:ninja pydantic:pydantic pydantic_core:pydantic-core annotated_types:annotated-types
        typing_inspection:typing-inspection matplotlib:matplotlib contourpy:contourpy
        cycler:cycler fontTools:fonttools kiwisolver:kiwisolver PIL:pillow pyparsing:pyparsing
        dateutil:python-dateutil tzdata:tzdata"
missing=()
for pair in $NEEDED; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    [ -d "$WHEELS" ] || { echo "error: missing ${missing[*]} and no wheels folder $WHEELS (make gpu-wheels)"; exit 1; }
    echo "installing: ${missing[*]}"
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --find-links "$WHEELS" "${missing[@]}"
fi
# typing-extensions is there (torch needs it), maybe older than pydantic needs: upgraded only then
te_wheel="$(ls "$WHEELS"/typing_extensions-*.whl 2>/dev/null | head -n 1 || true)"
if [ -n "$te_wheel" ] && ! "$PY" - "$te_wheel" <<'PYEOF'
import importlib.metadata as m, os, sys
def version(text): return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())
want = version(os.path.basename(sys.argv[1]).split("-")[1])
sys.exit(0 if version(m.version("typing_extensions")) >= want else 1)
PYEOF
then
    echo "upgrading typing-extensions to $(basename "$te_wheel")"
    "$PY" -m pip install --no-index --no-deps --upgrade "$te_wheel"
fi
"$PY" -m pip check || echo "(pip check above: reported, not a failure)"
# this checkout from its folder: an editable install would need setuptools from a registry
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, deepspeed, ds_hilore, matplotlib.pyplot" >/dev/null
export DS_ACCELERATOR=cuda

echo "== 3. versions"
"$PY" - <<'PYEOF' | tee "$OUT/versions.txt"
import importlib.metadata as m, platform, torch
print(f"python {platform.python_version()}; GPU {torch.cuda.get_device_name()}; "
      f"CUDA {torch.version.cuda}")
for name in ("torch", "deepspeed", "transformers", "peft", "accelerate", "mpi4py", "pydantic",
             "matplotlib", "ds_hilore"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} (not installed)")
PYEOF

echo "== 4. exactness and memory on CUDA (bf16)"
check=0
timeout -k 15 --signal=INT 240 "$PY" -m ds_hilore.bench.device_check --device cuda \
    --dtype bf16 --budget 1.10 --json "$OUT/device_check.json" || check=$?
if [ "$check" -ne 0 ]; then
    echo "DEVICE CHECK FAILED (exit $check): see above and $OUT/device_check.json"
fi

echo "== 5. the bench: paired rounds"
left=$(( MINUTES * 60 - ($(date +%s) - START) - RUN_MINUTES * 60 - 60 ))  # seconds
if [ "$left" -lt 120 ]; then
    echo "error: only ${left}s left of ${MINUTES} minutes for the paired rounds"; exit 1
fi
# seq 2732: a prompt of 683 tokens (T/4), then responses of 512 to 2048 tokens. Past the time
# SIGINT ends the rounds and the report is written; -k: a process that does not end 30 s later
# is killed
timeout -k 30 --preserve-status --signal=INT "$(( left + 60 ))" "$PY" -m ds_hilore.cli bench \
    --model qwen2.5-1.5b --dtype bf16 --device cuda --ranks 1 --zero-stage 2 --seq-len 2732 \
    --micro-batch 4 --group-size 4 --grad-accum 2 --budgets 1.10 \
    --methods nogc,gc,static,hr,hilore --rounds auto \
    --max-minutes "$(awk "BEGIN {print $left / 60}")" \
    --json "$OUT/bench.json" --plot "$OUT/bench.png" ${EXTRA[@]+"${EXTRA[@]}"}

echo "== 6. the bench: the whole run, warm-up included"
timeout -k 30 --preserve-status --signal=INT "$(( RUN_MINUTES * 60 ))" "$PY" -m ds_hilore.cli bench \
    --model qwen2.5-1.5b --dtype bf16 --device cuda --ranks 1 --zero-stage 2 \
    --micro-batch 4 --group-size 4 --grad-accum 2 --budgets 1.10 --methods nogc,gc,hilore \
    --run-steps "$RUN_STEPS" --lengths 1024,2048,2732 \
    --json "$OUT/run.json" --plot "$OUT/run.png" ${EXTRA[@]+"${EXTRA[@]}"}

echo "== done in $(( $(date +%s) - START )) s; results in $OUT"
exit "$check"
