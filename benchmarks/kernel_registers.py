"""Registers and spills of the decode scoring kernel compiled for a GPU, without one.

    python -m benchmarks.kernel_registers [--arch 90]

Triton compiles ahead of time for a target it is not running on, and ptxas (shipped with
Triton) reports each function's registers a thread and spilled bytes. A tile that spills, or
holds so many registers that few warps fit an SM, is visible here before a device is lent.
Compiles `kvtune.kernels.selection.decode_scores`'s kernel as its launcher would for a SmolLM2-like
(9 / 3 heads of 64) and a Llama-3-8B-like (32 / 8 heads of 128) layer, for the int4 index,
both rules, at the launcher's tile and at 64 vectors a tile.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from rich.console import Console
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.tables import print_rows
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import format_switches
from kvtune.kernels.selection.decode_scores import _index_products_kernel, tile_vectors
from kvtune.runtime.kv_bytes import index_format

# Pointer types of the kernel's arguments for an index in a quantized format with fp16 scales
# (codes and scales of a plain fp16 index are fp16); unlisted arguments are int32.
POINTERS = {
    "q_ptr": "*fp32",
    "k_codes_ptr": "*u8",
    "k_scales_ptr": "*fp16",
    "k_tensor_scale_ptr": "*fp32",
    "v_codes_ptr": "*u8",
    "v_scales_ptr": "*fp16",
    "v_tensor_scale_ptr": "*fp32",
    "block_table_ptr": "*i32",
    "lengths_ptr": "*i32",
    "out_ptr": "*fp32",
}
# (query heads, KV heads, head_dim)
LAYERS = [(9, 3, 64), (32, 8, 128)]


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers a thread, spill store bytes) of the PTX's one function."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name=sm_{arch}a", str(source), "-o", f"{folder}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def compile_index_kernel(
    layer: tuple[int, int, int], fmt: KVFormat, bounds: bool, block_l: int, arch: int = 90
) -> Any:
    """The scoring kernel compiled for sm_{arch} (no GPU needed) for a layer of (query heads,
    KV heads, head_dim) and an index in `fmt`, as its launcher would build it."""
    q_heads, kv_heads, head_dim = layer
    constants = {
        "NUM_Q_HEADS": q_heads,
        "NUM_KV_HEADS": kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": 16,
        "BOUNDS": bounds,
        **format_switches(fmt, "K_"),
        **format_switches(fmt, "V_"),
        "BLOCK_L": block_l,
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }
    pointers = POINTERS
    if not fmt.quantized:
        pointers = {**POINTERS, "k_codes_ptr": "*fp16", "v_codes_ptr": "*fp16"}
    kernel = _index_products_kernel
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names}
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for layer in LAYERS:
        for rule, bounds in (("bounds", True), ("means", False)):
            for block_l in dict.fromkeys((tile_vectors(layer[2]), 64)):
                kernel = compile_index_kernel(
                    layer, index_format("int4"), bounds, block_l, args.arch
                )
                registers, spills = ptxas_report(kernel.asm["ptx"], args.arch)
                heads = f"{layer[0]} / {layer[1]} x {layer[2]}"
                rows.append([heads, rule, str(block_l), str(registers), str(spills)])
    headers = ["query / KV heads x head_dim", "rule", "vectors a tile", "registers", "spill bytes"]
    print_rows(headers, rows, args.markdown, Console())
    print(f"int4 index, 4 warps, sm_{args.arch}a, Triton {triton.__version__}")


if __name__ == "__main__":
    main()
