"""`kvtune dashboard`: optuna-dashboard over a study's storage, on 127.0.0.1 until Ctrl-C.

The storage follows the rule of `kvtune tune` (study.storage, default
sqlite:///studies/<name>/optuna.db); a missing study is refused in one line that lists the
studies the storage holds. The URL printed opens the study's page (history, Pareto front with
the objectives named, parameter importances). Requests are served from threads, so a browser
loading the page's assets in parallel is not queued behind one slow API call.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna
from omegaconf import DictConfig
from optuna_dashboard import wsgi
from rich.console import Console

from kvtune.autotune.study.optuna_study import StudySettings, open_storage
from kvtune.autotune.study.recipe import plain
from kvtune.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
STUDIES = Path("studies")  # where kvtune tune keeps each study's default SQLite database
MAX_PORT = 65535


class ThreadingServer(ThreadingMixIn, WSGIServer):
    """wsgiref's server, one thread a request; threads end with the process. Closing does not
    join them: a browser's idle pre-opened connection would keep Ctrl-C from ever exiting."""

    daemon_threads = True
    block_on_close = False


class QuietHandler(WSGIRequestHandler):
    """Request lines go to the debug log, not the terminal that shows the URL."""

    def log_message(self, format: str, *args: object) -> None:
        logger.debug(format, *args)


def dashboard_port(value: object) -> int:
    """The port to listen on; 0 lets the system choose a free one."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PORT:
        raise ConfigError(
            "dashboard.port", value, f"an integer from 0 (any free port) to {MAX_PORT}"
        )
    return value


def missing_study(name: str, where: str, names: list[str], note: str = "") -> ConfigError:
    """The one-line error for a study that is not there: the studies that are."""
    listed = ", ".join(names) or "none"
    return ConfigError("study.name", name, f"one of the studies in {where}: {listed}{note}")


def dashboard_task(cfg: DictConfig) -> None:
    """`kvtune dashboard study.name=... [study.storage=...] [dashboard.port=N]`."""
    study_cfg = plain(cfg.study)
    if study_cfg.get("name") in (None, "", "???"):
        raise ConfigError("study.name", None, "the name of a study started with kvtune tune")
    port = dashboard_port(cfg.dashboard.port)
    settings = StudySettings.from_dict({k: v for k, v in study_cfg.items() if v is not None})
    default_db = Path(settings.storage_url.removeprefix("sqlite:///"))
    if settings.storage is None and not default_db.is_file():
        found = sorted(p.parent.name for p in STUDIES.glob("*/optuna.db"))
        raise missing_study(settings.name, f"{STUDIES}/", found, "; elsewhere: give study.storage")
    storage = open_storage(settings, existing=True, runs_trials=False)
    names = optuna.get_all_study_names(storage)
    if settings.name not in names:
        raise missing_study(settings.name, settings.storage_url, names)
    study_id = storage.get_study_id_from_name(settings.name)
    try:
        server = make_server(HOST, port, wsgi(storage), ThreadingServer, QuietHandler)
    except OSError as error:
        raise ConfigError("dashboard.port", port, f"a free port ({error.strerror})") from None
    url = f"http://{HOST}:{server.server_port}/dashboard/studies/{study_id}"
    console = Console()
    console.print(f"optuna-dashboard for study {settings.name}: {url}", soft_wrap=True)
    console.print("Ctrl-C stops it.")
    console.file.flush()
    # A process started in the background by a shell without job control (`nohup ... &`, a
    # script) inherits SIGINT ignored, and Python then installs no Ctrl-C handler: restore it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("dashboard stopped")
    finally:
        server.server_close()
