"""The agent's hostile-input corpus: files, flags and payloads an attacker or an accident can
hand it. Each gets one clear line and exit code 2 (or a 4xx), never a traceback, a hang or a
500 — and the agent keeps sampling.

Files are read only when regular, without blocking and up to a bound (``agent/core/files.py``),
so FIFOs and devices are refused at once; every case runs under a timeout that a blocking read
would exceed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import httpx
import pytest

from mrc_agent.agent.cli import main as cli_main
from mrc_agent.agent.core.config import SETTINGS, ConfigError, load, parse_listen
from mrc_agent.agent.core.hw.replay import MAX_TRACE_BYTES, ReplayFormatError, load_trace
from mrc_agent.agent.core.runner import Runner
from mrc_agent.agent.core.targets import PidfileError, TargetResolver, read_pidfile
from mrc_agent.agent.tools.capture.api import CaptureAPI
from mrc_agent.agent.tools.capture.manager import CaptureManager
from mrc_agent.agent.tools.capture.store import CaptureStore
from mrc_agent.agent.tools.capture.webhook import Token, WebhookError, parse_webhook
from mrc_agent.exporters.exposition.http import Request
from mrc_agent.exporters.files import FileRefused, read_bounded

TOKEN = "s3cret-token-0123456789abcdef"


def _in_time(fn, seconds: float = 5.0):
    """``fn()``'s result, failing (instead of hanging the suite) when it blocks."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# -- the bounded reader -------------------------------------------------------------------------


def test_reader_refuses_fifos_devices_and_oversized_files(tmp_path: Path, fifo: Path) -> None:
    with pytest.raises(FileRefused, match="not a regular file"):
        _in_time(lambda: read_bounded(str(fifo), 100, "thing"))
    with pytest.raises(FileRefused, match="not a regular file"):
        _in_time(lambda: read_bounded("/dev/zero", 100, "thing"))
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(FileRefused, match="101 bytes; at most 100"):
        read_bounded(str(big), 100, "thing")
    assert read_bounded(str(big), 10, "thing", truncate=True) == b"x" * 10
    with pytest.raises(FileNotFoundError):
        read_bounded(str(tmp_path / "missing"), 100, "thing")


# -- pidfile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["²\n", "⁵", "12x", "0", "-4", "99999999999", "", "٣"])
def test_pidfile_without_a_pid_is_one_clear_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "pid"
    path.write_text(content)
    with pytest.raises(PidfileError, match="does not hold a PID"):
        read_pidfile(str(path))


def test_pidfile_that_is_a_fifo_or_a_device_never_blocks(fifo: Path) -> None:
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(PidfileError, match="not a regular file"):
            _in_time(lambda p=path: read_pidfile(p))  # type: ignore[misc]


def test_pidfile_turned_hostile_costs_the_target_not_the_pass(tmp_path: Path) -> None:
    path = tmp_path / "pid"
    path.write_text(f"{os.getpid()}\n")
    resolver = TargetResolver(pidfile=str(path))
    assert [t.pid for t in resolver.resolve()] == [os.getpid()]
    path.write_text("²")
    assert resolver.resolve() == []
    path.unlink()
    os.mkfifo(path)
    assert _in_time(resolver.resolve) == []
    runner = Runner([], resolver, 1.0)
    snap = _in_time(runner.sample_once)
    assert snap is not None and snap.seq == 1  # the pass completed


# -- flags and the config file ------------------------------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:²", "127.0.0.1:⁵", ":٩٠", "[::1:80", "x]:1",
                                    "127.0.0.1:65536", "127.0.0.1"])
def test_bad_listen_addresses(listen: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--listen", listen, "--gpu-backend", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not HOST:PORT" in err


def test_ipv6_listen_address_as_documented() -> None:
    assert parse_listen("[::1]:9478") == ("::1", 9478)
    from mrc_agent.agent.core.config import AgentConfig
    from mrc_agent.agent.core.hw.sources import Sources
    from mrc_agent.agent.core.wiring import build_runner, build_server

    cfg = AgentConfig(listen="[::1]:0", gpu_backend="none")
    runner = build_runner(cfg, Sources())
    runner.sample_once()
    server = build_server(cfg, runner)
    server.start()
    try:
        r = httpx.get(f"http://[::1]:{server.port}/metrics", timeout=5)
        assert r.status_code == 200 and "mrc_agent_samples_total 1.0" in r.text
        assert server._sock.family == socket.AF_INET6
    finally:
        server.stop()


def _config(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "agent.yaml"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(("data", "message"), [
    (b"interval: 1\nlisten: \xff\xfe\n", "is not UTF-8 text"),
    (b"[" * 100_000, "nested too deeply"),
    (b"interval: [1\n", "is not valid YAML"),
    (b"collectors: {gpu: maybe}\n", "'maybe' is not true or false"),
    (b"pids: true\n", "invalid value True for pids"),
    (b"interval: true\n", "invalid value True for interval"),
    (b"capture_max_count: 5.5\n", "invalid value 5.5 for capture_max_count"),
    (b"x" * ((1 << 20) + 1), "at most 1048576 are read"),
])
def test_bad_config_files_are_one_line(tmp_path: Path, data: bytes, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load({}, env={}, config_path=_config(tmp_path, data))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_file_that_is_a_fifo_or_a_device(fifo: Path) -> None:
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(ConfigError, match="not a regular file"):
            _in_time(lambda p=path: load({}, env={}, config_path=p))  # type: ignore[misc]


def test_collector_switches_read_as_booleans(tmp_path: Path) -> None:
    cfg = load({}, env={}, config_path=_config(
        tmp_path, b'collectors: {gpu: "false", gpm: "off", profiling: "yes", derived: 0}\n'))
    assert cfg.enabled == ["process", "profiling", "stacks"]


def test_token_file_that_is_a_fifo(fifo: Path) -> None:
    from mrc_agent.agent.core.config import read_token_file

    with pytest.raises(ConfigError, match="not a regular file"):
        _in_time(lambda: read_token_file(str(fifo)))


def test_cli_exits_2_on_hostile_files(tmp_path: Path, fifo: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad = _config(tmp_path, b"\xff\xfe")
    for argv in (["run", "--config", bad], ["run", "--config", str(fifo)],
                 ["run", "--pidfile", str(fifo)], ["run", "--gpu-backend", f"replay:{fifo}"],
                 ["run", "--gpu-backend", "replay:/dev/zero"],
                 ["doctor", "--config", bad]):
        assert _in_time(lambda a=argv: cli_main(a)) == 2, argv  # type: ignore[misc]
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_diagnose_out_on_an_existing_file(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "report"
    taken.write_text("mine")
    assert cli_main(["diagnose", "--pid", str(os.getpid()), "--out", str(taken),
                     "--gpu-backend", "none"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and err.count("\n") == 1
    assert taken.read_text() == "mine"


# -- replay traces ------------------------------------------------------------------------------


def _trace(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = '{"t": 0, "gpu": 0, "gpu_util": 0.5}'


@pytest.mark.parametrize(("line", "message"), [
    ('{"t": 0, "gpu": 0, "gpu_util": 1' + "0" * 400 + "}", "'gpu_util' must be a number"),
    ('{"t": 1' + "0" * 400 + ', "gpu": 0}', "'t' must be a number"),
    ('{"t": 0, "gpu": 1' + "0" * 5000 + "}", "not valid JSON"),
    ('{"t": 0, "gpu": 0, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"t": 0, "gpu": 1' + "0" * 400 + "}", "'gpu' must be an integer 0-1023"),
    ('{"t": 0, "gpu": 0, "uuid": "' + "U" * 300 + '"}', "at most 256 characters"),
    ('{"t": 0, "gpu": true}', "'gpu' must be an integer"),
    # A lone surrogate is valid JSON but no text: every scrape would fail to encode it.
    ('{"t": 0, "gpu": 0, "name": "H200 \\ud800"}', "'name' is not valid Unicode text"),
    ('{"t": 0, "gpu": 1, "uuid": "GPU-\\udcff"}', "'uuid' is not valid Unicode text"),
    ('{"t": 0, "gpu": 0, "processes": {"1' + "0" * 5000 + '": 1}}', "is not a PID"),
])
def test_hostile_trace_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = _trace(tmp_path, [GOOD, line])
    with pytest.raises(ReplayFormatError) as err:
        load_trace(path)
    assert f"{path}:2: " in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_process_names_and_command_lines_from_proc_are_always_encodable(tmp_path: Path) -> None:
    """The process label comes from /proc/PID/stat's comm and the target match from the
    command line: bytes a process chooses, decoded with replacement (never surrogateescape),
    so no lone surrogate can reach a label."""
    from mrc_agent.agent.core.hw.procfs import ProcFS
    from tests.unit.test_procfs import stat_line

    hostile = b"\xed\xa0\x80\xff\xfe(x) "  # a UTF-8-encoded surrogate, bytes no UTF-8 has
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_bytes(stat_line(7, comm=hostile))
    (tmp_path / "7" / "cmdline").write_bytes(b"python3\0" + hostile + b"\0")
    (tmp_path / "7" / "environ").write_bytes(b"NVIDIA_VISIBLE_DEVICES=" + hostile + b"\0")
    fs = ProcFS(root=str(tmp_path))
    texts = [fs.stat(7).comm, fs.cmdline(7),
             *fs.environ(7, ("NVIDIA_VISIBLE_DEVICES",)).values()]
    assert len(texts) == 3
    for text in texts:
        assert "\ufffd" in text
        text.encode("utf-8")  # raises on a lone surrogate
    fs.close()


def test_trace_larger_than_the_bound_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:  # sparse: costs no disk
        f.truncate(MAX_TRACE_BYTES + 1)
    with pytest.raises(ReplayFormatError, match="at most 16777216 are read"):
        _in_time(lambda: load_trace(str(path)), 2.0)


# -- webhook payloads ---------------------------------------------------------------------------


def test_deeply_nested_webhook_is_a_client_error() -> None:
    with pytest.raises(WebhookError, match="nested too deeply"):
        parse_webhook(b"[" * 100_000 + b"]" * 100_000)


@pytest.fixture
def api(tmp_path: Path) -> CaptureAPI:
    from mrc_agent.agent.core.config import AgentConfig

    cfg = AgentConfig(pids=[os.getpid()], gpu_backend="none", webhook_token=TOKEN)
    store = CaptureStore(str(tmp_path / "captures"), 10, 1 << 20, 3600)
    manager = CaptureManager(cfg, store, Runner([], TargetResolver([os.getpid()]), 1.0))
    return CaptureAPI(manager, Token(value=TOKEN), hostname="pod-a")


def _post(api: CaptureAPI, body: bytes) -> tuple[int, dict[str, object]]:
    resp = api.handle(Request("POST", "/hooks/alertmanager",
                              {"authorization": f"Bearer {TOKEN}"}, body))
    assert resp is not None
    return resp.status, json.loads(resp.body)


@pytest.mark.parametrize("pid", ["²", "⁵", "1" + "0" * 5000, "-1", "0x10", " 7", "٣"])
def test_webhook_with_odd_pid_labels_ignores_them(api: CaptureAPI, pid: str) -> None:
    payload = {"version": "4", "status": "firing", "alerts": [
        {"status": "firing", "labels": {"alertname": "MRCGPUStarved", "pid": pid}}]}
    status, body = _post(api, json.dumps(payload).encode())
    assert status == 200, body
    assert "is not a target of this agent" in json.dumps(body)
    assert api.manager is not None and api.manager.running is None


def test_webhook_nested_deeply_gets_400(api: CaptureAPI) -> None:
    status, body = _post(api, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in json.dumps(body)


# -- settings given no value --------------------------------------------------------------------

FILE_SETTINGS = [s.name for s in SETTINGS.values() if not s.env_only]


@pytest.mark.parametrize("key", FILE_SETTINGS)
def test_a_setting_given_no_value_is_one_clear_line(tmp_path: Path, key: str) -> None:
    for empty in ("", " null", " ~", " Null"):
        path = _config(tmp_path, f"{key.replace('_', '-')}:{empty}\n".encode())
        with pytest.raises(ConfigError) as err:
            load({}, env={}, config_path=path)
        assert str(err.value) == (f"config file {path}: {key} has no value (give one, or "
                                  "leave the key out for the default)"), empty


@pytest.mark.parametrize("key", ["log_level", "listen", "gpu_backend", "capture_dir"])
def test_cli_exits_2_on_a_setting_given_no_value(tmp_path: Path, key: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, f"{key}:\n".encode())
    assert cli_main(["run", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{key} has no value" in err, err


# -- alias bombs and long values ----------------------------------------------------------------

def _bomb(levels: int = 9, width: int = 9) -> str:
    """A "billion laughs" YAML flow sequence: ``width ** levels`` items, a few hundred bytes."""
    items = ['&a0 [' + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        items.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "[" + ", ".join(items) + "]"


#: Reads one file under a 512 MiB address-space limit (the interpreter and the modules take
#: some 40 MiB) and prints the ConfigError: an alias expanded into a message dies here of
#: MemoryError instead of taking the machine's memory.
_BOUNDED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
from mrc_agent.agent.core.config import ConfigError, load
from mrc_agent.exporters.exposition.http.webconfig import load_web_config
try:
    load({}, env={}, config_path=sys.argv[2]) if sys.argv[1] == "agent" \\
        else load_web_config(sys.argv[2])
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.parametrize(("kind", "text"), [
    ("agent", f"listen: {_bomb()}\n"),
    ("agent", f"interval: {_bomb()}\n"),
    ("agent", f"collectors: {_bomb()}\n"),
    ("agent", f"pids: {_bomb()}\n"),
    ("web", f"tls_server_config:\n  cert_file: {_bomb()}\n"),
    ("web", f"basic_auth_users: {{alice: {_bomb()}}}\n"),
    ("web", f"http_server_config:\n  headers: {{X-Frame-Options: {_bomb()}}}\n"),
], ids=["listen", "interval", "collectors", "pids", "cert_file", "basic_auth_users",
        "headers"])
def test_a_yaml_alias_bomb_is_refused_without_expanding(tmp_path: Path, kind: str,
                                                        text: str) -> None:
    import subprocess
    import sys

    path = _config(tmp_path, text.encode())
    assert len(text) < 600
    r = subprocess.run([sys.executable, "-c", _BOUNDED, kind, path], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    line = r.stdout.strip()
    assert "\n" not in line and len(line) < 300, line[:2000]
    assert "anchors and aliases are not allowed" in line and f"{path}:" in line, line


def test_an_anchor_alone_and_a_merge_key_are_refused_too(tmp_path: Path) -> None:
    for text in (b"listen: &l 127.0.0.1:1\n", b"base: &b {interval: 2}\n<<: *b\n"):
        with pytest.raises(ConfigError, match="anchors and aliases are not allowed"):
            load({}, env={}, config_path=_config(tmp_path, text))


@pytest.mark.parametrize("text", [
    "listen: " + "x" * 100_000,
    "interval: " + "x" * 100_000,
    "gpu_backend: " + "x" * 100_000,
    "log_level: " + "x" * 100_000,
    "process_name: '(" + "x" * 100_000 + "'",
    "collectors: " + "x" * 100_000,
    "collectors: {gpu: " + "x" * 100_000 + "}",
    "x" * 100_000 + ": 1",
    "pids: [" + ", ".join(["[1]"] * 20_000) + "]",
    "interval: 1" + "0" * 5000,
    "interval: 0b" + "1" * 20_000,
    "capture_max_count: 0b" + "1" * 20_000,
    "pids: 0b" + "1" * 20_000,
    "0b" + "1" * 20_000 + ": 1",
    "capture_retention: 2024-13-45",
], ids=["listen", "interval", "gpu_backend", "log_level", "process_name", "collectors",
        "collector-switch", "key", "pids-nested", "interval-long-decimal", "interval-long-binary",
        "count-long-binary", "pids-long-binary", "key-long-binary", "no-date"])
def test_a_long_value_is_shown_cut_in_the_message(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        load({}, env={}, config_path=_config(tmp_path, text.encode()))
    message = str(err.value)
    assert "\n" not in message and len(message) < 400 + len(str(tmp_path)), message[:1000]


@pytest.mark.parametrize("text", [
    "tls_server_config:\n  cert_file: [" + ", ".join(["x"] * 30_000) + "]\n",
    "tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: " + "x" * 100_000 + "\n",
    "tls_server_config:\n  client_auth_type: " + "x" * 100_000 + "\n",
    "tls_server_config:\n  cert_file: c\n  key_file: k\n  prefer_server_cipher_suites: "
    + "x" * 100_000 + "\n",
    "http_server_config:\n  headers: {" + "x" * 100_000 + ": 1}\n",
    "http_server_config:\n  headers: {X-Frame-Options: " + "x" * 100_000 + "}\n",
    "basic_auth_users: {" + "x" * 100_000 + ": nope}\n",
    "basic_auth_users: {1" + "0" * 100_000 + ": nope}\n",
    "x" * 100_000 + ": 1\n",
    "0b" + "1" * 20_000 + ": 1\n",
], ids=["cert_file", "min_version", "client_auth_type", "prefer_server_cipher_suites",
        "header-name", "header-value", "user", "user-number", "key", "key-long-binary"])
def test_a_long_web_config_value_is_shown_cut_in_the_message(tmp_path: Path,
                                                             text: str) -> None:
    from mrc_agent.exporters.exposition.http.webconfig import load_web_config

    with pytest.raises(ConfigError) as err:
        load_web_config(_config(tmp_path, text.encode()))
    message = str(err.value)
    assert "\n" not in message and len(message) < 400 + len(str(tmp_path)), message[:1000]


# -- SIGHUP -------------------------------------------------------------------------------------

def test_a_failed_reload_keeps_the_running_configuration(tmp_path: Path,
                                                         agent_factory: type) -> None:
    """Nulls and alias bombs in either file on SIGHUP: one line each, the agent serves on with
    what it ran with. Its address space is bounded so that an expansion fails in it, not in the
    machine."""
    import resource
    import signal
    import time

    config, web = tmp_path / "agent.yaml", tmp_path / "web.yaml"
    config.write_text("log_level: info\n")
    web.write_text("")
    agent = agent_factory("--gpu-backend", "none", "--config", str(config),
                          "--web-config-file", str(web))
    status = Path(f"/proc/{agent.proc.pid}/status").read_text()
    vm = int(status.split("VmSize:")[1].split()[0]) << 10
    resource.prlimit(agent.proc.pid, resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(agent.proc.stderr.readline, "")),
                              daemon=True)
    reader.start()

    def refused() -> int:
        return sum("configuration not reloaded, keeping the running one" in x for x in lines)

    cases = [("log_level:\n", ""), ("listen: ~\n", ""), ("gpu_backend: null\n", ""),
             (f"listen: {_bomb()}\n", ""),
             ("log_level: info\n", f"tls_server_config:\n  cert_file: {_bomb()}\n")]
    for n, (text, web_text) in enumerate(cases, 1):
        config.write_text(text)
        web.write_text(web_text)
        agent.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while refused() < n and agent.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.proc.poll() is None, "".join(lines)[-3000:]
        assert refused() == n, "".join(lines)[-3000:]
        r = httpx.get(agent.url + "/metrics", timeout=10)
        assert r.status_code == 200 and "mrc_agent_samples_total" in r.text
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    reader.join(10)
    log = "".join(lines)
    assert "Traceback" not in log, log[-3000:]
    for line in log.splitlines():
        assert len(line) < 600, line[:1000]
    assert "has no value" in log and "anchors and aliases are not allowed" in log
