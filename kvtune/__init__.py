"""kvtune: KV-cache policy tuning on a real runtime.

Three layers, dependencies flowing one way: `kvtune.autotune` -> `kvtune.runtime` ->
`kvtune.kernels`. They live under one package so that their import names cannot collide with
other distributions (Hugging Face's `kernels`, which transformers >= 5.25 requires, installs a
top-level `kernels`).
"""
