"""The dtypes a policy's K and V streams can name, and what tables, searches and exports read of
each: auto (the model's own compute dtype, the exact reference path) and every registered element
format a policy may choose (`kvtune.kernels.formats.element_formats`).

Everything here is derived from the registry, so a new format reaches validation, the search
space, trial tables, the planner and the exporter without an edit here or there.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS, FormatInfo
from kvtune.kernels.formats.kv_format import ELEMENT_BITS, QUANTIZED_DTYPES
from kvtune.runtime.dtypes import AUTO_DTYPE

# The policy's alias for the model's compute dtype: exact, whatever that dtype is.
AUTO = AUTO_DTYPE
KV_DTYPE_INFO: dict[str, FormatInfo] = {
    AUTO: FormatInfo(table_code="a", description="the model's own dtype (exact)"),
    **{name: element for name, element in ELEMENT_FORMATS.items() if element.cache_choice},
}
KV_DTYPES: tuple[str, ...] = tuple(KV_DTYPE_INFO)
# Stored exactly (no codes, no scales): auto and the unquantized formats.
EXACT_DTYPES: tuple[str, ...] = tuple(d for d in KV_DTYPES if d not in QUANTIZED_DTYPES)


def most_precise_first(dtypes: Iterable[str]) -> list[str]:
    """dtypes from the most precise: auto (the model's own dtype), then by bits, wider first;
    at equal bits in registry order."""
    return sorted(dtypes, key=lambda d: (d != AUTO, -ELEMENT_BITS.get(d, 0), KV_DTYPES.index(d)))


def nearest_engine_dtype(dtype: str) -> str:
    """The policy dtype of the least precise engine cache that keeps at least this dtype's
    precision: auto for an exact dtype, else its registered engine storage class."""
    return KV_DTYPE_INFO[dtype].nearest_engine or AUTO
