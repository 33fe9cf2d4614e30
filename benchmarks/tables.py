"""One way to print a benchmark's table: Markdown (for RESULTS.md) or a terminal table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_rows(
    headers: list[str], lines: list[list[str]], markdown: bool, console: Console
) -> None:
    if markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for line in lines:
            print("| " + " | ".join(line) + " |")
        return
    table = Table(*headers)
    for line in lines:
        table.add_row(*line)
    console.print(table)
