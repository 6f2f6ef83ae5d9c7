"""The settings module's parts one at a time: each parser, range check and source (config
file, environment, flags) of ``agent/core/config.py`` and of the mechanism beneath it
(``exporters/settings.py``), with the exact line a user reads for a bad value. Fast and
in-process; ``tests/unit/test_config.py`` covers the precedence end to end."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, fields
from typing import Any

import pytest
import yaml

from mrc_agent.agent.core import config as c
from mrc_agent.agent.core.collectors import COLLECTOR_NAMES
from mrc_agent.agent.core.config import (
    CAPTURES_GROUP,
    SETTINGS,
    AgentConfig,
    ConfigError,
    add_flags,
    apply,
    check_token,
    config_from_args,
    default_of,
    default_text,
    flag_values,
    from_env,
    from_file,
    load,
    parse_listen,
    read_token_file,
    validate,
)
from mrc_agent.exporters import settings as s
from mrc_agent.exporters.plainyaml import load_yaml_mapping

TOKEN = "0123456789abcdef"  # exactly MIN_TOKEN_LENGTH characters


def _error(cli: dict | None = None, env: dict | None = None, path: str | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load(cli or {}, env=env or {}, config_path=path)
    text = str(err.value)
    assert "\n" not in text
    return text


# -- parsers -----------------------------------------------------------------------------------

def test_text_keeps_none_and_turns_anything_else_into_a_string() -> None:
    assert s.text(None, None) is None
    assert s.text(5, None) == "5"
    assert s.text("", None) == ""


def test_float_refuses_a_boolean_and_reads_numbers_and_strings() -> None:
    with pytest.raises(TypeError, match="^expected a number$"):
        s.number(True, None)
    assert s.number("1.5", None) == 1.5
    assert s.number(2, None) == 2.0


def test_whole_takes_whole_numbers_only() -> None:
    with pytest.raises(TypeError, match="^expected a whole number$"):
        s.whole(False, None)
    with pytest.raises(ValueError, match="^expected a whole number$"):
        s.whole(1.5, None)
    assert s.whole(2.0, None) == 2 and isinstance(s.whole(2.0, None), int)
    assert s.whole("3", None) == 3


@pytest.mark.parametrize(("value", "expected"), [
    ("1,2", [1, 2]),
    ("1 2", [1, 2]),
    (" 1, ,2,, 3 ", [1, 2, 3]),
    (7, [7]),
    (7.0, [7]),
    ([1, "2"], [1, 2]),
    ("", []),
])
def test_pids_read_lists_numbers_and_comma_or_space_separated_text(value, expected) -> None:
    assert c._pids(value, None) == expected


@pytest.mark.parametrize("value", ["0", "1,-2", [0], -1])
def test_pids_are_positive(value) -> None:
    with pytest.raises(ValueError, match="^PIDs are positive$"):
        c._pids(value, None)


def test_pids_refuse_booleans_and_fractions() -> None:
    with pytest.raises(TypeError):
        c._pids([True], None)
    with pytest.raises(ValueError, match="whole number"):
        c._pids(1.5, None)


@pytest.mark.parametrize(("value", "expected"), [
    (True, True), (False, False), ("true", True), (" Yes ", True), ("ON", True), ("1", True),
    (1, True), ("false", False), ("No", False), ("off", False), ("0", False), (0, False),
])
def test_a_collector_switch_reads_the_usual_words_for_true_and_false(value, expected) -> None:
    assert s.switch(value, "gpm") is expected


def test_a_collector_switch_that_is_neither_says_so() -> None:
    with pytest.raises(ConfigError) as err:
        s.switch("maybe", "gpm")
    assert str(err.value) == "collector 'gpm': 'maybe' is not true or false"


def test_an_unknown_collector_lists_the_known_ones() -> None:
    known = ", ".join(COLLECTOR_NAMES)
    assert known == "process, gpu, gpm, profiling, derived, stacks"
    assert str(c._unknown_collector("warp")) == f"unknown collector 'warp' (known: {known})"
    assert _error({"collectors": "gpu,warp"}) == (
        f"command line: unknown collector 'warp' (known: {known})")
    assert _error({"collectors": {"warp": True}}) == (
        f"command line: unknown collector 'warp' (known: {known})")
    assert _error({"collectors": "Xgpm"}) == (  # only a leading - or + is a switch
        f"command line: unknown collector 'Xgpm' (known: {known})")


def test_collectors_from_a_mapping_switch_only_what_is_named() -> None:
    cfg = AgentConfig()
    out = c._collectors({"gpm": "off", "profiling": True}, cfg)
    assert out == {"process": True, "gpu": True, "gpm": False, "profiling": True,
                   "derived": True, "stacks": True}
    assert cfg.collectors["gpm"] is True  # the config's own mapping is not changed


def test_collectors_from_a_list_take_minus_plus_and_blank_items() -> None:
    cfg = AgentConfig()
    assert c._collectors(" profiling , ,-gpm,+gpu,", cfg) == {
        "process": True, "gpu": True, "gpm": False, "profiling": True, "derived": True,
        "stacks": True}
    assert c._collectors(["-process", "profiling"], cfg) == {
        "process": False, "gpu": True, "gpm": True, "profiling": True, "derived": True,
        "stacks": True}


def test_collectors_build_on_what_an_earlier_source_switched(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("collectors: {gpm: false}\n")
    cfg = load({"collectors": "profiling"}, env={"MRC_AGENT_COLLECTORS": "-process"},
               config_path=str(f))
    assert cfg.collectors == {"process": False, "gpu": True, "gpm": False, "profiling": True,
                              "derived": True, "stacks": True}
    assert cfg.enabled == ["gpu", "profiling", "derived", "stacks"]


def test_a_bad_switch_in_the_file_names_the_file_and_the_collector(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("collectors: {gpm: sometimes}\n")
    assert _error(path=str(f)) == (
        f"config file {f}: collector 'gpm': 'sometimes' is not true or false")


# -- range checks ------------------------------------------------------------------------------

def test_between_is_inclusive_and_says_the_range() -> None:
    check = s.between(1, 2.5)
    check(1, "capture_duration")
    check(2.5, "capture_duration")
    with pytest.raises(ConfigError) as err:
        check(0.5, "capture_duration")
    assert str(err.value) == "capture-duration 0.5 is out of range (1-2.5)"
    with pytest.raises(ConfigError) as err:
        check(2.6, "capture_duration")
    assert str(err.value) == "capture-duration 2.6 is out of range (1-2.5)"
    with pytest.raises(ConfigError) as err:
        s.between(1, 2, "seconds")(3, "a_b_c")
    assert str(err.value) == "a-b-c 3 is out of range (1-2 seconds)"


@pytest.mark.parametrize(("name", "low", "high", "below", "above"), [
    ("capture_duration", 1, 120, 0.99, 120.01),
    ("capture_max_per_hour", 1, 60, 0, 61),
    ("capture_max_count", 1, 1000, 0, 1001),
    ("capture_max_bytes", 1 << 20, 1 << 40, (1 << 20) - 1, (1 << 40) + 1),
    ("capture_retention", 60, 365 * 86400, 59, 365 * 86400 + 1),
])
def test_the_capture_bounds_are_the_documented_ones(name, low, high, below, above) -> None:
    assert getattr(load({name: low}, env={}), name) == low
    assert getattr(load({name: high}, env={}), name) == high
    for bad in (below, above):
        assert _error({name: bad}) == (
            f"{name.replace('_', '-')} {bad:g} is out of range ({low:g}-{high:g})")


def test_the_interval_message_gives_the_range_in_seconds() -> None:
    assert _error({"interval": 0.001}) == "interval 0.001 is out of range (0.05-60.0 seconds)"
    assert _error({"interval": 61}) == "interval 61.0 is out of range (0.05-60.0 seconds)"


@pytest.mark.parametrize(("name", "high"), [
    ("idle_util_threshold", 1.0), ("starvation_cpu_threshold", 64.0),
    ("starvation_gpu_threshold", 1.0),
])
def test_the_thresholds_run_from_zero_to_their_ceiling(name, high) -> None:
    assert getattr(load({name: 0.0}, env={}), name) == 0.0
    assert getattr(load({name: high}, env={}), name) == high
    dashed = name.replace("_", "-")
    assert _error({name: -0.01}) == f"{dashed} -0.01 is out of range"
    assert _error({name: high + 0.01}) == f"{dashed} {high + 0.01} is out of range"


def test_a_ratio_check_is_inclusive_and_names_the_setting() -> None:
    check = c._check_ratio(2.0)
    check(0.0, "some_ratio")
    check(2.0, "some_ratio")
    for bad in (-0.5, 2.5):
        with pytest.raises(ConfigError) as err:
            check(bad, "some_ratio")
        assert str(err.value) == f"some-ratio {bad} is out of range"


def test_thresholds_are_handed_to_the_derived_signals_in_order() -> None:
    cfg = load({"idle_util_threshold": 0.1, "starvation_cpu_threshold": 2.0,
                "starvation_gpu_threshold": 0.3}, env={})
    t = cfg.thresholds
    assert (t.idle_util, t.starved_cpu, t.starved_gpu) == (0.1, 2.0, 0.3)


def test_a_regex_that_does_not_compile_says_why() -> None:
    assert _error({"process_name": "(unclosed"}) == (
        "process-name regex '(unclosed' does not compile: "
        "missing ), unterminated subpattern at position 0")
    assert load({"process_name": "uvicorn|gunicorn"}, env={}).process_name == "uvicorn|gunicorn"
    c._check_regex(None, "process_name")


@pytest.mark.parametrize("backend", ["auto", "nvml", "none", "replay:/tmp/t.jsonl", "replay:x"])
def test_the_gpu_backends_accepted(backend) -> None:
    assert load({"gpu_backend": backend}, env={}).gpu_backend == backend


@pytest.mark.parametrize("backend", ["cuda", "replay:", "replay", "Auto", "", "xreplay:a"])
def test_other_gpu_backends_are_refused_with_the_list(backend) -> None:
    assert _error({"gpu_backend": backend}) == (
        f"gpu-backend {backend!r} is not one of auto, nvml, replay:PATH, none")


def test_the_replay_path_is_what_follows_replay() -> None:
    assert load({"gpu_backend": "replay:/a/b:c"}, env={}).replay_path == "/a/b:c"
    assert load({"gpu_backend": "nvml"}, env={}).replay_path is None
    assert AgentConfig().replay_path is None


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error", "DEBUG", "Warning"])
def test_the_log_levels_accepted_in_any_case(level) -> None:
    assert load({"log_level": level}, env={}).log_level == level


def test_another_log_level_is_refused_with_the_list() -> None:
    assert _error({"log_level": "loud"}) == (
        "log-level 'loud' is not debug, info, warning or error")
    assert _error({"log_level": "critical"}).startswith("log-level 'critical'")


def test_the_capture_directory_must_not_be_empty() -> None:
    assert _error({"capture_dir": ""}) == "capture-dir must not be empty"
    assert load({"capture_dir": "/x"}, env={}).capture_dir == "/x"


# -- listen addresses --------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    (":9478", ("0.0.0.0", 9478)),
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    ("host:65535", ("host", 65535)),
    ("[::1]:9478", ("::1", 9478)),
    ("[::]:1", ("::", 1)),
    ("::1:80", ("::1", 80)),
    ("[]:80", ("0.0.0.0", 80)),
])
def test_listen_addresses_accepted(value, expected) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", ["nowhere", "host:", "host:65536", "host:-1", "host:²",
                                   "host:８０", "host:1.5", "[::1:80", "::1]:80", "[[::1]]:80",
                                   "a[b]:80", ""])
def test_other_listen_addresses_are_refused(value) -> None:
    with pytest.raises(ConfigError) as err:
        parse_listen(value)
    assert str(err.value) == f"listen address {value!r} is not HOST:PORT"


def test_the_listen_setting_is_checked_and_split() -> None:
    assert _error({"listen": "nowhere"}) == "listen address 'nowhere' is not HOST:PORT"
    assert load({"listen": "[::1]:9000"}, env={}).host_port == ("::1", 9000)


# -- the webhook token -------------------------------------------------------------------------

def test_a_token_must_be_sixteen_printable_characters_in_one_word() -> None:
    check_token(TOKEN, "here")
    with pytest.raises(ConfigError) as err:
        check_token(TOKEN[:-1], "here")
    assert str(err.value) == "here: the token must be at least 16 characters"
    for bad in (TOKEN + " x", TOKEN + "\t", "\x01" + TOKEN, TOKEN + "\u00a0"):
        with pytest.raises(ConfigError) as err:
            check_token(bad, "here")
        assert str(err.value) == "here: the token must be one word of printable characters"


def test_the_token_from_the_environment_is_checked_under_its_name() -> None:
    assert _error(env={"MRC_AGENT_WEBHOOK_TOKEN": "short"}) == (
        "MRC_AGENT_WEBHOOK_TOKEN: the token must be at least 16 characters")
    cfg = load({}, env={"MRC_AGENT_WEBHOOK_TOKEN": TOKEN})
    assert cfg.webhook_token == TOKEN and cfg.webhook_enabled


def test_the_webhook_is_enabled_by_a_token_or_a_token_file() -> None:
    assert not AgentConfig().webhook_enabled
    assert load({"webhook_token_file": "/run/token"}, env={}).webhook_enabled
    assert _error({"webhook_token_file": "/run/token"}, {"MRC_AGENT_WEBHOOK_TOKEN": TOKEN}) == (
        "give the webhook token once: webhook-token-file or MRC_AGENT_WEBHOOK_TOKEN, not both")


def test_a_token_file_is_read_stripped_and_checked(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}\n")
    assert read_token_file(str(f)) == TOKEN
    f.write_text("a" * 5000)  # read no further than 4 KiB
    assert read_token_file(str(f)) == "a" * 4096
    f.write_text("short\n")
    with pytest.raises(ConfigError) as err:
        read_token_file(str(f))
    assert str(err.value) == f"webhook token file {f}: the token must be at least 16 characters"
    f.write_bytes(b"\xff" * 20)
    with pytest.raises(ConfigError) as err:
        read_token_file(str(f))
    assert str(err.value) == f"cannot read webhook token file {f}: not UTF-8 text"
    with pytest.raises(ConfigError) as err:
        read_token_file(str(tmp_path))
    assert str(err.value) == (
        f"cannot read webhook token file {tmp_path}: webhook token file {tmp_path} is not a "
        "regular file")
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as err:
        read_token_file(str(missing))
    assert str(err.value) == (
        f"cannot read webhook token file {missing}: No such file or directory")


# -- sources -----------------------------------------------------------------------------------

def test_apply_names_the_origin_of_every_problem() -> None:
    cfg = AgentConfig()
    with pytest.raises(ConfigError) as err:
        apply(cfg, {"intervall": 1}, "somewhere")
    assert str(err.value) == "somewhere: unknown setting 'intervall'"
    with pytest.raises(ConfigError) as err:
        apply(cfg, {"interval": "fast"}, "somewhere")
    assert str(err.value) == ("somewhere: invalid value 'fast' for interval "
                              "(could not convert string to float: 'fast')")
    with pytest.raises(ConfigError) as err:
        apply(cfg, {"capture_max_count": True}, "somewhere")
    assert str(err.value) == ("somewhere: invalid value True for capture_max_count "
                              "(expected a whole number)")
    apply(cfg, {"interval": "2", "pids": "3"}, "somewhere")
    assert cfg.interval == 2.0 and cfg.pids == [3]


def test_a_config_file_yaml_error_gives_the_line(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("interval: 1\nlisten: [oops\n")
    assert _error(path=str(f)) == f"config file {f}:3 is not valid YAML"
    f.write_text("interval: 1\ninterval: 2\n")  # the settings' loader takes the last
    assert load({}, env={}, config_path=str(f)).interval == 2.0


def test_a_yaml_error_without_a_position_has_no_line() -> None:
    class Failing(yaml.SafeLoader):
        def get_single_data(self) -> Any:
            raise yaml.YAMLError("no mark here")

    path = __file__
    with pytest.raises(ConfigError) as err:
        load_yaml_mapping(path, "test file", "a mapping", Failing)
    assert str(err.value) == f"test file {path} is not valid YAML"


def test_a_key_given_twice_is_named_only_by_a_loader_that_refuses_it(tmp_path) -> None:
    class Strict(yaml.SafeLoader):
        def get_single_data(self) -> Any:
            raise yaml.constructor.ConstructorError(
                None, None, "key 'a' given twice", yaml.Mark("x", 0, 4, 0, "", 0))

    class Other(yaml.SafeLoader):
        def get_single_data(self) -> Any:
            raise yaml.constructor.ConstructorError(
                None, None, "found unhashable key", yaml.Mark("x", 0, 1, 0, "", 0))

    f = tmp_path / "a.yaml"
    f.write_text("a: 1\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_mapping(str(f), "w", "m", Strict)
    assert str(err.value) == f"w {f}:5 is not valid YAML: key 'a' given twice"
    with pytest.raises(ConfigError) as err:
        load_yaml_mapping(str(f), "w", "m", Other)
    assert str(err.value) == f"w {f}:2 is not valid YAML"


def test_a_config_file_that_is_not_a_mapping_or_not_text(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("- interval\n")
    assert _error(path=str(f)) == f"config file {f} must hold a mapping of settings"
    f.write_text("just text\n")
    assert _error(path=str(f)) == f"config file {f} must hold a mapping of settings"
    f.write_bytes(b"interval: \xff\n")
    assert _error(path=str(f)) == f"config file {f} is not UTF-8 text"


def test_a_config_file_nested_too_deeply_says_so(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("[" * 600 + "]" * 600)
    assert _error(path=str(f)) == f"config file {f} is nested too deeply"


def test_an_empty_config_file_sets_nothing(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("# nothing yet\n")
    assert load_yaml_mapping(str(f), "config file", "x") == {}
    assert load({}, env={}, config_path=str(f)) == AgentConfig()


def test_a_config_file_over_one_mebibyte_is_not_read(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("interval: 2\n" + "#" * (1 << 20))
    assert _error(path=str(f)) == (
        f"cannot read config file {f}: config file {f} is {(1 << 20) + 12} bytes; "
        f"at most {1 << 20} are read")
    missing = tmp_path / "missing.yaml"
    assert _error(path=str(missing)) == (
        f"cannot read config file {missing}: No such file or directory")


def test_config_file_keys_take_dashes_or_underscores(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("process-name: uvicorn\ncapture_max_count: 3\n")
    assert from_file(str(f)) == {"process_name": "uvicorn", "capture_max_count": 3}
    f.write_text("1: x\n")
    assert from_file(str(f)) == {"1": "x"}


def test_the_token_itself_is_refused_in_the_config_file(tmp_path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text(f"interval: 2\nwebhook-token: {TOKEN}\n")
    assert _error(path=str(f)) == (
        f"config file {f}: do not put the webhook token in the config file; "
        "use webhook_token_file or MRC_AGENT_WEBHOOK_TOKEN")
    f.write_text("webhook_token_file: /run/token\n")
    assert load({}, env={}, config_path=str(f)).webhook_token_file == "/run/token"


def test_the_environment_names_of_the_settings() -> None:
    env = {"MRC_AGENT_PID": "1", "MRC_AGENT_INTERVAL": "2", "MRC_AGENT_CONFIG": "/x.yaml",
           "HOME": "/root", "MRC_AGENTINTERVAL": "3", "XMRC_AGENT_BOGUS": "4",
           "MRC_AGENT_WEBHOOK_TOKEN": TOKEN}
    assert from_env(env) == {"pids": "1", "interval": "2", "webhook_token": TOKEN}
    assert from_env({"MRC_AGENT_PIDS": "2"}) == {"pids": "2"}
    with pytest.raises(ConfigError) as err:
        from_env({"MRC_AGENT_BOGUS": "1"})
    assert str(err.value) == "environment: unknown setting MRC_AGENT_BOGUS"
    assert {s.env for s in SETTINGS.values()} >= {"MRC_AGENT_PIDS", "MRC_AGENT_LOG_LEVEL"}


def test_load_reads_the_process_environment_unless_given_one(monkeypatch, tmp_path) -> None:
    for name in [n for n in os.environ if n.startswith("MRC_AGENT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MRC_AGENT_INTERVAL", "3")
    assert load({}).interval == 3.0
    assert load({}, env={}).interval == 1.0
    f = tmp_path / "a.yaml"
    f.write_text("interval: 4\n")
    other = tmp_path / "b.yaml"
    other.write_text("interval: 5\n")
    monkeypatch.setenv("MRC_AGENT_CONFIG", str(other))
    monkeypatch.delenv("MRC_AGENT_INTERVAL")
    assert load({}).interval == 5.0
    assert load({}, config_path=str(f)).interval == 4.0  # --config over MRC_AGENT_CONFIG


def test_a_flag_given_as_none_is_not_given() -> None:
    cfg = load({"interval": None, "listen": None}, env={"MRC_AGENT_INTERVAL": "2"})
    assert cfg.interval == 2.0 and cfg.listen == "0.0.0.0:9478"


def test_validate_returns_the_config_and_checks_every_setting() -> None:
    cfg = AgentConfig()
    assert validate(cfg) is cfg
    cfg.capture_max_count = 0
    with pytest.raises(ConfigError, match="^capture-max-count 0 is out of range"):
        validate(cfg)


# -- the declarations --------------------------------------------------------------------------

def test_a_settings_environment_name_and_flag_follow_its_name() -> None:
    spec = SETTINGS["process_name"]
    assert spec.env == "MRC_AGENT_PROCESS_NAME"
    assert spec.flag_name == "--process-name"
    assert spec.dashed == "process-name"
    assert SETTINGS["pids"].flag_name == "--pid"
    assert SETTINGS["webhook_token"].flag_name is None
    assert SETTINGS["webhook_token"].env_only and not SETTINGS["webhook_token_file"].env_only


def test_setting_makes_a_field_that_carries_its_declaration() -> None:
    plain = s.setting(5, parse=s.whole, help="h")
    assert plain.default == 5 and plain.default_factory is MISSING
    assert dict(plain.metadata) == {"setting": {"parse": s.whole, "help": "h"}}
    made = s.setting(default_factory=list, help="h")
    assert made.default is MISSING and made.default_factory is list
    assert dict(made.metadata) == {"setting": {"help": "h"}}
    assert s.setting(help="h").default is None


def test_the_settings_are_built_from_the_fields_in_order() -> None:
    built = s.declare(AgentConfig, c.ENV_PREFIX)
    assert built == SETTINGS
    assert list(built) == [f.name for f in fields(AgentConfig)]
    assert all(spec.name == name for name, spec in built.items())
    assert built["interval"].parse is s.number and built["interval"].commands == ("run",)


def test_the_defaults_and_how_help_shows_them() -> None:
    assert default_of("interval") == 1.0
    assert default_of("pids") == []
    assert default_of("collectors") == {"process": True, "gpu": True, "gpm": True,
                                        "profiling": False, "derived": True, "stacks": True}
    assert AgentConfig().pids is not AgentConfig().pids
    assert AgentConfig().collectors is not AgentConfig().collectors
    shown = {name: default_text(name) for name in SETTINGS}
    assert shown == {
        "pids": None, "pidfile": None, "process_name": None, "listen": "0.0.0.0:9478",
        "interval": "1", "gpu_backend": "auto", "gpus": "targets",
        "profile_unattributed": "false", "gpm_interval": "1", "stacks_interval": "0.1",
        "stacks_top_k": "5", "collectors": "process,gpu,gpm,derived,stacks",
        "idle_util_threshold": "0.05",
        "starvation_cpu_threshold": "0.9",
        "starvation_gpu_threshold": "0.2", "log_level": "info", "web_config_file": None,
        "webhook_token_file": None, "webhook_token": None,
        "capture_dir": "$TMPDIR/mrc-agent-captures", "capture_duration": "10",
        "capture_max_per_hour": "6", "capture_max_count": "20", "capture_max_bytes": "100Mi",
        "capture_retention": "7d"}


def test_an_empty_string_default_shows_as_none(monkeypatch) -> None:
    monkeypatch.setattr(c, "default_of", lambda name: "")
    assert default_text("listen") is None


# -- flags -------------------------------------------------------------------------------------

def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_flags(parser, command)
    return parser


def _help(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    return {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}


def test_each_flag_says_its_default_and_its_environment_name() -> None:
    shown = _help(_parser("run"))
    assert shown["--config"] == "YAML config file (env MRC_AGENT_CONFIG)"
    assert shown["--interval"] == "sampling period (default 1); env MRC_AGENT_INTERVAL"
    assert shown["--pidfile"] == (
        "file holding the target PID, re-read every interval; env MRC_AGENT_PIDFILE")
    assert shown["--collector"] == (
        "switch a collector on (repeatable: process, gpu, gpm, profiling, derived, stacks; "
        "default process,gpu,gpm,derived,stacks; env MRC_AGENT_COLLECTORS=profiling,-gpm)")
    assert shown["--no-collector"] == (
        "switch a collector off (repeatable; env MRC_AGENT_COLLECTORS)")
    assert "--webhook-token" not in shown


def test_each_subcommand_gets_its_own_flags() -> None:
    assert set(_help(_parser("diagnose"))) == {
        "-h", "--config", "--gpu-backend", "--idle-util-threshold",
        "--starvation-cpu-threshold"}
    doctor = set(_help(_parser("doctor")))
    assert "--pid" in doctor and "--collector" in doctor and "--listen" not in doctor
    assert "--capture-dir" in set(_help(_parser("run")))


def test_each_flag_shows_its_metavar() -> None:
    usage = " ".join(_parser("run").format_usage().split())
    for shown in ("[--config PATH]", "[--pid PID]", "[--interval SECONDS]",
                  "[--listen HOST:PORT]", "[--collector NAME]", "[--no-collector NAME]",
                  "[--capture-dir DIR]", "[--capture-max-bytes BYTES]",
                  "[--capture-retention DURATION]"):
        assert shown in usage, shown


def test_the_capture_flags_are_one_help_group() -> None:
    parser = _parser("run")
    groups = [g for g in parser._action_groups if g.title == CAPTURES_GROUP]
    assert len(groups) == 1
    assert {a.dest for a in groups[0]._group_actions} == {
        "webhook_token_file", "capture_dir", "capture_duration", "capture_max_per_hour",
        "capture_max_count", "capture_max_bytes", "capture_retention"}
    assert len(parser._action_groups) == 3  # positionals, options, captures


def test_flags_parse_numbers_and_repeat_where_declared(capsys) -> None:
    parser = _parser("run")
    args = parser.parse_args(["--pid", "1", "--pid", "2", "--interval", "0.5",
                              "--capture-max-count", "3", "--capture-max-bytes", "2Mi",
                              "--collector", "profiling", "--no-collector", "gpm",
                              "--no-collector", "process"])
    assert args.pids == [1, 2] and args.interval == 0.5 and args.capture_max_count == 3
    assert args.capture_max_bytes == "2Mi"
    assert flag_values(args) == {"pids": [1, 2], "interval": 0.5, "capture_max_count": 3,
                                 "capture_max_bytes": "2Mi",
                                 "collectors": "profiling,-gpm,-process"}
    for bad in (["--interval", "fast"], ["--capture-max-count", "1.5"], ["--pid", "x"],
                ["--collector", "warp"], ["--no-collector", "warp"]):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(bad)
        assert exit_.value.code == 2
    capsys.readouterr()


def test_flag_values_hold_only_the_flags_given() -> None:
    args = _parser("diagnose").parse_args(["--gpu-backend", "none"])
    assert flag_values(args) == {"gpu_backend": "none"}
    assert flag_values(_parser("run").parse_args([])) == {}


def test_config_from_args_puts_overrides_over_flags_over_the_file(monkeypatch,
                                                                  tmp_path) -> None:
    for name in [n for n in os.environ if n.startswith("MRC_AGENT_")]:
        monkeypatch.delenv(name)
    f = tmp_path / "a.yaml"
    f.write_text("interval: 4\nlog_level: debug\ncapture_max_count: 7\n")
    args = _parser("run").parse_args(["--config", str(f), "--interval", "2",
                                      "--log-level", "error"])
    cfg = config_from_args(args, interval=0.5, log_level=None)
    assert (cfg.interval, cfg.log_level, cfg.capture_max_count) == (0.5, "error", 7)
    assert config_from_args(argparse.Namespace()).interval == 1.0


def test_pids_and_counts_have_a_ceiling() -> None:
    with pytest.raises(ValueError, match="^PIDs are at most 4194304$"):
        c._pids([1, 4194305], None)
    with pytest.raises(ValueError, match="too large"):
        s.whole(1 << 70, None)


def test_shown_values_are_cut_and_bounded_in_work() -> None:
    assert s.shown("x" * 10) == "'xxxxxxxxxx'"
    assert len(s.shown("x" * 100_000)) <= s.SHOWN_CHARS
    nested: list[object] = ["lol"] * 9
    for _ in range(30):  # 9 ** 30 items if walked
        nested = [nested] * 9
    assert len(s.shown(nested)) <= s.SHOWN_CHARS
    assert s.shown(1 << 20_000) == "<an integer of 20001 bits>"
    assert s.clipped("y" * 1000, 10) == "yyyyyyy..."
