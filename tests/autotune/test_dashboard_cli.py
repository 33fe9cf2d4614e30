"""`kvtune dashboard` refuses what it cannot serve in one line, before starting a server (the
served pages themselves are checked in a real browser by test_dashboards_browser.py)."""

import signal
import socket
import subprocess
import time

import pytest

from tests.autotune.analytic_study import new_study
from tests.autotune.conftest import KVTUNE, kvtune_env, run_kvtune


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvtune dashboard: error: ")
    return line


def test_a_missing_study_is_one_line_naming_the_studies_there(tmp_path, kvtune_cache):
    folder = tmp_path / "studies" / "demo"
    new_study(folder, name="demo")
    default = run_kvtune("dashboard", "study.name=absent", cwd=tmp_path, cache=kvtune_cache)
    line = one_error_line(default)
    assert "study.name='absent'" in line and "studies/: demo" in line
    storage = f"sqlite:///{folder / 'optuna.db'}"
    given = run_kvtune(
        "dashboard",
        "study.name=absent",
        f"study.storage={storage}",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert one_error_line(given).endswith(f"one of the studies in {storage}: demo")


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_bad_port_is_one_line(tmp_path, kvtune_cache, port):
    new_study(tmp_path / "studies" / "demo", name="demo")
    result = run_kvtune(
        "dashboard", "study.name=demo", f"dashboard.port={port}", cwd=tmp_path, cache=kvtune_cache
    )
    assert "dashboard.port=" in one_error_line(result)


def test_a_port_in_use_is_one_line(tmp_path, kvtune_cache):
    new_study(tmp_path / "studies" / "demo", name="demo")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_kvtune(
            "dashboard",
            "study.name=demo",
            f"dashboard.port={port}",
            cwd=tmp_path,
            cache=kvtune_cache,
        )
    assert f"dashboard.port={port} is invalid: a free port" in one_error_line(result)


def test_ctrl_c_stops_the_dashboard_even_when_started_with_sigint_ignored(tmp_path, kvtune_cache):
    # `nohup kvtune dashboard ... &` from a script starts it with SIGINT ignored.
    new_study(tmp_path / "studies" / "demo", name="demo")
    log = tmp_path / "dashboard.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [*KVTUNE, "dashboard", "study.name=demo", "dashboard.port=0"],
            cwd=tmp_path,
            env=kvtune_env(kvtune_cache),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    deadline = time.monotonic() + 120
    while "Ctrl-C stops it." not in log.read_text():
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=120) == 0
    assert "dashboard stopped" in log.read_text()
