"""Loading configs (catalog name, file, folder, dict, nested text_config) and every bad input."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import (
    ConfigError,
    InvalidArgumentError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from pagedkv.models import (
    catalog_description,
    layers_from_config,
    load_config,
    load_model,
)

LLAMA_LIKE = {
    "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 1000,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def _write(path, data):
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_load_from_file_folder_and_dict_agree(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    file = _write(folder / "config.json", LLAMA_LIKE)
    assert load_config(file) == load_config(folder) == load_config(str(folder)) == LLAMA_LIKE
    from_dict = load_config(LLAMA_LIKE)
    from_dict["num_hidden_layers"] = 99
    assert LLAMA_LIKE["num_hidden_layers"] == 4  # a copy, never the caller's dict


def test_load_model_names_the_source(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    _write(folder / "config.json", LLAMA_LIKE)
    other = _write(tmp_path / "other.json", LLAMA_LIKE)
    assert load_model(folder).name == "tiny-llama"
    assert load_model(folder / "config.json").name == "tiny-llama"
    assert load_model(other).name == "other"
    assert load_model("llama-3-8b").name == "llama-3-8b"
    assert load_model(dict(LLAMA_LIKE, _name_or_path="org/some-model")).name == "some-model"


def test_nested_text_config_inherits_top_level_dtype():
    nested = {"model_type": "wrapper", "torch_dtype": "float16", "text_config": dict(LLAMA_LIKE)}
    del nested["text_config"]["torch_dtype"]
    layers = layers_from_config(nested)
    assert len(layers) == 4
    assert all(layer.bytes_per_token == 2 * 2 * 128 * 2 for layer in layers)  # fp16 K and V
    assert load_model(nested).max_position_embeddings == 4096


def test_missing_file_is_unknown_model(tmp_path):
    with pytest.raises(UnknownModelError, match="nor an existing"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(UnknownModelError, match="llama-3-8b"):  # lists the catalog
        load_config("no-such-model")


def test_folder_without_config_json(tmp_path):
    with pytest.raises(UnknownModelError, match="no config.json"):
        load_config(tmp_path)


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "hidden_size": 1024,\n  oops\n}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"malformed JSON.*line 3"):
        load_config(path)


def test_json_that_is_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(_write(tmp_path / "config.json", [1, 2, 3]))


def test_unreadable_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(path)


def test_source_of_a_wrong_type():
    with pytest.raises(ConfigError, match="catalog name, a path or a config dict"):
        load_config(42)  # type: ignore[arg-type]


def test_unknown_catalog_description():
    with pytest.raises(UnknownModelError, match="not in the catalog"):
        catalog_description("no-such-model")


@pytest.mark.parametrize(
    ("missing", "pattern"),
    [
        ("num_hidden_layers", "num_hidden_layers"),
        ("num_attention_heads", "num_attention_heads"),
    ],
)
def test_missing_field_is_named(missing, pattern):
    config = dict(LLAMA_LIKE)
    del config[missing]
    with pytest.raises(ConfigError, match=pattern):
        layers_from_config(config)


def test_missing_max_position_embeddings_is_named_only_when_asked_for():
    config = dict(LLAMA_LIKE)
    del config["max_position_embeddings"]
    spec = load_model(config)  # the layers are readable without it
    assert spec.max_position_embeddings is None and len(spec.layers) == 4
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        spec.need_max_position_embeddings()


def test_missing_weight_field_is_named_only_when_asked_for():
    config = dict(LLAMA_LIKE)
    del config["vocab_size"]
    spec = load_model(config)
    assert spec.weight_bytes is None
    with pytest.raises(ConfigError, match="vocab_size"):
        spec.need_weight_bytes()


def test_malformed_field_value():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        layers_from_config(dict(LLAMA_LIKE, num_key_value_heads="eight"))
    with pytest.raises(ConfigError, match="torch_dtype"):
        layers_from_config(dict(LLAMA_LIKE, torch_dtype="float13"))


def test_unknown_layer_type_is_refused():
    config = dict(LLAMA_LIKE, layer_types=["full_attention"] * 3 + ["quantum_attention"])
    with pytest.raises(UnsupportedArchitectureError, match="quantum_attention"):
        layers_from_config(config)


def test_layer_types_of_the_wrong_length():
    with pytest.raises(ConfigError, match="3 layers but num_hidden_layers is 4"):
        layers_from_config(dict(LLAMA_LIKE, layer_types=["full_attention"] * 3))


def test_fp8_ds_mla_on_gqa_names_the_layers():
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn.*\(32 layers\)"):
        load_model("llama-3-8b", kv_dtype="fp8_ds_mla")


def test_fp8_ds_mla_on_a_gqa_drafter_names_its_layers():
    with pytest.raises(ConfigError, match=r"draft\.layers\.0\.self_attn"):
        load_model("deepseek-v3", "llama-3-8b", kv_dtype="fp8_ds_mla")


def test_unknown_kv_dtype():
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        load_model("llama-3-8b", kv_dtype="int3")
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        layers_from_config(LLAMA_LIKE, kv_dtype="fp32")


def test_mtp_on_a_model_without_mtp_layers():
    with pytest.raises(ConfigError, match="'kimi-k3' has no MTP layers"):
        load_model("kimi-k3", "mtp")


def test_a_drafter_is_not_a_target():
    with pytest.raises(ConfigError, match="dspark drafter"):
        load_model("kimi-k3-dspark")


def test_unknown_draft_is_unknown_model():
    with pytest.raises(UnknownModelError):
        load_model("llama-3-8b", "no-such-drafter")
