"""`${VAR}` and `${VAR:-default}` in string values come from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle.config import ConfigError, load_config, parse_config


def test_a_set_variable_replaces_its_reference_and_is_converted_to_the_field_type() -> None:
    config = parse_config(
        {"http_options": {"host": "${HOST}", "port": "${PORT}"}}, env={"HOST": "10.0.0.1", "PORT": "9001"}
    )

    assert config.http_options.host == "10.0.0.1"
    assert config.http_options.port == 9001


def test_the_default_is_used_when_the_variable_is_unset_or_empty() -> None:
    data = {"http_options": {"port": "${PORT:-8123}"}, "storage": {"checkpoint_dir": "${DIR:-}/ckpt"}}

    unset = parse_config(data, env={})
    empty = parse_config(data, env={"PORT": ""})

    assert unset.http_options.port == empty.http_options.port == 8123
    assert unset.storage.checkpoint_dir == "/ckpt"


def test_references_inside_longer_strings_and_nested_lists_are_replaced() -> None:
    data = {
        "auth": {"keys_file": "${HOME_DIR}/keys-${ENV:-dev}.txt"},
        "telemetry": {"resource_attributes": {"a": "${X}"}},
    }

    config = parse_config(data, env={"HOME_DIR": "/srv", "X": "y"})

    assert config.auth.keys_file == "/srv/keys-dev.txt"
    assert config.telemetry.resource_attributes == {"a": "y"}


def test_an_unset_variable_without_default_is_one_problem_at_its_path() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"http_options": {"port": "${PORT}"}, "broker": {"db": "x"}}, env={})

    problems = {problem.path: problem for problem in caught.value.problems}
    assert set(problems) == {"http_options.port", "broker.db"}
    assert problems["http_options.port"].message == "environment variable PORT is not set"
    assert "${PORT:-default}" in (problems["http_options.port"].hint or "")


def test_a_doubled_dollar_writes_a_literal_reference() -> None:
    config = parse_config({"storage": {"checkpoint_dir": "/data/$${NOT_A_VAR}"}}, env={"NOT_A_VAR": "no"})

    assert config.storage.checkpoint_dir == "/data/${NOT_A_VAR}"


def test_a_malformed_reference_is_reported() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"storage": {"checkpoint_dir": "${1BAD}"}}, env={})

    (problem,) = caught.value.problems
    assert problem.path == "storage.checkpoint_dir"
    assert "malformed" in problem.message


def test_load_config_reads_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINKLE_TEST_REDIS", "redis://cache:6379/2")
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        "persistence:\n  mode: redis\n  redis_url: ${TWINKLE_TEST_REDIS}\n", encoding="utf-8"
    )

    assert load_config(config_file).persistence.redis_url == "redis://cache:6379/2"
