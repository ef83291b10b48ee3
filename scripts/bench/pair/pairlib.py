"""The pair workload shared by scripts/bench/pair/kvlease_pair.py and
scripts/bench/nixl/nixl_pair.py --pair (scripts/bench/pair.sh runs both).

Two processes on one host: P holds a buffer filled with a seeded pattern, D READs from it
64 x 64 KiB, 64 x 1 MiB and 256 x 4 MiB (1 GiB) into its own buffer at the same offsets,
verifies the bytes, then times the READ for about `seconds`. The buffers are host memory
allocated by numpy or torch (plain heap, not memfd: what a serving engine's CPU cache or a
tensor registered from Python is) or torch CUDA tensors.
"""
from __future__ import annotations

import time

import numpy as np

# (blocks, block bytes, name)
WORKLOADS = [(64, 64 << 10, "64k_x64"), (64, 1 << 20, "1m_x64"), (256, 4 << 20, "4m_x256")]
# The pattern repeats every PERIOD bytes, a prime: a block landing at the wrong offset
# does not match.
PERIOD = 1_000_003


def workloads(scale: int = 1):
    return [(n, size // scale, name) for n, size, name in WORKLOADS]


def total_bytes(scale: int = 1) -> int:
    return max(n * size for n, size, _ in workloads(scale))


def host_pattern(n: int) -> np.ndarray:
    block = np.random.default_rng(1234).integers(0, 256, PERIOD, dtype=np.uint8)
    return np.resize(block, n)


class Buffers:
    """Allocates and checks buffers of one memory kind (`host`/`cuda`) with one allocator
    (`numpy`/`torch`; `cuda` is always torch)."""

    def __init__(self, memory: str, alloc: str):
        if memory not in ("host", "cuda"):
            raise ValueError(f"memory {memory!r}: host or cuda")
        if memory == "cuda":
            alloc = "torch"
        self.memory, self.alloc = memory, alloc
        self.torch = None
        if alloc == "torch":
            import torch

            self.torch = torch
            if memory == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("torch.cuda is not available")
        elif alloc != "numpy":
            raise ValueError(f"alloc {alloc!r}: numpy or torch")

    def pattern(self, n: int):
        host = host_pattern(n)
        if self.torch is None:
            return host
        t = self.torch.from_numpy(host)
        return t.to("cuda") if self.memory == "cuda" else t

    def zeros(self, n: int):
        if self.torch is None:
            return np.zeros(n, dtype=np.uint8)
        dev = "cuda" if self.memory == "cuda" else "cpu"
        return self.torch.zeros(n, dtype=self.torch.uint8, device=dev)

    def ptr(self, buf) -> int:
        return buf.ctypes.data if self.torch is None else buf.data_ptr()

    def zero(self, buf, n: int) -> None:
        if self.torch is None:
            buf[:n] = 0
        else:
            buf[:n].zero_()
        self.sync()

    def equal(self, a, b, n: int) -> bool:
        if self.torch is None:
            return bool(np.array_equal(a[:n], b[:n]))
        return bool(self.torch.equal(a[:n], b[:n]))

    def copy(self, dst, src, lo: int, hi: int) -> None:
        """dst[lo:hi] = src[lo:hi]; host tensors through their numpy views (a memcpy:
        torch's CPU copy_ of a slice pays for its thread pool on a loaded 2-core host)."""
        if self.torch is None:
            dst[lo:hi] = src[lo:hi]
        elif self.memory == "host":
            dst.numpy()[lo:hi] = src.numpy()[lo:hi]
        else:
            dst[lo:hi].copy_(src[lo:hi], non_blocking=True)

    def sync(self) -> None:
        if self.memory == "cuda":
            self.torch.cuda.synchronize()


def timed(fn, seconds: float, sync=lambda: None) -> float:
    """Runs `fn` once (warm-up), then for `seconds` (at least 3 times); seconds per call."""
    fn()
    sync()
    t0 = time.perf_counter()
    iters = 0
    while time.perf_counter() - t0 < seconds or iters < 3:
        fn()
        iters += 1
    sync()
    return (time.perf_counter() - t0) / iters


def gbps(nbytes: int, per_call: float) -> str:
    return f"{nbytes / per_call / 1e9:.3f}"
