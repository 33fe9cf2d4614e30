"""Scale-out on a real PostgreSQL server: three `kvtune worker` processes share one study, and
a worker killed with SIGKILL mid-trial has its trial failed by heartbeat and retried.

The server comes from Debian's `postgresql` package (initdb and pg_ctl under
/usr/lib/postgresql/<version>/bin); it runs from a temporary folder on 127.0.0.1 and a free
port, and stops at the end. PostgreSQL refuses to run as root, so as root the server runs as
the package's `postgres` user.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import psycopg
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from kvtune.autotune.study.optuna_study import FAILURE_ATTR, counted, policy_key
from tests.autotune.conftest import run_kvtune, start_kvtune

APT_HINT = "apt-get install -y postgresql"


def server_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin folder, if any."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parts[-3])
    return found[-1].parent if found else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def postgres() -> Iterator[dict[str, str]]:
    """URLs of two databases (optuna, mlflow) on a throwaway server."""
    bindir = server_bin()
    if bindir is None or not (bindir / "pg_ctl").is_file():
        pytest.skip(f"PostgreSQL server binaries not found under /usr/lib/postgresql ({APT_HINT})")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="kvtune-pg-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()

    def pg(*args: str) -> None:
        subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)

    pg(str(bindir / "initdb"), "-D", str(data), "-U", "kvtune", "--auth=trust", "-E", "UTF8")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    pg(
        str(bindir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(root / "log"),
        "-w",
        "start",
    )
    try:
        with psycopg.connect(
            host="127.0.0.1", port=port, user="kvtune", dbname="postgres", autocommit=True
        ) as admin:
            admin.execute("CREATE DATABASE optuna")
            admin.execute("CREATE DATABASE mlflow")
        base = f"postgresql://kvtune@127.0.0.1:{port}"
        yield {"optuna": f"{base}/optuna", "mlflow": f"{base}/mlflow"}
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def create_study(name: str, urls, tiny_study_args, cwd: Path, cache: Path) -> list[str]:
    """Start an empty study with `kvtune tune study.n_trials=0`; returns the worker args."""
    shared = [f"study.name={name}", f"study.storage={urls['optuna']}"]
    shared += [f"mlflow.tracking_uri={urls['mlflow']}", "study.heartbeat_interval_s=1"]
    shared += ["study.grace_period_s=4"]
    result = run_kvtune("tune", *shared, "study.n_trials=0", *tiny_study_args, cwd=cwd, cache=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    return shared


def trial_runs(urls, name: str) -> list:
    client = MlflowClient(urls["mlflow"])
    experiment = client.get_experiment_by_name(name)
    return client.search_runs([experiment.experiment_id], "tags.`kvtune.kind` = 'trial'")


@pytest.mark.slow
def test_three_workers_share_one_study(postgres, tiny_study_args, tmp_path, kvtune_cache):
    worker_args = create_study("shared", postgres, tiny_study_args, tmp_path, kvtune_cache)
    workers = [
        start_kvtune(
            "worker",
            *worker_args,
            "study.n_trials=6",
            cwd=tmp_path,
            cache=kvtune_cache,
            log=tmp_path / f"worker{i}.log",
        )
        for i in range(3)
    ]
    for i, worker in enumerate(workers):
        assert worker.wait(timeout=900) == 0, (tmp_path / f"worker{i}.log").read_text()[-3000:]

    trials = optuna.load_study(study_name="shared", storage=postgres["optuna"]).get_trials()
    budget = [t for t in trials if counted(t)]
    assert len(budget) == 6 and all(t.state == TrialState.COMPLETE for t in budget)
    policies = [policy_key(t.user_attrs["policy"]) for t in budget]
    assert len(set(policies)) == 6  # three workers, yet no policy measured twice
    runs = trial_runs(postgres, "shared")
    numbers = [int(r.data.tags["trial_number"]) for r in runs]
    assert sorted(numbers) == sorted(t.number for t in budget)  # every trial once, no duplicate
    assert all("accuracy_retention" in r.data.metrics for r in runs)
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) >= 2  # the trials were shared out between worker processes


@pytest.mark.slow
def test_a_killed_worker_trial_is_retried_and_the_study_completes(
    postgres, tiny_study_args, tmp_path, kvtune_cache
):
    worker_args = create_study("killed", postgres, tiny_study_args, tmp_path, kvtune_cache)
    # An empty cache of its own: the victim measures its trial (seconds) instead of answering it
    # from the shared cache in milliseconds, so the SIGKILL lands while the trial runs.
    victim = start_kvtune(
        "worker",
        *worker_args,
        "study.n_trials=3",
        cwd=tmp_path,
        cache=tmp_path / "victim-cache",
        log=tmp_path / "victim.log",
    )
    storage = optuna.storages.RDBStorage(postgres["optuna"])
    deadline = time.monotonic() + 300
    running = []
    while not running and time.monotonic() < deadline and victim.poll() is None:
        study = optuna.load_study(study_name="killed", storage=storage)
        running = [t for t in study.get_trials() if t.state == TrialState.RUNNING]
        time.sleep(0.2)
    assert running, (tmp_path / "victim.log").read_text()[-3000:]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    killed = running[0].number

    survivor = run_kvtune(
        "worker", *worker_args, "study.n_trials=3", cwd=tmp_path, cache=kvtune_cache
    )
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    trials = optuna.load_study(study_name="killed", storage=storage).get_trials()
    stale = trials[killed]
    assert stale.state == TrialState.FAIL and FAILURE_ATTR not in stale.user_attrs
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed]
    assert retries and retries[0].state == TrialState.COMPLETE
    # The retry keeps the policy the killed trial was given: its sampled params, or (killed
    # before the objective ran) a warm start's fixed ones; a trial given none has none to keep.
    given = stale.params or stale.system_attrs.get("fixed_params", {})
    assert all(retries[0].params[name] == value for name, value in given.items())
    budget = [t for t in trials if counted(t)]
    assert len(budget) == 3 and all(t.state == TrialState.COMPLETE for t in budget)
