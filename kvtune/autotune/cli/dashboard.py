"""`kvtune dashboard`: optuna-dashboard over a study's storage, on 127.0.0.1 until Ctrl-C.

The study is the one `kvtune tune` names for the same model and workload (study.name, default
${model.name}-${workload.name}), in its storage (study.storage, default
sqlite:///studies/<name>/optuna.db); a missing study is refused in one line that lists the
studies there (kvtune/autotune/cli/existing_study.py). The URL printed opens the study's page
(history, Pareto front with the objectives named, parameter importances). Requests are served
from threads, so a browser loading the page's assets in parallel is not queued behind one slow
API call.
"""

from __future__ import annotations

import logging
import signal
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from omegaconf import DictConfig
from optuna_dashboard import wsgi
from rich.console import Console

from kvtune.autotune.cli.existing_study import open_existing_study
from kvtune.autotune.study.optuna_study import StudySettings
from kvtune.autotune.study.recipe import plain
from kvtune.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
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


def dashboard_task(cfg: DictConfig) -> None:
    """`kvtune dashboard [study.name=...] [study.storage=...] [dashboard.port=N]`."""
    port = dashboard_port(cfg.dashboard.port)
    settings = StudySettings.from_dict({k: v for k, v in plain(cfg.study).items() if v is not None})
    storage = open_existing_study(settings, runs_trials=False)
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
