"""Config schema: defaults, loading from dict/JSON, strict errors that say what to do."""

from __future__ import annotations

import json

import pytest

from chunkmem.config import Config
from chunkmem.errors import ConfigError


def test_defaults_and_byte_sizes() -> None:
    config = Config.from_dict({"device": {"type": "simulated", "capacity": "1.5GiB"}})
    assert config.device.capacity == int(1.5 * 2**30)
    assert config.precision == "fp32" and config.placement.policy == "belady"
    assert Config.coerce(None) == Config()


def test_json_file_round_trip(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"precision": "bf16", "optimizer": {"betas": [0.8, 0.95]}}))
    config = Config.coerce(str(path))
    assert config.precision == "bf16" and config.optimizer.betas == (0.8, 0.95)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"placment": {}}, r"unknown config key 'placment': did you mean 'placement'\?"),
        ({"placement": {"polcy": "lru"}}, r"'placement.polcy': did you mean 'policy'\?"),
        ({"optimizer": {"lr": "fast"}}, r"'optimizer.lr': Input should be a valid number .*'fast'"),
        ({"optimizer": {"lr": -1}}, r"'optimizer.lr': Input should be greater than 0"),
        ({"precision": "fp8"}, r"'precision': Input should be 'fp32', 'bf16' or 'fp16'"),
        ({"device": {"capacity": "12 parsecs"}}, r"cannot read '12 parsecs' as a byte size"),
        (
            {"gradient_accumulation_steps": 0},
            r"'gradient_accumulation_steps': .*greater than or equal to 1",
        ),
        ({"gradient_accumulation_steps": 2.5}, r"'gradient_accumulation_steps': .*valid integer"),
    ],
)
def test_bad_values_name_the_key_and_the_reason(data, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(data)


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        Config.from_dict({"precison": "bf16", "optimizer": {"lr": 0}})
    assert "precison" in str(error.value) and "optimizer.lr" in str(error.value)


def test_missing_or_broken_json_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_json(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{precision: bf16}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_json(broken)


def test_docs_config_reference_is_current() -> None:
    from pathlib import Path

    from chunkmem.config_reference import reference_markdown

    path = Path(__file__).parent.parent / "docs" / "config.md"
    assert path.read_text() == reference_markdown(), (
        "docs/config.md is stale: run `python -m chunkmem.config_reference > docs/config.md`"
    )
