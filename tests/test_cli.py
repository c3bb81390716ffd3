"""The ``hilore`` command and the demo (``python -m ds_hilore.bench.demo``) as a smoke check.

The demo test runs the real script in a subprocess (``--quick``: 2 layers, 1 timed step, eager int8 codec) and
checks the table it prints: every exact method bitwise equal to no checkpointing, the expected
number of recomputed units per plan, a small non-zero error for int8.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_hilore import HiLoReConfig, cli
from ds_hilore.bench import demo

REPO_ROOT = Path(__file__).resolve().parents[1]


def _python(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------- units
def _unit_rows(out: str, prefix: str) -> list[list[str]]:
    """(name, kind, bytes per token, children) of every unit line of ``hilore units``."""
    return [line.split(None, 3) for line in out.splitlines() if line.startswith(prefix)]


def _bytes_column_is_measured_or_dash(rows) -> bool:
    held = [row[2] for row in rows]
    return all(h == "-" for h in held) or all(h.isdigit() and int(h) > 0 for h in held)


def test_units_of_phi3_as_a_console_command():
    proc = _python("-m", "ds_hilore.cli", "units", "--arch", "phi3")
    assert proc.returncode == 0, proc.stderr
    rows = _unit_rows(proc.stdout, "model.layers.")
    assert [(name, kind, children) for name, kind, _, children in rows] == [
        ("model.layers.0.attn", "attn", "input_layernorm, self_attn, resid_attn_dropout"),
        ("model.layers.0.mlp", "mlp", "post_attention_layernorm, mlp, resid_mlp_dropout"),
        ("model.layers.1.attn", "attn", "input_layernorm, self_attn, resid_attn_dropout"),
        ("model.layers.1.mlp", "mlp", "post_attention_layernorm, mlp, resid_mlp_dropout"),
    ]
    assert _bytes_column_is_measured_or_dash(rows)
    assert "Phi3ForCausalLM: 4 recovery units in 2 decoder layers" in proc.stdout
    assert proc.stdout.splitlines()[1].split() == ["name", "kind", "B/token", "children"]


def test_units_of_any_transformers_architecture(capsys):
    # Gemma-2 normalises each block's output: the post-norms go with the block they normalise
    assert cli.main(["units", "--arch", "gemma2"]) == 0
    rows = _unit_rows(capsys.readouterr().out, "model.layers.1.")
    assert [(name, kind, children) for name, kind, _, children in rows] == [
        ("model.layers.1.attn", "attn", "input_layernorm, self_attn, post_attention_layernorm"),
        ("model.layers.1.mlp", "mlp", "pre_feedforward_layernorm, mlp, post_feedforward_layernorm"),
    ]
    assert _bytes_column_is_measured_or_dash(rows)


def test_units_list_archs_is_every_causal_lm(capsys):
    from ds_hilore.bench import zoo

    assert cli.main(["units", "--list-archs"]) == 0
    names = capsys.readouterr().out.split()
    assert names == zoo.causal_lm_types()
    assert {"llama", "qwen2", "mistral", "phi3", "gpt_neox", "qwen3_moe"} <= set(names)


def test_units_of_an_unknown_arch_says_where_the_names_are(capsys):
    assert cli.main(["units", "--arch", "lama"]) == cli.EXIT_CONFIG_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1  # one line
    assert "unknown architecture 'lama'" in captured.err and "hilore units --list-archs" in captured.err


def test_units_of_an_arch_that_cannot_be_built_small(capsys):
    assert cli.main(["units", "--arch", "cpmant"]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: no small cpmant model can be built: ")
    assert "does not support gradient checkpointing" in err


def test_units_table_without_per_unit_bytes_shows_a_dash():
    from types import SimpleNamespace

    units = [SimpleNamespace(name="m.layers.0.attn", kind="attn", layer_index=0, children=("a",)),
             SimpleNamespace(name="m.layers.0.mlp", kind="mlp", layer_index=0, children=("b", "c"))]
    table = cli._units_table(torch.nn.Identity(), units, [None, None]).splitlines()
    assert table[0] == "Identity: 2 recovery units in 1 decoder layers"
    assert [line.split() for line in table[2:]] == [["m.layers.0.attn", "attn", "-", "a"],
                                                    ["m.layers.0.mlp", "mlp", "-", "b,", "c"]]
    measured = cli._units_table(torch.nn.Identity(), units, [1536.0, 2048.0]).splitlines()
    assert [line.split()[2] for line in measured[2:]] == ["1536", "2048"]


def test_units_of_a_local_checkpoint(tmp_path, capsys):
    cli.tiny_model("gpt_neox").save_pretrained(tmp_path)
    assert cli.main(["units", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^gpt_neox\.layers\.1\.mlp\s+mlp\s+(-|\d+)\s+post_attention_layernorm, "
                     r"mlp, post_mlp_dropout$", out, re.M), out


def test_units_of_a_missing_checkpoint_never_downloads(tmp_path, capsys):
    assert cli.main(["units", "--model", str(tmp_path / "nothing")]) == cli.EXIT_CONFIG_ERROR
    assert "no config.json there" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- profile
def test_profile_of_qwen2_as_a_console_command(tmp_path, capsys):
    path = tmp_path / "profile.json"
    proc = _python("-m", "ds_hilore.cli", "profile", "--model", "qwen2", "--layers", "2",
                   "--seq-len", "64", "--micro-batch", "4", "--calibrate", "2", "--threads", "1",
                   "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())

    # the units `hilore units` lists for the same model, in its order
    assert cli.main(["units", "--arch", "qwen2"]) == 0
    names = [row[0] for row in _unit_rows(capsys.readouterr().out, "model.layers.")]
    assert len(names) == 4
    assert [row["name"] for row in report["units"]] == names
    assert [u["name"] for u in report["profile"]["units"]] == names
    assert set(report["plan"]["actions"]) == set(names)

    for row in report["units"]:
        assert row["h_bytes"] > 0 and row["l_bytes"] > 0, row
        assert row["recompute_s"] > 0, row
        assert row["packable"] == (row["l_bytes"] < row["h_bytes"]), row
        assert row["l_bytes"] <= row["h_bytes"], row
        assert row["utility_h_s"] == pytest.approx(row["recompute_s"] - row["capture_s"] - row["derive_s"])
        assert row["utility_l_s"] == pytest.approx(row["recompute_s"] - row["pack_s"] - row["unpack_s"]
                                                   - row["derive_s"])
        assert row["derive_s"] >= 0 and (row["derive_s"] > 0) == (row["kind"] == "mlp"), row
        assert row["susceptibility"] > 0 and row["action"] in "HLSR"
        assert row["susceptibility"] == report["susceptibility"]["groups"][row["group"]]
    assert any(row["packable"] for row in report["units"])  # int8 packs qwen2's activations
    assert report["calibration_microbatches"] == 2 and report["calibration_s"] > 0
    assert sum(len(v) for v in report["susceptibility"]["samples"].values()) == 2
    assert report["gc_peak_bytes"] > 0 and report["budget_bytes"] >= report["gc_peak_bytes"]
    assert report["shape"] == {"micro_batch": 4, "seq_len": 64, "bucket": "4x64"}
    assert sum(report["plan"]["mix"].values()) == 4
    plan = report["plan"]  # its predicted peak (NOTE [ A plan priced phase by phase ]) fits
    assert (plan["memory_bytes"] if plan["peak_over_gc"] is None else plan["peak_over_gc"]) \
        <= plan["headroom_bytes"]

    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Qwen2ForCausalLM (qwen2): microbatch 4x64")
    assert lines[1].startswith("GC peak ") and "MiB (whole process), budget " in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("name "))
    assert lines[header].split() == ["name", "kind", "H", "L", "ff", "recompute", "pack", "unpack",
                                     "U(H)", "U(L)", "err", "s", "action"]
    rows = {line.split()[0]: line.split() for line in lines[header + 2:header + 2 + len(names)]}
    assert list(rows) == names
    for row in report["units"]:
        cells = rows[row["name"]]
        assert cells[1] == row["kind"] and cells[-1] == row["action"]
        assert float(cells[2]) == pytest.approx(row["h_bytes"] / 2**20, abs=1e-3)
        assert float(cells[11]) == pytest.approx(row["susceptibility"], abs=1e-3)
    assert any(line.startswith(f"plan: {report['plan']['mix']['H']} H, ") for line in lines)
    assert "[5/5] microbatch 4x64 (planned, calibration pass)" in proc.stderr  # progress


@pytest.mark.parametrize("flags, expected", [
    (["--model", "qwen2", "--seq-len", "1", "--micro-batch", "4"], "--seq-len 1: must be >= 2"),
    (["--model", "qwen2", "--seq-len", "64", "--micro-batch", "0"], "--micro-batch 0: must be >= 1"),
    (["--model", "lama", "--seq-len", "64", "--micro-batch", "4"],
     "--model lama: unknown preset and no such directory"),
    (["--model", "./no/such/dir", "--seq-len", "64", "--micro-batch", "4"],
     "--model ./no/such/dir: no such directory"),
    (["--model", "qwen2", "--seq-len", "64", "--micro-batch", "4", "--memory-budget", "0.5"],
     "--memory-budget 0.5: must be >= 1.0"),
])
def test_profile_bad_flag_value_exits_2_with_one_line(capsys, flags, expected):
    assert cli.main(["profile", *flags]) == cli.EXIT_CONFIG_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"error: {expected}"), captured.err
    assert "pass " in captured.err  # the fix


def test_profile_of_a_directory_without_a_checkpoint(tmp_path, capsys):
    assert cli.main(["profile", "--model", str(tmp_path), "--seq-len", "8",
                     "--micro-batch", "2"]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: --model {tmp_path}: ") and "no config.json there" in err[-1]


# ---------------------------------------------------------------------------------- config
def _write(tmp_path, ds_config: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    return str(path)


def test_config_check_prints_the_resolved_block(tmp_path, capsys):
    block = {"memory_budget": 1.2, "force_plan": {"*": "R", "model.layers.*.mlp": "L"}}
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "hilore": block})
    assert cli.main(["config", "--check", path]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith('the "hilore" block is valid; resolved (defaults filled in):')
    resolved = json.loads(out.split("\n", 1)[1])["hilore"]
    assert resolved == HiLoReConfig(**block).to_dict()
    assert resolved["low_precision"] == "int8" and resolved["memory_budget"] == 1.2


@pytest.mark.parametrize("block, expected", [
    ({"low_precison": "int8"}, ['unknown key "low_precison"', 'Did you mean "low_precision"?']),
    ({"memory_budget": 0.5}, ["hilore.memory_budget = 0.5 is out of range", ">= 1.0"]),
    ({"force_plan": "L", "low_precision": "none"}, ['low_precision to "int8" or "fp8_e4m3"']),
])
def test_config_check_reports_the_error_and_exits_2(tmp_path, capsys, block, expected):
    path = _write(tmp_path, {"hilore": block})
    assert cli.main(["config", "--check", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error in {path}:")
    for text in expected:
        assert text in captured.err


def test_config_check_of_a_config_without_the_block(tmp_path, capsys):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2})
    assert cli.main(["config", "--check", path]) == 0
    out = capsys.readouterr().out
    assert "HiLoRe is off" in out and '"enabled": false' in out


def test_every_subcommand_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {"demo", "grpo-demo", "units", "profile", "bench", "config"}
    for name, action in sub.choices.items():
        assert action.description, name
        assert next(a for a in sub._choices_actions if a.dest == name).help, name


# ---------------------------------------------------------------------------------- demo
_ROW = re.compile(r"^(?P<name>.+?)\s+(?P<t>[\d.]+)\s+(?P<tx>[\d.]+) \| \s*(?P<m>[\d.]+)\s+(?P<mx>[\d.]+) \| "
                  r"\s*(?P<mix>\S+)\s+(?P<h>[-\d.]+)\s+(?P<l>[-\d.]+)\s+(?P<rc>[-\d]+)\s+(?P<codec>[-\d.]+) \| "
                  r"\s*(?P<err>\S+)\s+(?P<verdict>.+)$")


def test_quick_demo_exits_0_and_prints_every_method():
    proc = _python("-m", "ds_hilore.bench.demo", "--quick", "--threads", "1")  # steadier when busy
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m["name"]: m for m in map(_ROW.match, proc.stdout.splitlines()) if m}
    assert list(rows) == [m.name for m in demo.METHODS]
    for method in demo.METHODS:
        row = rows[method.name]
        if method.exact:
            assert row["verdict"] == "bitwise" and float(row["err"]) == 0.0, method.name
        else:
            # all-L (int8), the one lossy method: measured 2.2e-3, ~3x room
            assert row["verdict"] == "lossy" and 0.0 < float(row["err"]) < 0.007, method.name
    units = 2 * demo.PRESETS["quick"].layers
    assert [rows[n]["rc"] for n in ("HiLoRe all-R", "HiLoRe all-H", "HiLoRe attn-H/mlp-R",
                                    "HiLoRe all-L (int8)")] == [str(units), "0", str(units // 2), "0"]
    assert [rows[n]["mix"] for n in ("HiLoRe all-R", "HiLoRe all-H", "HiLoRe attn-H/mlp-R",
                                     "HiLoRe all-L (int8)")] == [f"{units}R", f"{units}H",
                                                                 f"{units // 2}H{units // 2}R", f"{units}L"]
    assert float(rows["HiLoRe all-L (int8)"]["l"]) > 0 and float(rows["HiLoRe all-H"]["l"]) == 0
    assert rows[demo.BASELINE]["tx"] == "1.00" and rows[demo.BASELINE]["mx"] == "1.00"
    assert "[6/6] HiLoRe all-L (int8)" in proc.stdout  # progress lines


def _result(method, grads, step_s=1.0):
    return demo.Result(method, [step_s], 100, grads, None)


def test_report_fails_when_an_exact_method_is_not_bitwise(capsys):
    exact = {"w": torch.tensor([1.0, 2.0])}
    off = {"w": torch.tensor([1.0, 2.0 + 1e-6])}
    results = [_result(demo.METHODS[0], exact), _result(demo.METHODS[1], exact),
               _result(demo.METHODS[2], off), _result(demo.METHODS[-1], off)]
    demo.compare(results)
    expected = float((off["w"].double() - exact["w"].double()).norm() / math.sqrt(5))
    assert results[2].grad_error == pytest.approx(expected, rel=1e-12) and expected > 0
    assert results[1].bitwise and results[1].grad_error == 0.0
    assert demo.report(results) == 1
    out = capsys.readouterr().out
    assert "NOT BITWISE" in out
    assert "FAILED: exact methods whose gradient differs from no checkpointing: ['HiLoRe all-R']" in out
    results[2].grads = exact
    demo.compare(results)
    assert demo.report(results) == 0  # a lossy method with an error does not fail the demo
