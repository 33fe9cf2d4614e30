"""canonical(): the policy that stands for every policy storing and computing the same cache.

It lives beside the policy because what it knows is what the runtime reads: which fields mean
nothing given the others (scales without a quantized stream, the CSA window without
compression, the selection index without selection, ...). The tuner keys trials and its cache
by canonical policies, so that equal caches are measured once.
"""

from __future__ import annotations

from typing import Any

from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES
from kvtune.runtime.policy.schema import KVPolicy
from kvtune.runtime.policy.vocabulary import INDEX_IN_LAYER_FORMAT, NO_ROTATION, PER_TENSOR

_DEFAULTS = KVPolicy()


def canonical(policy: KVPolicy) -> KVPolicy:
    """One representative of policies that store and compute the same cache.

    Scale settings, the rotation and the unquantized recent window mean nothing without a
    quantized stream (the group size becomes "tensor", the one value every head_dim accepts),
    the key scale axis nothing without a quantized key stream, the CSA window, sinks, summary
    pooling and selection nothing without compression (the selection index nothing without
    selection, the pooling ratio nothing without summaries), and per-layer pairs, or per-layer
    selection budgets, that are all equal are the plain fields.
    """
    pairs = policy.layer_dtypes or (f"{policy.k_dtype}/{policy.v_dtype}",)
    changes: dict[str, Any] = {}
    if len(set(pairs)) == 1:
        k, v = pairs[0].split("/")
        changes.update(k_dtype=k, v_dtype=v, layer_dtypes=None)
    else:
        changes.update(k_dtype=_DEFAULTS.k_dtype, v_dtype=_DEFAULTS.v_dtype)
    if not any(d in QUANTIZED_DTYPES for pair in pairs for d in pair.split("/")):
        changes.update(
            group_size=PER_TENSOR,
            scale_dtype=_DEFAULTS.scale_dtype,
            recent_unquantized=_DEFAULTS.recent_unquantized,
            rotation=NO_ROTATION,
        )
    keys_quantized = any(pair.split("/")[0] in QUANTIZED_DTYPES for pair in pairs)
    values_quantized = any(pair.split("/")[1] in QUANTIZED_DTYPES for pair in pairs)
    if not keys_quantized:
        changes.update(k_scale_axis=_DEFAULTS.k_scale_axis)
    elif policy.k_scale_axis == "channel" and not values_quantized:
        changes.update(group_size=PER_TENSOR)  # channel keys ignore it, no value uses it
    if policy.layer_csa_topk is not None and len(set(policy.layer_csa_topk)) == 1:
        changes.update(layer_csa_topk=None)
    if policy.layer_csa_select_every is not None and len(set(policy.layer_csa_select_every)) == 1:
        changes.update(layer_csa_select_every=None)
    if not policy.compressed:
        changes.update(
            csa_window=_DEFAULTS.csa_window,
            csa_sinks=_DEFAULTS.csa_sinks,
            csa_summary=_DEFAULTS.csa_summary,
            csa_topk=0,
            layer_csa_topk=None,
            csa_host=False,
            csa_keep=0.0,
        )
    if not policy.selects:
        changes.update(
            csa_index=_DEFAULTS.csa_index,
            csa_staging=_DEFAULTS.csa_staging,
            csa_select_every=1,
            layer_csa_select_every=None,
            csa_rescore=1,
        )
    if not policy.pooled_index:
        changes.update(csa_index_dtype=INDEX_IN_LAYER_FORMAT)
    if policy.compressed and not policy.summarises:
        changes.update(csa_ratio=2)  # nothing is pooled: every ratio is the same policy
    return policy.replace(**changes)
