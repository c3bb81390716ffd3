"""The ``hilore`` command: each subcommand's output, its one-line errors, and ``--model`` read
the same way everywhere (NOTE [ One meaning of --model ] in ds_hilore/cli/common.py)."""

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
from ds_hilore.bench import zoo
from ds_hilore.cli import units as cli_units

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
    proc = _python("-m", "ds_hilore.cli", "units", "--model", "phi3")
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
    assert cli.main(["units", "--model", "gemma2"]) == 0
    rows = _unit_rows(capsys.readouterr().out, "model.layers.1.")
    assert [(name, kind, children) for name, kind, _, children in rows] == [
        ("model.layers.1.attn", "attn", "input_layernorm, self_attn, post_attention_layernorm"),
        ("model.layers.1.mlp", "mlp", "pre_feedforward_layernorm, mlp, post_feedforward_layernorm"),
    ]
    assert _bytes_column_is_measured_or_dash(rows)


def test_units_list_models_is_every_causal_lm(capsys):
    assert cli.main(["units", "--list-models"]) == 0
    names = capsys.readouterr().out.split()
    assert names == zoo.causal_lm_types()
    assert {"llama", "qwen2", "mistral", "phi3", "gpt_neox", "qwen3_moe"} <= set(names)


def test_a_name_that_is_no_model_says_what_model_accepts(capsys):
    assert cli.main(["units", "--model", "lama"]) == cli.EXIT_CONFIG_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1  # one line
    assert captured.err.startswith("error: --model lama: not a preset (tiny, paper-cpu")
    assert "hilore units --list-models" in captured.err and "pass one of these" in captured.err


def test_model_means_a_preset_then_a_directory_then_a_model_type(tmp_path):
    from ds_hilore.cli.common import BadFlag, model_source

    assert model_source("paper-cpu").kind == "preset"
    assert model_source("qwen2").kind == "arch"
    (tmp_path / "config.json").write_text("{}")
    assert model_source(str(tmp_path)).kind == "dir"
    with pytest.raises(BadFlag, match="a directory without config.json"):
        model_source(str(tmp_path.parent))


def test_units_of_a_preset_cut_to_its_first_layers(capsys):
    assert cli.main(["units", "--model", "paper-cpu", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2ForCausalLM: 6 recovery units in 3 decoder layers" in out


def test_units_of_an_arch_that_cannot_be_built_small(capsys):
    assert cli.main(["units", "--model", "cpmant"]) == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: no small cpmant model can be built: ")
    assert "does not support gradient checkpointing" in err


def test_units_table_without_per_unit_bytes_shows_a_dash():
    from types import SimpleNamespace

    units = [SimpleNamespace(name="m.layers.0.attn", kind="attn", layer_index=0, children=("a",)),
             SimpleNamespace(name="m.layers.0.mlp", kind="mlp", layer_index=0, children=("b", "c"))]
    table = cli_units.units_table(torch.nn.Identity(), units, [None, None]).splitlines()
    assert table[0] == "Identity: 2 recovery units in 1 decoder layers"
    assert [line.split() for line in table[2:]] == [["m.layers.0.attn", "attn", "-", "a"],
                                                    ["m.layers.0.mlp", "mlp", "-", "b,", "c"]]
    measured = cli_units.units_table(torch.nn.Identity(), units, [1536.0, 2048.0]).splitlines()
    assert [line.split()[2] for line in measured[2:]] == ["1536", "2048"]


def test_units_of_a_local_checkpoint(tmp_path, capsys):
    zoo.tiny_causal_lm("gpt_neox", layers=2, seed=0).save_pretrained(tmp_path)
    assert cli.main(["units", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^gpt_neox\.layers\.1\.mlp\s+mlp\s+(-|\d+)\s+post_attention_layernorm, "
                     r"mlp, post_mlp_dropout$", out, re.M), out


def test_units_of_a_missing_checkpoint_never_downloads(tmp_path, capsys):
    assert cli.main(["units", "--model", str(tmp_path / "nothing")]) == cli.EXIT_CONFIG_ERROR
    assert "not a local checkpoint directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- profile
def test_profile_of_qwen2_as_a_console_command(tmp_path, capsys):
    path = tmp_path / "profile.json"
    proc = _python("-m", "ds_hilore.cli", "profile", "--model", "qwen2", "--layers", "2",
                   "--seq-len", "64", "--micro-batch", "4", "--calibrate", "2", "--threads", "1",
                   "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())

    # the units `hilore units` lists for the same model, in its order
    assert cli.main(["units", "--model", "qwen2"]) == 0
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
     "--model lama: not a preset"),
    (["--model", "./no/such/dir", "--seq-len", "64", "--micro-batch", "4"],
     "--model ./no/such/dir: not a preset"),
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
    assert err[-1].startswith(f"error: --model {tmp_path}: ") and "without config.json" in err[-1]


# ---------------------------------------------------------------------------------- config
def _write(tmp_path, ds_config: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    return str(path)


def test_config_check_prints_the_resolved_block(tmp_path, capsys):
    block = {"memory_budget": 1.2, "force_plan": {"*": "R", "model.layers.*.mlp": "L"}}
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "hilore": block})
    assert cli.main(["check-config", path]) == 0
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
    assert cli.main(["check-config", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error in {path}:")
    for text in expected:
        assert text in captured.err


def test_config_check_of_a_config_without_the_block(tmp_path, capsys):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2})
    assert cli.main(["check-config", path]) == 0
    out = capsys.readouterr().out
    assert "HiLoRe is off" in out and '"enabled": false' in out


@pytest.mark.parametrize("text, encoding, expected", [
    ('{"hilore": {"memory_budget": 1.2}}', "utf-16", "is not UTF-8 text"),  # a Windows editor's
    ('{"hilore": {"memory_budget": 1.5, "memory_budget": 1.2}}', "utf-8",
     "duplicate keys in the ds_config: ['memory_budget']"),  # as DeepSpeed refuses it
    ('{"hilore": {"layer_pattern": ""}}', "utf-8", "a non-empty string or null"),
])
def test_a_config_file_that_cannot_be_used_as_written_is_refused(tmp_path, capsys, text, encoding,
                                                                 expected):
    path = tmp_path / "ds_config.json"
    path.write_text(text, encoding=encoding)
    assert cli.main(["check-config", str(path)]) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("key", ["HiLoRe", "hilore_config", "hilor"])
def test_a_block_named_almost_hilore_is_said(tmp_path, capsys, caplog, key):
    """DeepSpeed ignores a top-level key it does not know: the run would train without HiLoRe."""
    path = _write(tmp_path, {key: {"memory_budget": 1.2}})
    with caplog.at_level("WARNING", logger="ds_hilore"):
        assert cli.main(["check-config", path]) == 0
    assert "HiLoRe is off" in capsys.readouterr().out
    assert f"no \"hilore\" block but a key '{key}'" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ds_hilore"):
        HiLoReConfig.from_ds_config({"train_micro_batch_size_per_gpu": 2})
    assert caplog.text == ""


@pytest.mark.parametrize("flags, expected", [
    (["--prompts", "0"], "--prompts 0: must be >= 2"),
    (["--group", "1"], "--group 1: must be >= 2"),
    (["--length", "-5"], "--length -5: must be >= 8"),
])
def test_grpo_demo_bad_flag_value_exits_2_with_one_line(capsys, flags, expected):
    with pytest.raises(SystemExit) as ended:
        cli.main(["grpo-demo", *flags])
    assert ended.value.code == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: " + expected) and err.count("\n") == 1


def test_every_subcommand_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == ["env", "check-config", "units", "profile", "bench", "grpo-demo"]
    for name, action in sub.choices.items():
        assert action.description, name
        assert next(a for a in sub._choices_actions if a.dest == name).help, name


# ---------------------------------------------------------------------------------- env
def test_env_prints_versions_the_accelerator_and_the_codec(capsys):
    from ds_hilore.runtime.codecs import compile_unavailable

    assert cli.main(["env", "--no-compile-check"]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines()
                if not line.startswith(("deepspeed accelerator", "cpu ", "torch threads", "codec on")))
    assert rows["torch"] == torch.__version__ and rows["ds_hilore"]
    cpu = capsys  # the codec's row comes from the runtime's own probe (compile_unavailable)
    assert cli.main(["env", "--no-compile-check"]) == 0
    codec = next(line for line in cpu.readouterr().out.splitlines() if line.startswith("codec on cpu"))
    reason = compile_unavailable("cpu")
    assert ("eager only: " + reason if reason else "compiler found") in codec


def test_a_bad_flag_of_any_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["units", "--model", "qwen2", "--layer", "2", "--bogus"])
    assert exit_.value.code == cli.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bogus" in err
