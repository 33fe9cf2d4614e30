"""C kernels for the torch backend on a CPU, built on first use with the machine's C compiler.

A decode step on a CPU is bound by calls and passes over its data, not by bytes: a kernel that
does in one pass what torch does in several is the CPU twin of a fused Triton kernel. Each
kernel has a torch path beside it that gives the same bits; without a compiler, or with
KVTUNE_NATIVE=0, the torch path runs.
"""
