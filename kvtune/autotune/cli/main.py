"""The `kvtune` console script: `kvtune <command> [hydra overrides]`.

Each command is a Hydra app over conf/<command>.yaml, so overrides, `--cfg job` and `-m`
multirun work the same everywhere. A ConfigError becomes one line on stderr and exit code 2:
users see the field to fix, not a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console

from kvtune.autotune.cli.dashboard import dashboard_task
from kvtune.autotune.cli.evaluate import evaluate_task
from kvtune.autotune.cli.export import export_task, quote_pick
from kvtune.autotune.cli.presets import check_presets
from kvtune.autotune.cli.tune import tune_task
from kvtune.autotune.cli.worker import worker_task
from kvtune.autotune.config.settings import (
    build_device,
    build_model_arch,
    build_policy,
    build_serve,
)
from kvtune.autotune.planning.capacity import build_plan
from kvtune.autotune.planning.report import plan_json, render_plan
from kvtune.runtime.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
OUTPUT_FORMATS = ("table", "json")
USAGE = """usage: kvtune <command> [key=value ...] [-m]

commands:
  plan      KV-cache capacity of a model on a device under a policy
  tune      search KV policies: an Optuna study tracked in MLflow (-m workload=chat,longdoc sweeps)
  worker    join a running study from another process or machine (study.name, study.storage)
  export    deployable configs of one trial: pick=knee|max_accuracy|min_memory|trial=<n>
  evaluate  accuracy of a policy against the uncompressed baseline: eval=quick|full
  dashboard optuna-dashboard of a study on 127.0.0.1 (study.name, dashboard.port) until Ctrl-C

Overrides are Hydra's: for example
  kvtune plan model=llama-3.1-8b device=h100-80gb policy.k_dtype=fp8 serve.max_model_len=32768
  kvtune plan --cfg job      (show the composed config)
"""


def hydra_command(name: str, task: Callable[[DictConfig], None]) -> Callable[[], None]:
    """Wrap `task` as a Hydra app over conf/<name>.yaml that reports ConfigError in one line."""

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=name)
    def app(cfg: DictConfig) -> None:
        try:
            task(cfg)
        except ConfigError as error:
            print(f"kvtune {name}: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    return app


def plan_task(cfg: DictConfig) -> None:
    """`kvtune plan`: print the capacity plan as a table or JSON."""
    if cfg.format not in OUTPUT_FORMATS:
        raise ConfigError("format", cfg.format, f"one of {', '.join(OUTPUT_FORMATS)}")
    command_line = HydraConfig.get().overrides.task
    arch = build_model_arch(cfg.model, command_line)
    policy, serve = build_policy(cfg.policy), build_serve(cfg.serve)
    policy.check_context(serve.max_model_len, "serve.max_model_len")
    plan = build_plan(arch, policy, build_device(cfg.device), serve)
    if cfg.format == "json":
        print(plan_json(plan))
    else:
        render_plan(plan, Console())


COMMANDS: dict[str, Callable[[DictConfig], None]] = {
    "plan": plan_task,
    "tune": tune_task,
    "worker": worker_task,
    "export": export_task,
    "evaluate": evaluate_task,
    "dashboard": dashboard_task,
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `kvtune <command> ...` to that command's Hydra app."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, overrides = args[0], args[1:]
    if command not in COMMANDS:
        print(
            f"kvtune: error: unknown command {command!r}; known: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    try:
        check_presets(CONF_DIR, overrides)
    except ConfigError as error:
        print(f"kvtune {command}: error: {error}", file=sys.stderr)
        return 2
    if command == "export":
        overrides = quote_pick(overrides)
    sys.argv = [f"kvtune-{command}", *overrides]
    hydra_command(command, COMMANDS[command])()
    return 0
