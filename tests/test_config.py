"""The "hilore" config block: defaults, parsing from ds_configs, every validation rule, globs.

Every rule is checked through its message: it must name the key, show the bad value, list
the allowed values and say how to fix it -- and never leak a raw pydantic error.
"""

import json
import math

import pytest

from ds_hilore._errors import HiLoReConfigError
from ds_hilore.config import ACTIONS, LOW_PRECISION, HiLoReConfig

CONTRACT_DEFAULTS = {
    "enabled": True,
    "activate": "auto",  # always for attach / initialize, the script's choice otherwise
    "memory_budget": 1.10,
    "memory_budget_bytes": None,
    "memory_fraction": None,
    "grad_error_tolerance": 0.015,
    "low_precision": "int8",
    "codec_backend": "compile",
    "fp8_scaling": "token",
    "fp8_block_size": 128,
    "min_pack_numel": 4096,
    "codec_error_interval": 16,
    "derive_pointwise": True,
    "force_plan": None,
    "layer_pattern": None,
    "attn_children": None,  # units are found from each layer's execution
    "mlp_children": None,
    "calibration_microbatches": 4,
    "profile_microbatches": 3,
    "plan_validation_microbatches": 2,
    "refresh_interval": 1,
    "validation_interval": 0,
    "elide_zero_rows": "auto",
    "exposure_source": "auto",
    "log_interval": 0,
}


def config_error(**block) -> str:
    """The message of the HiLoReConfigError that ``HiLoReConfig(**block)`` must raise."""
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig(**block)
    return checked_message(info.value)


def checked_message(error: HiLoReConfigError) -> str:
    message = str(error)
    assert isinstance(error, ValueError)
    assert "pydantic" not in message.lower() and "validation error" not in message.lower()
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__  # no chained pydantic trace
    assert "Fix" in message
    return message


# ---- defaults and shape ---------------------------------------------------------------------
def test_defaults_match_the_contract():
    assert HiLoReConfig().to_dict() == CONTRACT_DEFAULTS


def test_every_field_has_a_description_and_json_key_equals_attribute():
    for name, info in HiLoReConfig.model_fields.items():
        assert info.description, name
        assert info.alias in (None, name), name
    assert list(HiLoReConfig().to_dict()) == list(HiLoReConfig.model_fields)


def test_constants_list_the_allowed_values():
    assert ACTIONS == ("H", "L", "R")
    assert LOW_PRECISION == ("int8", "fp8_e4m3", "none")


def test_given_lists_are_not_shared_between_instances():
    names = {"attn_children": ["norm", "attn"], "mlp_children": ["mlp"]}
    first, second = HiLoReConfig(**names), HiLoReConfig(**names)
    first.attn_children.append("extra")
    assert "extra" not in second.attn_children


@pytest.mark.parametrize("given,missing", [("attn_children", "mlp_children"),
                                           ("mlp_children", "attn_children")])
def test_child_name_override_needs_both_lists(given, missing):
    with pytest.raises(HiLoReConfigError) as err:
        HiLoReConfig(**{given: ["x"]})
    assert given in str(err.value) and missing in str(err.value) and "set both" in str(err.value)


@pytest.mark.parametrize("block", [
    {},
    {"memory_budget_bytes": 8_000_000_000, "low_precision": "fp8_e4m3", "fp8_scaling": "block"},
    {"force_plan": {"*": "R", "model.layers.0.*": "H"}, "memory_budget": 1.3},
    {"enabled": False, "layer_pattern": "model.layers.*", "attn_children": ["attn"],
     "mlp_children": ["mlp"]},
])
def test_to_dict_round_trips_and_is_json_ready(block):
    config = HiLoReConfig(**block)
    data = config.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert HiLoReConfig(**data) == config


def test_to_dict_leaves_out_memory_budget_when_bytes_are_in_force():
    data = HiLoReConfig(memory_budget_bytes=10**9).to_dict()
    assert "memory_budget" not in data and data["memory_budget_bytes"] == 10**9


def test_integral_floats_are_accepted_for_integers_and_ints_for_floats():
    config = HiLoReConfig(memory_budget_bytes=8e9, min_pack_numel=1024.0)
    assert config.memory_budget_bytes == 8_000_000_000 and type(config.memory_budget_bytes) is int
    assert config.min_pack_numel == 1024 and type(config.min_pack_numel) is int
    config = HiLoReConfig(memory_budget=2)
    assert config.memory_budget == 2.0 and type(config.memory_budget) is float


def test_tuples_are_accepted_for_lists():
    config = HiLoReConfig(attn_children=("attn",), mlp_children=("mlp",))
    assert config.mlp_children == ["mlp"] and config.attn_children == ["attn"]


# ---- reading a ds_config --------------------------------------------------------------------
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
    "hilore": {"enabled": True, "memory_budget": 1.2, "grad_error_tolerance": 0.01,
               "low_precision": "fp8_e4m3"},
}


def test_from_ds_config_dict_reads_only_the_hilore_block():
    config = HiLoReConfig.from_ds_config(DS_CONFIG)
    assert (config.enabled, config.memory_budget, config.grad_error_tolerance,
            config.low_precision) == (True, 1.2, 0.01, "fp8_e4m3")
    assert config.min_pack_numel == 4096  # the rest stays at the defaults


def test_from_ds_config_json_path(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    assert HiLoReConfig.from_ds_config(path) == HiLoReConfig.from_ds_config(DS_CONFIG)
    assert HiLoReConfig.from_ds_config(str(path)) == HiLoReConfig.from_ds_config(DS_CONFIG)


def test_from_ds_config_accepts_comments_as_deepspeed_does(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "hilore": {\n    "enabled": true,\n'
                    '    "memory_budget": 1.25,  // x GC peak\n    "low_precision": "int8"\n  }\n}\n')
    assert HiLoReConfig.from_ds_config(path).memory_budget == 1.25


@pytest.mark.parametrize("ds_config", [{"train_batch_size": 8}, {"hilore": None}])
def test_missing_block_disables_hilore(ds_config):
    config = HiLoReConfig.from_ds_config(ds_config)
    assert config.enabled is False
    assert config.to_dict() == {**CONTRACT_DEFAULTS, "enabled": False}


def test_enabled_false_in_the_block():
    config = HiLoReConfig.from_ds_config({"hilore": {"enabled": False, "memory_budget": 1.5}})
    assert config.enabled is False and config.memory_budget == 1.5


def test_empty_block_means_enabled_with_defaults():
    assert HiLoReConfig.from_ds_config({"hilore": {}}) == HiLoReConfig()


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.from_ds_config(missing)
    assert str(missing) in checked_message(info.value)


def test_invalid_json_names_the_path(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"hilore": {"enabled": true,,}')
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.from_ds_config(path)
    message = checked_message(info.value)
    assert str(path) in message and "not valid JSON" in message


@pytest.mark.parametrize("block", [True, "int8", [1.1], 3])
def test_block_that_is_not_an_object(block):
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.from_ds_config({"hilore": block})
    message = checked_message(info.value)
    assert '"hilore"' in message and json.dumps(block) in message and "object" in message


def test_ds_config_of_the_wrong_type():
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.from_ds_config(42)
    assert "int" in checked_message(info.value)


def test_unknown_key_in_a_ds_config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"hilore": {"memory_budgett": 1.2}}))
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.from_ds_config(path)
    assert 'Did you mean "memory_budget"?' in checked_message(info.value)


# ---- coerce ---------------------------------------------------------------------------------
def test_coerce_accepts_every_documented_form(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_CONFIG))
    expected = HiLoReConfig(**DS_CONFIG["hilore"])
    config = HiLoReConfig(memory_budget=1.4)
    assert HiLoReConfig.coerce(config) is config
    assert HiLoReConfig.coerce(DS_CONFIG["hilore"]) == expected  # dict of the block
    assert HiLoReConfig.coerce(DS_CONFIG) == expected            # full ds_config dict
    assert HiLoReConfig.coerce(path) == expected
    assert HiLoReConfig.coerce(str(path)) == expected
    assert HiLoReConfig.coerce(None) == HiLoReConfig()          # attaching turns HiLoRe on


def test_coerce_rejects_other_types():
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.coerce(1.1)
    message = checked_message(info.value)
    assert "float" in message and "HiLoReConfig" in message and "path" in message


def test_coerce_rejects_non_string_keys():
    with pytest.raises(HiLoReConfigError) as info:
        HiLoReConfig.coerce({1: "H"})
    assert "unknown key 1" in checked_message(info.value)


# ---- unknown keys ---------------------------------------------------------------------------
@pytest.mark.parametrize("typo, suggestion", [
    ("memry_budget", "memory_budget"),
    ("lowprecision", "low_precision"),
    ("force-plan", "force_plan"),
    ("grad_error_tol", "grad_error_tolerance"),
    ("enable", "enabled"),
])
def test_unknown_key_suggests_the_closest_known_key(typo, suggestion):
    message = config_error(**{typo: 1})
    assert f'unknown key "{typo}"' in message
    assert f'Did you mean "{suggestion}"?' in message
    assert ", ".join(HiLoReConfig.model_fields) in message  # every allowed key is listed
    assert f'rename or remove "{typo}"' in message


def test_unknown_key_without_a_close_match():
    message = config_error(zzzz=1)
    assert 'unknown key "zzzz"' in message and "Did you mean" not in message


def test_strict_is_an_unknown_key_not_deepspeeds_argument():
    # DeepSpeedConfigModel.__init__ takes `strict`; inside the block it is just a typo.
    assert 'unknown key "strict"' in config_error(strict=False)


def test_every_unknown_key_is_reported():
    message = config_error(foo=1, bar=2)
    assert 'unknown key "foo"' in message and 'unknown key "bar"' in message


# ---- types ----------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, allowed", [
    ("enabled", "true", "true or false"),
    ("enabled", 1, "true or false"),
    ("memory_budget", "1.2", "a number >= 1.0"),
    ("memory_budget", True, "a number >= 1.0"),
    ("memory_budget_bytes", "8GB", "an integer > 0 or null"),
    ("memory_budget_bytes", 1.5e9 + 0.5, "an integer > 0 or null"),
    ("grad_error_tolerance", [0.01], "a number >= 0.0 and < 1.0"),
    ("fp8_block_size", 12.5, "an integer > 0"),
    ("min_pack_numel", 1.5, "an integer >= 0"),
    ("min_pack_numel", False, "an integer >= 0"),
    ("codec_error_interval", 2.5, "an integer >= 1"),
    ("layer_pattern", 3, "a non-empty string or null"),
    ("attn_children", "self_attn", "a list of strings or null"),
    ("mlp_children", ["mlp", 2], "a list of strings or null"),
    ("calibration_microbatches", None, "an integer >= 0"),
    ("refresh_interval", "1", "an integer >= 1"),
    ("validation_interval", 2.5, "an integer >= 0"),
    ("log_interval", {"every": 10}, "an integer >= 0"),
])
def test_wrong_type(key, value, allowed):
    message = config_error(**{key: value})
    assert f"hilore.{key} = {json.dumps(value)} has the wrong type" in message
    assert f"Allowed: {allowed}." in message
    assert f'Fix: set "{key}" to {allowed}' in message
    assert f"default {json.dumps(CONTRACT_DEFAULTS[key])}" in message


# ---- ranges ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, allowed", [
    ("memory_budget", 0.99, "a number >= 1.0"),
    ("memory_budget", -1, "a number >= 1.0"),
    ("memory_budget_bytes", 0, "an integer > 0 or null"),
    ("memory_budget_bytes", -5, "an integer > 0 or null"),
    ("grad_error_tolerance", -0.001, "a number >= 0.0 and < 1.0"),
    ("grad_error_tolerance", 1.0, "a number >= 0.0 and < 1.0"),
    ("fp8_block_size", 0, "an integer > 0"),
    ("min_pack_numel", -1, "an integer >= 0"),
    ("codec_error_interval", 0, "an integer >= 1"),
    ("calibration_microbatches", -1, "an integer >= 0"),
    ("refresh_interval", 0, "an integer >= 1"),
    ("validation_interval", -3, "an integer >= 0"),
    ("log_interval", -2, "an integer >= 0"),
])
def test_out_of_range(key, value, allowed):
    message = config_error(**{key: value})
    assert f"hilore.{key} = {json.dumps(value)} is out of range" in message
    assert f"Allowed: {allowed}." in message


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", ["memory_budget", "grad_error_tolerance"])
def test_non_finite_numbers(key, value):
    message = config_error(**{key: value})
    assert f"hilore.{key} = {json.dumps(value)} is not finite" in message


@pytest.mark.parametrize("key, value", [
    ("memory_budget", 1.0), ("grad_error_tolerance", 0.0), ("grad_error_tolerance", 0.999),
    ("memory_budget_bytes", 1), ("min_pack_numel", 0), ("refresh_interval", 1),
])
def test_bounds_are_inclusive_where_documented(key, value):
    assert getattr(HiLoReConfig(**{key: value}), key) == value


# ---- enums (and DeepSpeed's "auto" dropping) ------------------------------------------------
ENUMS = {
    "low_precision": ["int8", "fp8_e4m3", "none"],
    "codec_backend": ["eager", "compile"],
    "fp8_scaling": ["token", "block"],
    "exposure_source": ["auto", "analytic", "hidden_grad"],
    "activate": ["auto", "always", "with_checkpointing"],
}


@pytest.mark.parametrize("key, allowed, bad", [
    (key, allowed, bad) for key, allowed in ENUMS.items()
    for bad in ["INT8", "int4", "auto", ""] if bad not in allowed])
def test_unknown_enum_value_lists_the_allowed_ones(key, allowed, bad):
    message = config_error(**{key: bad})
    assert f'hilore.{key} = "{bad}" is not a known value' in message
    assert "Allowed: one of " + ", ".join(f'"{a}"' for a in allowed) in message


@pytest.mark.parametrize("key, allowed", ENUMS.items())
def test_every_enum_value_is_accepted(key, allowed):
    for value in allowed:
        if key == "low_precision" and value == "none":
            continue  # fine alone; see the contradiction tests
        assert getattr(HiLoReConfig(**{key: value}), key) == value


@pytest.mark.parametrize("key", ["memory_budget", "low_precision", "min_pack_numel", "enabled"])
def test_auto_is_not_silently_dropped(key):
    # DeepSpeedConfigModel drops every "auto" value unless strict; that would hide this error.
    assert f'hilore.{key} = "auto"' in config_error(**{key: "auto"})


# ---- force_plan -----------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["H", "L", "R", {"model.layers.*.mlp": "R"}, {}, None])
def test_valid_force_plans(plan):
    assert HiLoReConfig(force_plan=plan).force_plan == plan


@pytest.mark.parametrize("plan, problem", [
    ("X", "is not an action"), ("h", "is not an action"), ("E", "is not an action"),
    ("auto", "is not an action"), (["H", "R"], "has the wrong shape"), (3, "has the wrong shape"),
])
def test_force_plan_bad_action_or_shape(plan, problem):
    message = config_error(force_plan=plan)
    assert f"hilore.force_plan = {json.dumps(plan)} {problem}" in message
    assert '"H", "L", "R", a mapping {"<unit-name glob>": "H" | "L" | "R"}, or null' in message


@pytest.mark.parametrize("action", ["X", "r", None, 1, ["H"]])
def test_force_plan_mapping_with_a_bad_action(action):
    message = config_error(force_plan={"model.layers.0.*": "H", "model.layers.1.mlp": action})
    assert f'hilore.force_plan["model.layers.1.mlp"] = {json.dumps(action)} is not an action' in message
    assert '"H", "L" or "R"' in message


def test_force_plan_mapping_with_an_empty_pattern():
    message = config_error(force_plan={"": "H"})
    assert 'hilore.force_plan has the key ""' in message and "unit-name globs" in message


def test_force_plan_for_a_single_action_covers_every_unit():
    config = HiLoReConfig(force_plan="R")
    assert config.force_plan_for("model.layers.0.self_attn") == "R"
    assert config.force_plan_for("anything") == "R"


def test_force_plan_for_without_a_plan():
    assert HiLoReConfig().force_plan_for("model.layers.0.mlp") is None


def test_force_plan_globs_last_matching_pattern_wins():
    config = HiLoReConfig(force_plan={
        "*": "R",
        "model.layers.*.mlp": "L",
        "model.layers.1.*": "H",
    })
    assert config.force_plan_for("model.layers.0.attn") == "R"   # only "*"
    assert config.force_plan_for("model.layers.0.mlp") == "L"    # "*", then "*.mlp"
    assert config.force_plan_for("model.layers.1.mlp") == "H"    # the last match wins
    assert config.force_plan_for("model.layers.1.attn") == "H"
    reordered = HiLoReConfig(force_plan={"model.layers.1.*": "H", "*": "R"})
    assert reordered.force_plan_for("model.layers.1.mlp") == "R"  # order, not specificity


def test_force_plan_globs_are_fnmatch_and_case_sensitive():
    config = HiLoReConfig(force_plan={"model.layers.1*.mlp": "H", "model.layers.[23].attn": "L",
                                      "model.layers.?.input_*": "R"})
    assert config.force_plan_for("model.layers.1.mlp") == "H"
    assert config.force_plan_for("model.layers.12.mlp") == "H"   # `*` crosses digits and dots
    assert config.force_plan_for("model.layers.3.attn") == "L"
    assert config.force_plan_for("model.layers.4.attn") is None
    assert config.force_plan_for("model.layers.5.input_layernorm") == "R"
    assert config.force_plan_for("MODEL.layers.1.mlp") is None
    assert config.force_plan_for("model.layers.0.mlp") is None   # unmatched: allocator decides


def test_unmatched_force_plan_patterns():
    config = HiLoReConfig(force_plan={"model.layers.*.mlp": "H", "model.layyers.*": "R"})
    names = ["model.layers.0.attn", "model.layers.0.mlp"]
    assert config.unmatched_force_plan_patterns(names) == ["model.layyers.*"]
    assert HiLoReConfig(force_plan="H").unmatched_force_plan_patterns(names) == []


# ---- contradictions -------------------------------------------------------------------------
def test_force_plan_l_with_low_precision_none():
    message = config_error(force_plan="L", low_precision="none")
    assert "hilore.force_plan" in message and '"L"' in message and "every unit" in message
    assert 'hilore.low_precision = "none"' in message
    assert '"int8", "fp8_e4m3"' in message and 'only "H" and "R"' in message


def test_force_plan_mapping_with_l_and_low_precision_none_names_the_patterns():
    message = config_error(force_plan={"*": "R", "model.layers.*.mlp": "L", "lm.*": "L"},
                           low_precision="none")
    assert '"model.layers.*.mlp", "lm.*"' in message
    assert 'hilore.low_precision = "none"' in message


def test_low_precision_none_is_fine_without_l():
    assert HiLoReConfig(low_precision="none", force_plan={"*": "H", "x": "R"}).force_plan_for("x") == "R"
    assert HiLoReConfig(low_precision="none", force_plan="R").low_precision == "none"


def test_memory_budget_and_bytes_both_set():
    message = config_error(memory_budget=1.2, memory_budget_bytes=8_000_000_000)
    assert "hilore.memory_budget = 1.2" in message
    assert "hilore.memory_budget_bytes = 8000000000" in message
    assert "keep exactly one of memory_budget, memory_budget_bytes and memory_fraction" in message


@pytest.mark.parametrize("other", [{"memory_budget": 1.5}, {"memory_budget_bytes": 10**9}])
def test_memory_fraction_excludes_the_other_budgets(other):
    message = config_error(memory_fraction=0.9, **other)
    assert "hilore.memory_fraction = 0.9" in message and "keep exactly one" in message


def test_memory_fraction_bounds_and_round_trip():
    assert "out of range" in config_error(memory_fraction=0.0)
    assert "out of range" in config_error(memory_fraction=1.5)
    config = HiLoReConfig(memory_fraction=0.9)
    assert HiLoReConfig(**config.to_dict()) == config


def test_memory_budget_at_its_default_value_still_counts_as_set():
    assert "both set" in config_error(memory_budget=1.1, memory_budget_bytes=10**9)


def test_memory_budget_with_explicit_null_bytes_is_fine():
    assert HiLoReConfig(memory_budget=1.3, memory_budget_bytes=None).memory_budget == 1.3


def test_several_errors_are_reported_together():
    message = config_error(memory_budget=0.5, low_precision="int4", enabled="yes")
    assert len(message.splitlines()) == 3
    assert "memory_budget" in message and "int4" in message and '"yes"' in message


# ---- assignment -----------------------------------------------------------------------------
def test_assignment_is_validated_and_a_rejected_value_changes_nothing():
    config = HiLoReConfig(memory_budget_bytes=10**9)
    config.force_plan = {"*": "H"}
    assert config.force_plan_for("u") == "H"
    with pytest.raises(HiLoReConfigError) as info:
        config.memory_budget = 0.5
    assert "hilore.memory_budget = 0.5 is out of range" in checked_message(info.value)
    with pytest.raises(HiLoReConfigError) as info:
        config.memory_budget = 1.2  # contradiction with memory_budget_bytes
    assert "both set" in checked_message(info.value)
    with pytest.raises(HiLoReConfigError) as info:
        config.memry_budget = 1.2
    assert 'Did you mean "memory_budget"?' in checked_message(info.value)
    assert config.memory_budget == 1.1 and "memory_budget" not in config.model_fields_set
    assert config.to_dict() == HiLoReConfig(memory_budget_bytes=10**9, force_plan={"*": "H"}).to_dict()


def test_reading_a_config_imports_neither_deepspeed_nor_torch():
    """``import ds_hilore`` and its config must not import DeepSpeed (vLLM's import order)."""
    import subprocess
    import sys

    code = ("import sys, ds_hilore; c = ds_hilore.HiLoReConfig.from_ds_config({'hilore': {}}); "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- names that match nothing: HiLoReConfigErrors at start -------------------------------
# A glob or child name that matches nothing in the model is a config error (it names the key),
# raised when the names can first be checked: at attach / initialize for transformers models
# (the probe forward finds every unit) and for any model with attn_children / mlp_children;
# at the first training forward for other modules, whose units are found there. It is also a
# HiLoReError, as it was, so either except clause catches it.
_EXACT_BLOCK = {"low_precision": "none", "derive_pointwise": False}


def _attach_error(model, **block):
    import ds_hilore
    from ds_hilore._errors import HiLoReError

    with pytest.raises(HiLoReConfigError) as err:
        ds_hilore.attach(model, dict(_EXACT_BLOCK, **block))
    assert isinstance(err.value, HiLoReError)
    return str(err.value)


def test_a_force_plan_glob_matching_no_unit_fails_at_attach():
    from tests.models import tiny_model

    message = _attach_error(tiny_model("llama"), force_plan={"model.layers.*.attention": "H"})
    assert "hilore.force_plan" in message and "model.layers.*.attention" in message
    assert "model.layers.0.attn" in message  # what unit names look like


def test_a_layer_pattern_matching_nothing_fails_at_attach():
    from tests.models import tiny_model

    message = _attach_error(tiny_model("llama"), layer_pattern="model.decoder.*")
    assert "hilore.layer_pattern" in message and "model.decoder.*" in message


@pytest.mark.parametrize("children, needle", [
    ({"attn_children": ["input_layernorm", "self_attn"], "mlp_children": ["mlp"]},
     "post_attention_layernorm"),  # a child in neither list
    ({"attn_children": ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"],
      "mlp_children": ["nothing"]}, "no mlp sub-block"),
    ({"attn_children": ["post_attention_layernorm", "self_attn"],
      "mlp_children": ["input_layernorm", "mlp"]}, "must all run before"),  # not contiguous
], ids=["unmapped", "empty-unit", "order"])
def test_bad_attn_or_mlp_children_fail_at_attach(children, needle):
    from tests.models import tiny_model

    message = _attach_error(tiny_model("llama", layers=1), **children)
    assert needle in message and "hilore.attn_children" in message


def test_a_plain_module_checks_force_plan_at_its_first_training_forward():
    import torch

    import ds_hilore

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(),
                                                      torch.nn.Linear(8, 8)) for _ in range(2))).train()
    runtime = ds_hilore.attach(model, dict(_EXACT_BLOCK, layer_pattern="[0-9]",
                                           force_plan={"*.attention": "H"}))
    assert runtime.units == ()  # no probe input for a plain module: units come at first use
    with pytest.raises(HiLoReConfigError, match=r"hilore.force_plan .*\*\.attention"):
        model(torch.randn(2, 3, 8, requires_grad=True))
