"""``mrc-agent`` as a user runs it: real processes, real sockets on loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import BUSY, DATA, IDLE, REPO, Procs, parse_metrics, series


def _mrc(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mrc_agent.agent", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--interval", "soon"], "invalid float value: 'soon'"),
        (["run", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "--process-name", "(oops"], "does not compile"),
        (["run", "--pidfile", "/nonexistent/svc.pid"], "cannot read pidfile"),
        (["run", "--interval", "0"], "out of range"),
        (["run", "--gpu-backend", "replay:/nonexistent.jsonl"], "cannot read replay trace"),
        (["run", "--collector", "warp"], "invalid choice: 'warp'"),
        (["run", "--listen", "localhost"], "is not HOST:PORT"),
        (["run", "--config", "/nonexistent.yaml"], "cannot read config file"),
        (["record", "--out", "/tmp/x.jsonl", "--duration", "-1"], "--duration must be > 0"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, message) -> None:
    r = _mrc(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_malformed_replay_names_the_line(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0, "gpu": 0}\n{"t": 1, "gpu": 0, "gpu_util": 7}\n')
    r = _mrc("run", "--gpu-backend", f"replay:{trace}", "--listen", "127.0.0.1:0")
    assert r.returncode == 2
    assert f"{trace}:2: 'gpu_util' is a 0-1 ratio" in r.stderr


def test_port_in_use_is_exit_2(busy_port: int) -> None:
    r = _mrc("run", "--gpu-backend", "none", "--listen", f"127.0.0.1:{busy_port}")
    assert r.returncode == 2
    assert f"cannot listen on 127.0.0.1:{busy_port}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_env_and_config_file_bad_values_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "mrc_agent.agent", "run"], capture_output=True,
                       text=True,
                       env={"MRC_AGENT_INTERVAL": "never", "PATH": "/usr/bin:/bin"},
                       cwd=REPO, timeout=30)
    assert r.returncode == 2 and "invalid value 'never' for interval" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_exit_cleanly(agent_factory, sig) -> None:
    agent = agent_factory("--gpu-backend", "none")
    agent.proc.send_signal(sig)
    assert agent.proc.wait(10) == 0


def _scrape(url: str) -> dict:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text)


def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_restarted_service_is_picked_up_within_an_interval(agent_factory, procs: Procs) -> None:
    marker = f"mrc-restart-{time.monotonic_ns()}"
    first = procs.spawn(BUSY, 60.0, marker)
    agent = agent_factory("--process-name", marker, "--interval", "0.2",
                          "--gpu-backend", "none")
    _wait_for(lambda: series(_scrape(agent.url), "mrc_process_cpu_user_ratio",
                             pid=str(first.pid)))
    first.kill()
    first.wait()
    second = procs.spawn(IDLE, 60.0, marker)
    t0 = time.monotonic()
    m = _wait_for(lambda: (lambda m: m if series(m, "mrc_process_threads",
                                                 pid=str(second.pid)) else None)(
        _scrape(agent.url)))
    assert time.monotonic() - t0 < 2.0  # found within a few intervals of 0.2 s
    assert not series(m, "mrc_process_cpu_seconds_total", pid=str(first.pid))


def test_without_gpu_the_agent_runs_with_cpu_collectors(agent_factory, procs: Procs) -> None:
    idle = procs.spawn(IDLE)
    # auto backend on a host without the NVML library (this CI machine has none).
    agent = agent_factory("--pid", str(idle.pid), "--interval", "0.1")
    time.sleep(1.0)
    m = _scrape(agent.url)
    assert series(m, "mrc_agent_collector_success", collector="process") == [1.0]
    assert series(m, "mrc_agent_collector_available", collector="gpu") == [0.0]
    assert series(m, "mrc_agent_collector_available", collector="gpm") == [0.0]
    assert not series(m, "mrc_gpu_utilization_ratio")
    agent.stop()
    log = "".join(agent.log) + agent.proc.stderr.read()
    # Said once, not once per 0.1 s pass.
    assert log.count("collector gpu not available") == 1, log


def test_replay_trace_drives_gpu_series(agent_factory) -> None:
    agent = agent_factory("--gpu-backend", f"replay:{DATA / 'fixed_device.jsonl'}",
                          "--interval", "0.1")
    m = _wait_for(lambda: (lambda m: m if series(m, "mrc_gpu_nvlink_tx_bytes_total") else None)(
        _scrape(agent.url)))
    assert len(series(m, "mrc_gpu_memory_total_bytes")) == 2
    assert series(m, "mrc_gpu_utilization_ratio", gpu="1", uuid="GPU-fixed-0001") == [0.95]


def test_catalog_command_prints_every_metric() -> None:
    r = _mrc("catalog")
    assert r.returncode == 0
    assert "`mrc_process_cpu_user_ratio`" in r.stdout and "`mrc_gpu_starved`" in r.stdout


def test_sighup_rereads_the_config_file_and_keeps_running(agent_factory, procs: Procs,
                                                          tmp_path) -> None:
    first, second = procs.spawn(IDLE), procs.spawn(IDLE)
    config = tmp_path / "agent.yaml"
    config.write_text(f"pids: [{first.pid}]\ninterval: 0.2\n")
    agent = agent_factory("--gpu-backend", "none", "--config", str(config))

    def watched() -> set[str]:
        return {dict(labels)["pid"] for name, labels in _scrape(agent.url)
                if name == "mrc_process_threads"}

    assert _wait_for(lambda: watched() == {str(first.pid)})
    config.write_text(f"pids: [{second.pid}]\ninterval: 0.5\n")
    agent.proc.send_signal(signal.SIGHUP)
    assert _wait_for(lambda: watched() == {str(second.pid)})
    # A broken file on the next SIGHUP is refused and the running configuration kept.
    config.write_text("pids: [oops\n")
    agent.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert agent.proc.poll() is None and watched() == {str(second.pid)}
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    assert agent.proc.stderr is not None
    log = agent.proc.stderr.read()
    assert "configuration reloaded" in log and "restart to apply interval" in log
    assert "configuration not reloaded, keeping the running one" in log
    assert "Traceback" not in log


def test_every_command_is_a_module_with_two_entry_points() -> None:
    """The command table: each subcommand's module gives its flags and runs it, and building
    the parser for one command imports that command's module and no other tool."""
    import importlib

    from mrc_agent.agent.cli import COMMANDS, build_parser

    assert len({c.name for c in COMMANDS}) == len(COMMANDS) == 13
    for command in COMMANDS:
        module = importlib.import_module(command.module)
        add, run = (getattr(module, name) for name in command.entry)
        assert callable(add) and callable(run), command.name
    full = build_parser()
    assert full.parse_args(["proxy", "--listen", "a:1", "--upstream", "http://b",
                            "--metrics-listen", "c:2"]).drain_timeout == 25.0
    code = ("import sys\nfrom mrc_agent.agent.cli import build_parser\n"
            "build_parser(only='run').parse_args(['run', '--pid', '1'])\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('mrc_agent.agent.tools')"
            " or m.startswith('mrc_agent.reference_service'))))\n")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60).stdout.split()
    assert loaded == ["mrc_agent.agent.tools", "mrc_agent.agent.tools.sidecar"], loaded
