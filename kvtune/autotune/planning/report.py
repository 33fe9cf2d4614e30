"""Render a CapacityPlan for people (rich tables) or scripts (one JSON object)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from kvtune.autotune.planning.capacity import CapacityPlan, CapacityRow
from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES
from kvtune.runtime.arch import GIB

MIB = 1 << 20


def plan_json(plan: CapacityPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2)


def _policy_label(row: CapacityRow) -> str:
    p = row.policy
    pairs = p.layer_dtypes or (f"{p.k_dtype}/{p.v_dtype}",)
    quantized = any(d in QUANTIZED_DTYPES for pair in pairs for d in pair.split("/"))
    scales = f" g={p.group_size}/{p.scale_dtype}" if quantized else ""
    if scales:
        keys = [f"K g={p.k_group_size}"] if p.k_group_size is not None else []
        keys += [f"K per {p.k_scale_axis}"] if p.k_scale_axis != "token" else []
        keys += [p.rotation] if p.rotation != "none" else []
        scales += "".join(f" {part}" for part in keys)
    if p.boundary_layers:
        scales += f" first/last {p.boundary_layers} layers fp16"
    pooled = f"csa={p.csa_ratio}" if p.summarises else "csa without summaries"
    csa = f" {pooled} (sinks {p.csa_sinks}, window {p.csa_window})" if p.compressed else ""
    if p.selects:
        budgets = p.layer_csa_topk or (p.csa_topk,)
        top = f"{min(budgets)}-{max(budgets)} by layer" if len(set(budgets)) > 1 else p.csa_topk
        csa += f" top{top} from host" + (", streamed" if p.streams_staging else "")
        dtype = f"{p.csa_index_dtype} " if p.separate_index else ""
        csa += f" ({dtype}{p.csa_index} index)"
    if p.keeps:
        csa += f" keep {p.csa_keep:g}"
    layers = " per-layer" if p.layer_dtypes else ""
    recent = f" recent={p.recent_unquantized}" if p.recent_unquantized else ""
    return f"K {p.k_dtype} / V {p.v_dtype}{scales}{csa}{recent}{layers}"


def render_plan(plan: CapacityPlan, console: Console) -> None:
    """Summary, the comparison table and the advice."""
    d = plan.to_dict()
    summary = Table(title=f"KV capacity: {d['model']} on {d['device']}", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("policy", _policy_label(plan.chosen))
    summary.add_row("max_model_len (tokens)", f"{d['max_model_len']:,}")
    summary.add_row("kv_bytes_per_token", f"{d['kv_bytes_per_token']:,} B")
    summary.add_row("kv_bytes_per_sequence", f"{d['kv_bytes_per_sequence'] / MIB:,.1f} MiB")
    if d["host_kv_bytes_per_sequence"]:
        summary.add_row(
            "host_kv_bytes_per_sequence", f"{d['host_kv_bytes_per_sequence'] / MIB:,.1f} MiB"
        )
        summary.add_row(
            "fetched per decode step, at most", f"{d['max_fetch_bytes_per_step'] / MIB:,.2f} MiB"
        )
    summary.add_row("weights", f"{d['weights_bytes'] / GIB:,.2f} GiB")
    summary.add_row("kv_budget", f"{d['kv_budget_bytes'] / GIB:,.2f} GiB")
    summary.add_row("max_num_seqs", f"{d['max_num_seqs']:,}")
    summary.add_row("headroom", f"{d['headroom_bytes'] / MIB:,.1f} MiB")
    summary.add_row("decode step, predicted (roofline)", f"{d['predicted_decode_ms']:.3f} ms")
    if "max_num_seqs_at_expected_context" in d:
        summary.add_row(
            f"max_num_seqs at {plan.serve.expected_context_len} tokens",
            f"{d['max_num_seqs_at_expected_context']:,}",
        )
    console.print(summary)

    compare = Table(title="Standard alternatives (same model, device, context)")
    for column in ("alternative", "bytes/token", "MiB/sequence", "vs fp16", "max_num_seqs"):
        compare.add_column(column, justify="left" if column == "alternative" else "right")
    baseline = next((r for r in plan.compare if r.name == "fp16"), plan.chosen)
    for row in [plan.chosen, *plan.compare]:
        ratio = row.kv_bytes_per_sequence / baseline.kv_bytes_per_sequence
        name = f"chosen: {_policy_label(row)}" if row is plan.chosen else row.name
        compare.add_row(
            name,
            f"{row.kv_bytes_per_token:,}",
            f"{row.kv_bytes_per_sequence / MIB:,.1f}",
            f"{ratio:.3f}x",
            f"{row.max_num_seqs:,}",
        )
    console.print(compare)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
