"""Configuration precedence (file < env < CLI) and validation."""

from __future__ import annotations

import pytest

from mrc_agent.agent.core.config import ConfigError, load, parse_listen


def test_precedence_file_then_env_then_cli(tmp_path) -> None:
    cfg_file = tmp_path / "agent.yaml"
    cfg_file.write_text("interval: 2\nlisten: 127.0.0.1:9000\nprocess-name: uvicorn\n"
                        "collectors: {profiling: true, gpm: false}\npids: [11, 12]\n")
    env = {"MRC_AGENT_INTERVAL": "0.5", "MRC_AGENT_PID": "21,22"}
    cfg = load({"interval": 0.1}, env=env, config_path=str(cfg_file))
    assert cfg.interval == 0.1  # CLI wins
    assert cfg.pids == [21, 22]  # env over file
    assert cfg.listen == "127.0.0.1:9000"  # file over default
    assert cfg.process_name == "uvicorn"
    assert cfg.enabled == ["process", "gpu", "profiling", "derived", "stacks"]


def test_env_names_the_config_file(tmp_path) -> None:
    cfg_file = tmp_path / "a.yaml"
    cfg_file.write_text("gpu_backend: none\n")
    cfg = load({}, env={"MRC_AGENT_CONFIG": str(cfg_file)})
    assert cfg.gpu_backend == "none"


def test_collector_switches_from_a_list() -> None:
    cfg = load({"collectors": "profiling,-gpm"}, env={})
    assert "profiling" in cfg.enabled and "gpm" not in cfg.enabled


@pytest.mark.parametrize(
    ("cli", "env", "message"),
    [
        ({"interval": 0.001}, {}, "interval 0.001 is out of range"),
        ({"process_name": "(unclosed"}, {}, "does not compile"),
        ({"listen": "nowhere"}, {}, "is not HOST:PORT"),
        ({"gpu_backend": "cuda"}, {}, "is not one of auto, nvml, replay:PATH, none"),
        ({"gpu_backend": "replay:"}, {}, "is not one of"),
        ({}, {"MRC_AGENT_INTERVAL": "fast"}, "environment: invalid value 'fast' for interval"),
        ({}, {"MRC_AGENT_BOGUS": "1"}, "unknown setting MRC_AGENT_BOGUS"),
        ({"collectors": "gpu,warp"}, {}, "unknown collector 'warp'"),
        ({}, {"MRC_AGENT_PIDS": "12,-3"}, "invalid value"),
        ({"starvation_gpu_threshold": 1.5}, {}, "out of range"),
        ({"log_level": "loud"}, {}, "log-level"),
    ],
)
def test_bad_settings_raise_one_clear_line(cli, env, message) -> None:
    with pytest.raises(ConfigError) as err:
        load(cli, env=env)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_config_files(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("interval: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load({}, env={}, config_path=str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load({}, env={}, config_path=str(bad))
    bad.write_text("intervall: 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'intervall'"):
        load({}, env={}, config_path=str(bad))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load({}, env={}, config_path=str(tmp_path / "missing.yaml"))


def test_parse_listen_forms() -> None:
    assert parse_listen(":9478") == ("0.0.0.0", 9478)
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_listen("[::1]:9478") == ("::1", 9478)  # the bare address, as bind() takes it


def test_every_setting_is_declared_once_and_offered_with_its_environment_name() -> None:
    import argparse
    from dataclasses import fields

    from mrc_agent.agent.cli import build_parser
    from mrc_agent.agent.core.config import SETTINGS, AgentConfig

    assert list(SETTINGS) == [f.name for f in fields(AgentConfig)]
    parser = build_parser()
    sub = next(a for a in parser._actions
               if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("run", "doctor", "diagnose"):
        offered = {a.dest: a for a in sub[command]._actions}
        for spec in SETTINGS.values():
            if command not in spec.commands or spec.flag_name is None:
                continue
            dest = "enable" if spec.name == "collectors" else spec.name
            assert dest in offered, (command, spec.name)
            assert spec.env in (offered[dest].help or ""), (command, spec.name)
        assert "MRC_AGENT_CONFIG" in (offered["config"].help or "")
    # The token is read from the environment or a file, never a flag or the config file.
    assert SETTINGS["webhook_token"].flag_name is None


def test_a_setting_reads_the_same_from_file_env_and_flag(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("capture_retention: 90m\ncapture_max_bytes: 2Mi\n")
    from_file = load({}, env={}, config_path=str(f))
    from_env = load({}, env={"MRC_AGENT_CAPTURE_RETENTION": "90m",
                             "MRC_AGENT_CAPTURE_MAX_BYTES": "2Mi"})
    from_flag = load({"capture_retention": "90m", "capture_max_bytes": "2Mi"}, env={})
    for cfg in (from_file, from_env, from_flag):
        assert cfg.capture_retention == 5400.0 and cfg.capture_max_bytes == 2 * 1024 * 1024
