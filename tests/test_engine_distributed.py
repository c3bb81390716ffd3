"""ds_hilore.initialize on 2 CPU ranks: 7 launches.

Each launch runs tests/workers/ds_engine_worker.py with several cases in one process; a case
trains 3 optimizer steps (GAS 2, micro-batch 2, different data per rank, attention dropout and
LoRA dropout on) and reports losses, parameter digests and HiLoRe's actions per step.

Equality is bitwise throughout: a HiLoRe case and its HF gradient-checkpointing baseline use
the same ds_config apart from the "hilore" block, so ZeRO buckets and reduces the gradients in
the same order; H keeps what the forward saved and R recomputes it with the forward's RNG state.
(ZeRO-2 and ZeRO-3 runs are not compared with each other: their reductions differ in order and
their losses differ in the last bits from step 3 on.)

Launch times on 2 cores: ~25-45 s each once DeepSpeed's shared-memory op is built; the first
build of that op (~1 min) happens in the `ds_op_built` fixture, in this process.
"""

from __future__ import annotations

import os

import pytest

from tests.launch import run_distributed
from tests.workers import ds_engine_worker as worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = worker.__file__
UNITS = 4  # 2 layers x (attn, mlp)
GAS = 2
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def ds_op_built():
    """Build DeepSpeed's CPU shared-memory op once here, not concurrently in two ranks."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load()


def launch(*cases: str, launcher: str = "direct", timeout: float = 300, extra=()) -> list[dict]:
    args = [a for case in cases for a in ("--case", case)] + list(extra)
    return run_distributed(WORKER, args, nprocs=2, launcher=launcher, timeout=timeout)


EQUALITY_LAUNCHES = {
    "zero2": ["zero2_gc_baseline:full:gc", "zero2_hilore:full:H", "zero2_hilore:full:R",
              "zero2_gc_baseline:lora:gc", "zero2_hilore:lora:H", "zero2_hilore:lora:R"],
    "zero3_full": ["zero3_hilore:full:gc", "zero3_hilore:full:H", "zero3_hilore:full:R"],
    "zero3_lora": ["zero3_lora_hilore:lora:gc", "zero3_lora_hilore:lora:H", "zero3_lora_hilore:lora:R"],
}
# through DeepSpeed's runner, as users launch, and compared with mpirun's launch below; the
# others start their ranks directly (NOTE [ Three ways to start ranks ] in tests/launch.py)
RUNNER_LAUNCHED = {"zero2"}
_launched: dict[str, list[dict] | str] = {}  # launch name -> results, or the failure message


def equality_launch(name: str) -> list[dict]:
    """Each launch runs once per session; a failed one fails its other tests without rerunning."""
    if name not in _launched:
        try:
            _launched[name] = launch(*EQUALITY_LAUNCHES[name],
                                     launcher="deepspeed" if name in RUNNER_LAUNCHED else "direct")
        except pytest.fail.Exception as failure:
            _launched[name] = str(failure)
    if isinstance(_launched[name], str):
        pytest.fail(_launched[name], pytrace=False)
    return _launched[name]


def case_result(rank: dict, name: str) -> dict:
    """One case's record from one rank; a case that raised fails the test with its traceback."""
    got = rank["cases"][name]
    if "error" in got:
        pytest.fail(f"rank {rank['rank']}, case {name} raised:\n{got['error']}", pytrace=False)
    return got


def _equality_cases():
    for name, cases in EQUALITY_LAUNCHES.items():
        for case in cases:
            if not case.endswith(":gc"):
                yield pytest.param(name, case, id=case)


# ---- H and R equal HF gradient checkpointing ----------------------------------------------
@pytest.mark.parametrize("launch_name,case", list(_equality_cases()))
def test_forced_plan_equals_gc(launch_name, case):
    ranks = equality_launch(launch_name)
    parsed = worker.Case.parse(case)
    plan = parsed.mode
    for rank in ranks:
        got, ref = case_result(rank, case), case_result(rank, parsed.reference)
        assert got["engine_class"].startswith("HiLoRe") and ref["engine_class"] == "DeepSpeedEngine"
        assert got["collective_class"] == "TorchDistCollective"
        assert got["losses"] == ref["losses"]  # every micro-step, bitwise (float.hex)
        assert got["param_sha"] == ref["param_sha"]  # every final parameter, bitwise
        assert got["max_abs_diff_vs_reference"] == 0.0
        assert got["changed"] == ref["changed"] and got["changed"]  # the same parameters trained
        if parsed.model == "lora":
            assert all("lora_" in name for name in got["changed"])  # frozen base stays frozen
        for step in got["steps"]:
            hilore = step["hilore"]
            assert hilore["unit_actions"] == [plan] * UNITS
            assert hilore["actions"][plan] == GAS * UNITS
            assert hilore["recomputed_units"] == (GAS * UNITS if plan == "R" else 0)
        assert [s["global_steps"] for s in got["steps"]] == [1, 2, 3]


# ---- rank-local data: one rank's microbatches have A = 0 everywhere ------------------------
@pytest.fixture(scope="module")
def rank_local_zero():
    return launch("zero3_hilore:full:gc:grpo_rank0_only", "zero3_hilore:full:mixed:grpo_rank0_only",
                  timeout=240)  # a rank that skipped its recompute would hang ZeRO-3's gathers


def test_rank_local_zero_advantages_same_plan_on_every_rank(rank_local_zero):
    case = "zero3_hilore:full:mixed:grpo_rank0_only"
    r0, r1 = (case_result(r, case) for r in rank_local_zero)
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert s0["hilore"]["plan_hash"] == s1["hilore"]["plan_hash"]
        assert s0["hilore"]["unit_actions"] == ["H", "H", "R", "R"]  # layer 0 H, layer 1 R
        assert s1["hilore"]["unit_actions"] == ["E", "E", "R", "R"]  # ω ≡ 0: nothing stored
        # rank 1 still recomputes layer 1: its ZeRO-3 all-gathers match rank 0's
        assert s0["hilore"]["recomputed_units"] == s1["hilore"]["recomputed_units"] == GAS * 2
    for rank in rank_local_zero:
        got = case_result(rank, case)
        ref = case_result(rank, "zero3_hilore:full:gc:grpo_rank0_only")
        assert got["losses"] == ref["losses"] and got["param_sha"] == ref["param_sha"]
        assert got["changed"]


# ---- checked elision is one decision for all ranks -------------------------------------------
def test_elision_fallback_is_collective_under_zero3():
    # rank 1 alone has A = 0 sequences, and an entropy bonus reaches them: its H layer must fall
    # back to R, and under ZeRO-3 rank 0 must re-run that layer too, or the gathers would hang
    gc_case = "zero3_hilore:full:gc:grpo_entropy_rank1_zero"
    case = "zero3_hilore:full:mixed:grpo_entropy_rank1_zero"
    ranks = launch(gc_case, case, timeout=240)
    for rank in ranks:
        got, ref = case_result(rank, case), case_result(rank, gc_case)
        assert got["losses"] == ref["losses"] and got["param_sha"] == ref["param_sha"]
        for step in got["steps"]:
            assert step["hilore"]["recomputed_units"] == GAS * UNITS  # layer 0 fell back: all R


# ---- the same script under mpirun --------------------------------------------------------
@pytest.fixture(scope="module")
def under_mpirun():
    return launch("zero2_hilore:full:R", launcher="mpirun", extra=["--check_collective"])


def test_mpirun_smoke_equals_deepspeed_runner(under_mpirun):
    assert [(r["rank"], r["world_size"], r["backend"]) for r in under_mpirun] == [(0, 2, "gloo"), (1, 2, "gloo")]
    for by_mpi, by_runner in zip(under_mpirun, equality_launch("zero2"), strict=True):
        got = case_result(by_mpi, "zero2_hilore:full:R")
        ref = case_result(by_runner, "zero2_hilore:full:R")
        assert got["losses"] == ref["losses"] and got["param_sha"] == ref["param_sha"]


def test_collective_on_two_ranks(under_mpirun):
    for rank in under_mpirun:
        checked = rank["collective"]
        assert checked["rank"] == rank["rank"] and checked["world_size"] == 2
        assert checked["broadcast"] == ["H", "L", "R"]  # rank 0's vector, on rank 1 too
        assert checked["max"] == [1, 2**40]
        assert checked["sum"] == [1.0, 0.5]
        assert checked["ordered"] == [0.1 + 0.2, 1e16 + 1.0]  # the same bits on both ranks
        assert checked["long"] == [1.0] * 2000
        assert case_result(rank, "zero2_hilore:full:R")["collective_class"] == "TorchDistCollective"


# ---- save at step 2, resume, step 3 ------------------------------------------------------
RESUME_CASES = ["zero2_hilore:lora:mixed", "zero3_hilore:full:mixed"]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    uninterrupted = launch(*RESUME_CASES, extra=["--save_at", "2", "--save_to", ckpt])
    resumed = launch(*RESUME_CASES, extra=["--resume_from", ckpt])
    return uninterrupted, resumed


@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_step3_equals_uninterrupted(resume_runs, case):
    for whole, part in zip(*resume_runs, strict=True):
        whole, part = case_result(whole, case), case_result(part, case)
        assert part["resumed"]["global_steps"] == 2
        assert part["resumed"]["extra"] == 2  # the user's client_state comes back ...
        assert "ds_hilore" not in part["resumed"]["client_state"]  # ... without HiLoRe's entry
        assert part["resumed"]["hilore_state"] == whole["saved_hilore_state"]  # restored as saved
        assert part["losses"] == whole["losses"][2 * GAS:]  # step 3's micro-steps, bitwise
        assert part["param_sha"] == whole["param_sha"]
        assert part["steps"][-1]["hilore"] == whole["steps"][-1]["hilore"]


# ---- the allocator: 2 ranks, different data, ZeRO-3 ---------------------------------------------
@pytest.fixture(scope="module")
def allocator_zero3():
    # the file's own "hilore" block (memory_budget 1.1, no force_plan): HiLoRe decides; "split":
    # the same with packable slices and a plan of per-sequence splits, whose packed rows, elided
    # rows (rank 1's A = 0), risk fit and one non-finite run (rank 0's, at worker.OVERFLOW_AT)
    # come from each rank's own data
    return launch("zero3_hilore:full:gc:grpo_rank0_only", "zero3_hilore:full:auto:grpo_rank0_only",
                  "zero3_hilore:full:split:grpo_rank0_only", timeout=300)


def _same_execution(r0: dict, r1: dict) -> None:
    """Both ranks re-ran the same units in the same order, every micro-step (ZeRO-3 gathers)."""
    assert len(r0["recomputed"]) == len(r1["recomputed"]) == GAS * STEPS
    for k, (mine, theirs) in enumerate(zip(r0["recomputed"], r1["recomputed"])):
        assert mine == theirs, f"micro-step {k}"


def test_allocator_under_zero3_one_plan_no_hang_same_trajectory(allocator_zero3):
    case = "zero3_hilore:full:auto:grpo_rank0_only"
    r0, r1 = (case_result(r, case) for r in allocator_zero3)
    _same_execution(r0, r1)
    # 3 profiled microbatches (all R, as GC), then the plan: the tiny model's activations fit
    # the budget, and storing them saves recompute time (the worker fixes the measured times)
    assert r0["steps"][0]["hilore"]["recomputed_units"] == GAS * UNITS
    # (step 3 times leave-one-out's variants, GC itself among them)
    assert "H" in r0["steps"][1]["hilore"]["unit_actions"]
    for rank in allocator_zero3:
        got, ref = case_result(rank, case), case_result(rank, "zero3_hilore:full:gc:grpo_rank0_only")
        # nothing of this model is packable (slices below min_pack_numel): H and R only, exact
        assert got["losses"] == ref["losses"] and got["param_sha"] == ref["param_sha"]


def test_allocator_under_zero3_with_split_units_runs_the_same_actions_on_every_rank(allocator_zero3):
    """Every decision that reads a rank's own data is one decision for all ranks: each rank
    recomputes the same units, in the same order, every micro-step -- the risk fit (rank 0's
    exposure; rank 1 has none), the elision (rank 1's A = 0) and the fallback of a unit whose
    packed run was not finite on rank 0 only (NOTE [ Collective fallback ])."""
    case = "zero3_hilore:full:split:grpo_rank0_only"
    r0, r1 = (case_result(r, case) for r in allocator_zero3)
    _same_execution(r0, r1)
    assert r0["steps"][0]["hilore"]["recomputed_units"] == GAS * UNITS  # profiled: all R
    # rank 0 packs the rows a split packs; rank 1's sequences all have A = 0: nothing stored
    assert "L" in {a for s in r0["steps"][1:] for a in s["hilore"]["unit_actions"]}
    assert {a for s in r1["steps"][1:] for a in s["hilore"]["unit_actions"]} <= {"E", "R"}
    # the risk fit of the first planned microbatch (step 2's last) sends rank 0's riskiest
    # splits to R (worker.SPLIT_BLOCK's budget): rank 1 recomputes them too
    assert r1["recomputed"][2 * GAS - 1] != []
    # the overflow: counted on rank 0 alone, and its unit recomputed on both ranks
    step, micro = worker.OVERFLOW_AT
    assert [s["hilore"]["nonfinite_slices"] for s in r0["steps"]] == [int(k == step) for k in (1, 2, 3)]
    assert [s["hilore"]["nonfinite_slices"] for s in r1["steps"]] == [0, 0, 0]
    assert "model.layers.0.attn" in {n for names in r1["recomputed"][(step - 1) * GAS + micro]
                                     for n in names}  # the unit of rank 0's first packed run
    for rank in allocator_zero3:
        got, ref = case_result(rank, case), case_result(rank, "zero3_hilore:full:gc:grpo_rank0_only")
        assert got["losses"][:2 * GAS] == ref["losses"][:2 * GAS]  # step 1 all R: bitwise GC
        assert got["changed"] == ref["changed"]
        # packed rows: the parameters stay within a few Adam steps' codec error of GC's
        assert 0 < got["max_abs_diff_vs_reference"] < 1e-3
