"""What a user sees of a study in the MLflow UI and in optuna-dashboard, in a real browser.

A short real study (`kvtune tune` on the tiny model) is served by `mlflow server` and by
`kvtune dashboard`; headless Chromium renders their single-page apps after their API calls
(virtual time) and the rendered DOM must show the study's experiment on the runs table, one run
per trial with the trial's policy and objectives, the parent run's Pareto artifacts, and the
Pareto front with the objectives named. The oracle is the Optuna study itself (its trials and
Optuna's own Pareto set), read from the storage, not through either server. Screenshots go to
test-artifacts/dashboards/ for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import FrozenTrial, TrialState

from tests.autotune.conftest import KVTUNE, kvtune_env, run_kvtune

CHROMIUM = shutil.which("chromium")
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboards"
STUDY = "browser"
N_TRIALS = 3
OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence", "tpot_ms")
POLICY_PARAMS = (
    "block_size",
    "chunk_size",
    "csa_ratio",
    "csa_window",
    "csa_sinks",
    "group_size",
    "recent_unquantized",
    "scale_dtype",
)
# MLflow 3.17's UI shows a GenAI or a model-training view by a per-browser switch (GenAI by
# default, whatever the experiment's tags say); this query parameter asks for model training.
ML_VIEW = "workflowType=machine_learning"
START_TIMEOUT_S = 240  # mlflow server needs ~30 s on 2 busy cores
BROWSER_TIMEOUT_S = 180
DASHBOARD_URL = re.compile(r"(http://127\.0\.0\.1:\d+)/dashboard/studies/(\d+)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="chromium is not installed (.ci/run installs Debian's chromium)"
    ),
]


class RenderedPage(HTMLParser):
    """A rendered DOM as a user reads it: its words (scripts and styles left out), the rows of
    its tables (HTML tables and ARIA grids alike: a row's cell texts, header cells included)
    and its images (attributes)."""

    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta"})
    ROWS = frozenset({"row"})
    CELLS = frozenset({"cell", "gridcell", "columnheader", "rowheader"})

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.words: list[str] = []
        self.rows: list[list[str]] = []
        self.images: list[dict[str, str | None]] = []
        self._open: list[str] = []
        self._hidden = 0
        self._row: tuple[int, list[str]] | None = None
        self._cell: tuple[int, list[str]] | None = None
        self.feed(dom)
        self.text = " ".join(self.words)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs))
        if tag in self.VOID:
            return
        self._open.append(tag)
        role = dict(attrs).get("role")
        if tag in ("script", "style"):
            self._hidden += 1
        elif tag == "tr" or role in self.ROWS:
            self._row = (len(self._open), [])
        elif (
            self._row is not None
            and self._cell is None
            and (tag in ("td", "th") or role in self.CELLS)
        ):
            self._cell = (len(self._open), [])

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID or not self._open:
            return
        depth = len(self._open)
        self._open.pop()
        if tag in ("script", "style"):
            self._hidden -= 1
        if self._cell is not None and self._cell[0] == depth and self._row is not None:
            self._row[1].append(" ".join("".join(self._cell[1]).split()))
            self._cell = None
        elif self._row is not None and self._row[0] == depth:
            self.rows.append(self._row[1])
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._hidden:
            return
        self.words += data.split()
        if self._cell is not None:
            self._cell[1].append(data)

    def row(self, header: str) -> list[str]:
        """The cells after the first cell of the one row that starts with `header`."""
        [match] = [r[1:] for r in self.rows if r and r[0] == header]
        return match


class Chromium:
    """Headless Chromium: each visit is a fresh profile (a first-time user), rendered for 15 s of
    virtual time, then its DOM is read; the screenshot and the DOM are kept side by side."""

    def __init__(self, profiles: Path, shots: Path) -> None:
        self.profiles = profiles
        self.shots = shots
        self.visits = 0

    def visit(self, url: str, shot: str) -> RenderedPage:
        self.visits += 1
        result = subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1600,1000",
                "--virtual-time-budget=15000",
                f"--user-data-dir={self.profiles / str(self.visits)}",
                "--dump-dom",
                f"--screenshot={self.shots / shot}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=BROWSER_TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert (self.shots / shot).stat().st_size > 0
        (self.shots / shot).with_suffix(".html").write_text(result.stdout)  # what was read
        return RenderedPage(result.stdout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def wait_for(ready: Callable[[], bool], server: subprocess.Popen, log: Path, what: str) -> None:
    """Poll `ready` until it holds; fail early if the server died, or after START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"{what} exited:\n{log.read_text()[-3000:]}"
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{what} not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(server: subprocess.Popen) -> None:
    """End a server this test started, with its worker processes (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def start_server(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """A server in its own process group (stopped with its workers), output to `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@dataclass(frozen=True)
class Served:
    """The study, its tracking store, and the two servers a user opens (root URLs)."""

    study: optuna.Study
    tracking: MlflowClient
    mlflow_url: str
    dashboard_url: str
    dashboard_study_id: int
    dashboard: subprocess.Popen


@pytest.fixture()
def served(tmp_path, tiny_study_args, kvtune_cache) -> Iterator[Served]:
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tuned = run_kvtune(
        "tune",
        f"study.name={STUDY}",
        f"study.n_trials={N_TRIALS}",
        f"study.storage={storage}",
        f"mlflow.tracking_uri={tracking_uri}",
        *tiny_study_args,
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    env = kvtune_env(kvtune_cache)
    port = free_port()
    mlflow_log, dashboard_log = tmp_path / "mlflow-server.log", tmp_path / "dashboard.log"
    servers: list[subprocess.Popen] = []
    try:
        mlflow_command = [sys.executable, "-m", "mlflow", "server", "--workers", "1"]
        mlflow_command += ["--host", "127.0.0.1", "--port", str(port)]
        servers.append(
            start_server(
                [*mlflow_command, "--backend-store-uri", tracking_uri], tmp_path, env, mlflow_log
            )
        )
        dashboard_command = [*KVTUNE, "dashboard", f"study.name={STUDY}", "dashboard.port=0"]
        servers.append(
            start_server(
                [*dashboard_command, f"study.storage={storage}"], tmp_path, env, dashboard_log
            )
        )
        mlflow_url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: http_get(f"{mlflow_url}/health") == b"OK", servers[0], mlflow_log, "mlflow"
        )

        def printed_url() -> re.Match | None:  # the URL `kvtune dashboard` prints
            return DASHBOARD_URL.search(dashboard_log.read_text())

        def dashboard_answers() -> bool:
            found = printed_url()
            return found is not None and STUDY in http_get(f"{found[1]}/api/studies").decode()

        wait_for(dashboard_answers, servers[1], dashboard_log, "kvtune dashboard")
        found = printed_url()
        yield Served(
            optuna.load_study(study_name=STUDY, storage=storage),
            MlflowClient(tracking_uri),
            mlflow_url,
            found[1],
            int(found[2]),
            servers[1],
        )
    finally:
        for server in servers:
            stop(server)


def policy_row(trial: FrozenTrial, field: str) -> str:
    return str(trial.user_attrs["policy"][field])


def layer_counts(trial: FrozenTrial) -> dict[str, list[str]]:
    """Layers per K and V dtype, from the sampled per-group dtypes (the tiny search has one
    group a layer), as the run page's rows `k_fp8_layers: [n]` (dtypes no layer uses: none)."""
    sides = (name[0] for name in trial.params if re.fullmatch(r"[kv]_dtype_g\d+", name))
    dtypes = (v for name, v in trial.params.items() if re.fullmatch(r"[kv]_dtype_g\d+", name))
    counts = Counter(f"{side}_{dtype}_layers" for side, dtype in zip(sides, dtypes, strict=True))
    return {name: [str(n)] for name, n in counts.items()}


def close(shown: str, value: float) -> bool:
    """A number as a UI prints it (rounded, maybe with a k/M/G suffix) against the value."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    number = float(shown[:-1]) * scale[shown[-1]] if shown[-1] in scale else float(shown)
    return abs(number - value) <= 5e-3 * max(1.0, abs(value))


def check_mlflow(served: Served, browser: Chromium) -> None:
    experiment = served.tracking.get_experiment_by_name(STUDY)
    runs = served.tracking.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags["kvtune.kind"] == "invocation"]
    trial_runs = {
        int(r.data.tags["trial_number"]): r for r in runs if r.data.tags["kvtune.kind"] == "trial"
    }
    trials = served.study.get_trials()
    assert sorted(trial_runs) == [t.number for t in trials]
    experiment_url = f"{served.mlflow_url}/#/experiments/{experiment.experiment_id}"

    page = browser.visit(experiment_url, "mlflow_experiment_default_view.png")
    assert "its runs are in the Model training view" in page.text  # for a GenAI-first browser

    page = browser.visit(f"{experiment_url}?{ML_VIEW}", "mlflow_experiment_runs.png")
    assert f"kvtune study {STUDY} : KV-cache policies" in page.text  # the description
    assert "Run Name" in page.text and parent.info.run_name in page.text  # the runs table
    assert f"{len(trials) + 1} matching runs" in page.text  # trials nested under the parent
    assert "Traces 0" not in page.text and "No data available" not in page.text  # not GenAI

    ids = [trial_runs[t.number].info.run_id for t in trials]
    compare_url = (
        f"{served.mlflow_url}/#/compare-runs?runs={quote(json.dumps(ids))}"
        f"&experiments={quote(json.dumps([experiment.experiment_id]))}&{ML_VIEW}"
    )
    page = browser.visit(compare_url, "mlflow_compare_trials.png")
    assert f"Comparing {len(trials)} Runs" in page.text
    assert page.row("Run Name:") == [f"trial {t.number}" for t in trials]
    for field in POLICY_PARAMS:
        assert page.row(field) == [policy_row(t, field) for t in trials], field
    assert page.row("state") == [t.state.name for t in trials]
    assert all(name in page.words for name in OBJECTIVES)  # a virtual grid: names only

    for trial in trials:
        run_url = f"{experiment_url}/runs/{trial_runs[trial.number].info.run_id}?{ML_VIEW}"
        page = browser.visit(run_url, f"mlflow_trial_{trial.number}.png")
        assert f"Parent run {parent.info.run_name}" in page.text
        rows = {r[0]: r[1:] for r in page.rows if r}
        for field in POLICY_PARAMS:
            assert rows[field] == [policy_row(trial, field)], (trial.number, field)
        shown_counts = {k: v for k, v in rows.items() if re.fullmatch(r"[kv]_\w+_layers", k)}
        assert shown_counts == layer_counts(trial), trial.number
        for name, value in zip(OBJECTIVES, trial.values, strict=True):
            assert close(rows[name][0], value), (trial.number, name, rows[name], value)

    artifacts_url = (
        f"{experiment_url}/runs/{parent.info.run_id}/artifacts/pareto_front.png?{ML_VIEW}"
    )
    page = browser.visit(artifacts_url, "mlflow_parent_pareto_front.png")
    for name in ("pareto_front.png", "pareto_front.html", "trials.csv", "recipe.yaml", "front"):
        assert name in page.words, name
    assert any(
        i.get("alt") == "pareto_front.png" and (i.get("src") or "").startswith("blob:")
        for i in page.images
    ), "the Pareto front image was not loaded into the page"
    served_png = http_get(
        f"{served.mlflow_url}/get-artifact?path=pareto_front.png&run_uuid={parent.info.run_id}"
    )
    stored = Path(parent.info.artifact_uri.removeprefix("file://")) / "pareto_front.png"
    assert served_png[:8] == b"\x89PNG\r\n\x1a\n" and served_png == stored.read_bytes()


def check_optuna_dashboard(served: Served, browser: Chromium) -> None:
    study_page = f"{served.dashboard_url}/dashboard/studies/{served.dashboard_study_id}"
    page = browser.visit(study_page, "optuna_dashboard_study.png")
    assert f"{STUDY} (id=" in page.text
    assert f"Pareto Front Objective X: {OBJECTIVES[0]}" in page.text
    assert f"Objective Y: {OBJECTIVES[1]}" in page.text
    best = served.study.best_trials  # Optuna's own Pareto set, constraints included
    assert best
    # One card a Pareto trial ("Trial 3 Objective Values = [...]"), or "Best Trial (number=3)"
    listed = re.findall(
        r"Trial \(?(?:number=)?(\d+)\)? Objective Values = \[\s*([^\]]*?)\s*\]", page.text
    )
    assert sorted(int(n) for n, _ in listed) == sorted(t.number for t in best)
    for number, values in listed:
        trial = served.study.trials[int(number)]
        shown = [v.strip() for v in values.split(",")]
        assert all(close(s, v) for s, v in zip(shown, trial.values, strict=True)), number
    api_url = f"{served.dashboard_url}/api/studies/{served.dashboard_study_id}"
    api = json.loads(http_get(api_url))
    assert api["objective_names"] == list(OBJECTIVES)


def test_a_user_sees_the_study_in_both_dashboards(served, tmp_path, capsys):
    assert all(t.state == TrialState.COMPLETE for t in served.study.get_trials())
    if SHOTS.exists():
        shutil.rmtree(SHOTS)
    SHOTS.mkdir(parents=True)
    with capsys.disabled():
        print(f"\nscreenshots of the dashboards: {SHOTS}")
    browser = Chromium(tmp_path / "profiles", SHOTS)
    check_mlflow(served, browser)
    check_optuna_dashboard(served, browser)

    served.dashboard.send_signal(signal.SIGINT)  # Ctrl-C
    # A loaded 2-core machine took over 30 s to unwind the server; what counts is a clean exit.
    assert served.dashboard.wait(timeout=180) == 0
