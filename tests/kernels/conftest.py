"""Kernel tests on the test device (tests/conftest.py): under KVTUNE_TEST_DEVICE=cuda every
tensor a test makes is moved to the GPU, so the same tests check the compiled kernels there.

Tests build their data on the CPU as they always do (CPU generators: the same values as in CPU
runs); a torch-function mode then moves each CPU tensor that an operation takes or returns to
the GPU, and hands `.numpy()` a CPU copy. The mode sits around the tests only, so the engine
tests and benchmarks/kernels.py (no mode) still catch a wrapper that allocates on the wrong
device. The oracles stay fp32: SDPA's math backend, no TF32 in torch matmuls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tests.conftest import TEST_DEVICE

# Operations that must see CPU tensors (numpy views), and those that mean to return one.
_TO_HOST = {torch.Tensor.numpy, torch.Tensor.__array__}
_KEEP_HOST = {torch.Tensor.cpu}
_IN_PLACE_DUNDERS = {"__setitem__"} | {
    f"__i{op}__"
    for op in [
        "add",
        "sub",
        "mul",
        "matmul",
        "truediv",
        "floordiv",
        "mod",
        "pow",
        "and",
        "or",
        "xor",
        "lshift",
        "rshift",
    ]
}


def _draws_from_host_generator(kwargs: dict) -> bool:
    """A draw from a CPU generator (`torch.bernoulli(p, generator=...)`) runs on the CPU, as it
    does outside the tests; on the GPU it would fail or give other numbers."""
    generator = kwargs.get("generator")
    return isinstance(generator, torch.Generator) and generator.device.type == "cpu"


def _to_host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _in_place(func) -> bool:
    """`add_`, `fill_`, `__setitem__`, `__iadd__`...: their first argument is the result."""
    name = getattr(func, "__name__", "")
    if name.startswith("__"):
        return name in _IN_PLACE_DUNDERS
    return name.endswith("_")


class OnDevice(TorchFunctionMode):
    """Moves CPU tensors that operations take (except the target of an in-place one) and
    return onto `device`."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def _place(self, value):
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return value.to(self.device)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_HOST:
            return func(args[0].cpu(), *args[1:], **kwargs)
        if func in _KEEP_HOST:
            return func(*args, **kwargs)
        if _draws_from_host_generator(kwargs):
            drawn = func(*tree_map(_to_host, args), **tree_map(_to_host, kwargs))
            return tree_map(self._place, drawn)
        if _in_place(func) and args:
            args = (args[0], *tree_map(self._place, args[1:]))
        else:
            args = tree_map(self._place, args)
        kwargs = tree_map(self._place, kwargs)
        return tree_map(self._place, func(*args, **kwargs))


@pytest.fixture(autouse=True)
def on_test_device():
    if TEST_DEVICE == "cpu":
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with (
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
        OnDevice(TEST_DEVICE),
    ):
        yield


@pytest.fixture(params=["native", "torch"])
def cpu_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the CPU kernels of kvtune.kernels.native where they apply, then with
    the torch paths alone: each must give what the test's oracle gives."""
    if request.param == "torch":
        monkeypatch.setenv("KVTUNE_NATIVE", "0")
    return request.param
