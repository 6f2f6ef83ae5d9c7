"""The settings mechanism (``exporters/settings.py``) on declarations of its own, and every
subcommand's flags as it builds them: a flag's spelling, default, type and ``--help`` come
from one declaration. ``tests/unit/test_config_units.py`` covers the agent's settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest

from mrc_agent.agent.cli import COMMANDS, build_parser
from mrc_agent.exporters import settings as s
from mrc_agent.exporters.settings import ConfigError, Declarations, setting


def _positive(value: int, name: str) -> None:
    if value < 1:
        raise ConfigError(f"{name} {value} is below 1")


@dataclass
class _Extra:
    GROUP: ClassVar[str] = "extra things"

    level: str = setting("info", parse=s.text, commands=("x",), choices=("info", "debug"),
                         help="how much to say")


@dataclass
class _Flags(_Extra):
    url: str | None = setting(parse=s.text, commands=("x",), required=True, help="where")
    count: int = setting(3, parse=s.whole, check=_positive, commands=("x", "y"), metavar="N",
                         help="how many")
    names: tuple[str, ...] = setting((), parse=lambda v, _: tuple(v), commands=("x",),
                                     flag="--name", repeatable=True, default_text="none",
                                     help="a name, one a flag")
    loud: bool = setting(False, parse=s.yes_no, commands=("x",), toggle=True, help="shout")
    hidden: int = 7  # no declaration: not a setting


def _parser(command: str = "x") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    Declarations(_Flags).add_flags(parser, command)
    return parser


def _help(parser: argparse.ArgumentParser) -> dict[str, str | None]:
    return {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}


def test_only_declared_fields_are_settings_and_a_group_names_its_own() -> None:
    specs = Declarations(_Flags).specs
    assert list(specs) == ["level", "url", "count", "names", "loud"]
    assert specs["level"].group == "extra things"
    assert specs["count"].group is None and specs["count"].env is None


def test_flags_carry_the_declared_defaults_and_say_them_in_their_help() -> None:
    shown = _help(_parser())
    assert shown["--count"] == "how many (default 3)"
    assert shown["--name"] == "a name, one a flag (default none)"
    assert shown["--loud"] == "shout"
    assert shown["--url"] == "where"
    args = _parser().parse_args(["--url", "u"])
    assert (args.count, args.names, args.loud, args.level) == (3, [], False, "info")
    assert set(_help(_parser("y"))) == {"-h", "--count"}


def test_from_args_parses_and_checks_what_the_flags_hold() -> None:
    flags = Declarations(_Flags)
    args = _parser().parse_args(["--url", "u", "--count", "5", "--name", "a", "--name", "b",
                                 "--loud"])
    got = flags.from_args(args)
    assert (got.url, got.count, got.names, got.loud, got.hidden) == ("u", 5, ("a", "b"), True,
                                                                     7)
    with pytest.raises(ConfigError, match="^count 0 is below 1$"):
        flags.from_args(_parser().parse_args(["--url", "u", "--count", "0"]))


@pytest.mark.parametrize("argv", [[], ["--url", "u", "--count", "x"],
                                  ["--url", "u", "--level", "loud"]])
def test_argparse_refuses_a_missing_or_mistyped_flag(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    capsys.readouterr()


def test_with_an_environment_prefix_the_flags_given_are_all_a_flag_holds() -> None:
    @dataclass
    class Env:
        count: int = setting(3, parse=s.whole, commands=("x",), help="how many")

    flags = Declarations(Env, "P_")
    parser = argparse.ArgumentParser()
    flags.add_flags(parser, "x")
    assert _help(parser)["--count"] == "how many (default 3); env P_COUNT"
    assert flags.flag_values(parser.parse_args([])) == {}
    assert flags.from_env({"P_COUNT": "4", "OTHER": "1"}) == {"count": "4"}
    with pytest.raises(ConfigError, match="^environment: unknown setting P_COUNTS$"):
        flags.from_env({"P_COUNTS": "4"})


def test_one_of_is_a_required_choice() -> None:
    @dataclass
    class Mode:
        a: bool = setting(False, parse=s.yes_no, commands=("x",), toggle=True, one_of="m",
                          help="a")
        b: bool = setting(False, parse=s.yes_no, commands=("x",), toggle=True, one_of="m",
                          help="b")

    parser = argparse.ArgumentParser()
    Declarations(Mode).add_flags(parser, "x")
    assert parser.parse_args(["--b"]).b
    for argv in ([], ["--a", "--b"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


# -- every subcommand ----------------------------------------------------------------------

#: A few flags of each subcommand, with the default each parses to when not given.
DEFAULTS: dict[str, tuple[list[str], dict[str, object]]] = {
    "record": (["--out", "f", "--duration", "1"], {"interval": 0.1, "profiling": False}),
    "demo": ([], {"duration": 30.0, "rate": 5.0, "port": 8000, "listen": "127.0.0.1:9478",
                  "trace": None, "api": "mix", "preprocess": "naive"}),
    "loadgen": (["--url", "http://h"], {"rate": 2.0, "duration": 30.0, "max_new_tokens": 16,
                                        "max_in_flight": 64, "seed": 1, "api": "mix"}),
    "report": (["--prometheus", "http://p", "--out", "r.html"],
               {"range": "1h", "step": "15s", "timeout": 10.0, "format": None}),
    "selfcheck": (["--dry"], {"dry": True, "gpu": False, "out": None, "duration": None}),
    "catalog": ([], {"out": None, "settings": False}),
    "alerts": (["build"], {"out": "alerts/generated", "selector": None, "runbook_base": None,
                           "cluster_label": None}),
    "dashboards": (["build"], {"out": "dashboards/generated", "selector": None}),
    "proxy": (["--listen", ":1", "--upstream", "http://u", "--metrics-listen", ":2"],
              {"connect_timeout": 10.0, "drain_timeout": 25.0, "log_level": "info",
               "workers": 1, "worker_ready_fd": None}),
    "diagnose": (["--pid", "1"], {"pid": 1, "duration": 10.0, "interval": 0.2, "out": None,
                                  "py_spy": None, "gpu_backend": None}),
    "run": ([], {"interval": None, "listen": None, "config": None}),
    "doctor": ([], {"pids": None, "enable": []}),
}


def test_every_subcommand_is_covered() -> None:
    assert set(DEFAULTS) | {"serve"} == {c.name for c in COMMANDS}


@pytest.mark.parametrize("command", sorted(DEFAULTS))
def test_each_subcommand_parses_to_its_declared_defaults(command: str) -> None:
    argv, expected = DEFAULTS[command]
    args = build_parser(only=command).parse_args([command, *argv])
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize("command", sorted(DEFAULTS))
def test_no_help_text_repeats_a_default_by_hand(command: str) -> None:
    """A default is shown once, as ``(default X)``, from its declaration."""
    parser = build_parser(only=command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = [sub.choices[command]]
    while found:
        p = found.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                found.extend(action.choices.values())
            elif action.help and action.help != argparse.SUPPRESS:
                assert action.help.count("default") <= 1, action.help
                assert "%(default)" not in action.help, action.help


def test_the_service_flags_become_its_settings() -> None:
    from mrc_agent.reference_service.__main__ import build_parser as service_parser
    from mrc_agent.reference_service.__main__ import settings_from_args
    from mrc_agent.reference_service.settings import Settings

    args = service_parser().parse_args(["--allowed-host", "a", "--header-timeout", "2",
                                        "--json-logs", "--max-queue", "3"])
    got = settings_from_args(args)
    assert (args.host, args.port, args.workers, args.log_level) == ("127.0.0.1", 8000, 1, "info")
    assert got.allowed_hosts == ("a",) and got.http_header_timeout_s == 2.0
    assert got.json_logs and got.max_queue == 3
    default = settings_from_args(service_parser().parse_args([]))
    assert default == Settings(cache_dir=default.cache_dir)
    with pytest.raises(ConfigError, match=r"^--pace-burst 0 is out of range \(1-1000000\)$"):
        settings_from_args(service_parser().parse_args(["--pace-burst", "0"]))
