"""The cost model ``auto`` chooses by: a strategy's estimated seconds on a device,
``flops / flop rate + workspace bytes / byte rate + overhead`` (:func:`estimated_seconds`),
with the rates of the device's :class:`DeviceProfile` (CUDA: derived from the compute
capability and the device's properties; other devices: the CPU's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from jacmem.derivatives import Cost

#: How many ``chunk_bytes`` the per-sample gradients one backward pass keeps may take
#: beyond the inputs and output gradients they replace (:func:`keep_budget`)
KEEP_CHUNKS = 8

#: FLOP/s of a batched matrix product and byte/s of a strided copy, on a 2-thread Xeon
#: (the benchmark machine): a matter of order, only their ratio steers ``auto``
FLOP_RATE = 5e10
BYTE_RATE = 5e9


@dataclass(frozen=True)
class DeviceProfile:
    """The rates the cost model divides by, for one device (see the module docstring).

    ``flop_rate``: FLOP/s in float32 and narrower; ``flop_rate_fp64``: FLOP/s in
    float64, ``None`` where it is ``flop_rate``; ``byte_rate``: byte/s through memory;
    ``overhead``: seconds per strategy call.
    """

    name: str
    flop_rate: float
    byte_rate: float
    flop_rate_fp64: float | None = None
    overhead: float = 0.0

    def flops_per_second(self, itemsize: int) -> float:
        """The FLOP rate for entries of ``itemsize`` bytes."""
        return self.flop_rate_fp64 if itemsize >= 8 and self.flop_rate_fp64 is not None else self.flop_rate


#: The calibrated constants, for every dtype: ``auto``'s CPU choices as they always were.
CPU_PROFILE = DeviceProfile("cpu", FLOP_RATE, BYTE_RATE)


@dataclass(frozen=True)
class CudaArch:
    """What the cost model needs of one compute capability: float32 and float64
    results per clock cycle per multiprocessor (CUDA C++ Programming Guide, "Throughput
    of Native Arithmetic Instructions"), and, for a torch that reports no clocks, a
    typical boost clock and memory bandwidth per multiprocessor of ``part`` (NVIDIA's
    datasheet for it)."""

    fp32_lanes: int
    fp64_lanes: int
    clock_hz: float
    bytes_per_second_per_sm: float
    part: str


#: (major, minor) -> :class:`CudaArch`. A capability not listed takes :data:`CUDA_ARCH_DEFAULT`.
CUDA_ARCHS: dict[tuple[int, int], CudaArch] = {
    (6, 0): CudaArch(64, 32, 1.48e9, 732e9 / 56, "P100 SXM2"),
    (6, 1): CudaArch(128, 4, 1.58e9, 484e9 / 28, "GTX 1080 Ti"),
    (7, 0): CudaArch(64, 32, 1.53e9, 900e9 / 80, "V100 SXM2"),
    (7, 5): CudaArch(64, 2, 1.59e9, 320e9 / 40, "T4"),
    (8, 0): CudaArch(64, 32, 1.41e9, 2039e9 / 108, "A100 80GB SXM"),
    (8, 6): CudaArch(128, 2, 1.70e9, 936e9 / 82, "RTX 3090"),
    (8, 9): CudaArch(128, 2, 2.52e9, 1008e9 / 128, "RTX 4090"),
    (9, 0): CudaArch(128, 64, 1.98e9, 3350e9 / 132, "H100 SXM"),
    (10, 0): CudaArch(128, 64, 1.97e9, 8000e9 / 148, "B200"),
    (12, 0): CudaArch(128, 2, 2.41e9, 1792e9 / 170, "RTX 5090"),
}
#: A capability not in :data:`CUDA_ARCHS`: a consumer part's lanes, clock and bandwidth.
CUDA_ARCH_DEFAULT = CudaArch(128, 2, 1.5e9, 10e9, "unknown")
#: Seconds per strategy call on CUDA: a few kernel launches of ~3 us each.
CUDA_OVERHEAD = 1e-5


def cuda_profile(props) -> DeviceProfile:
    """The profile of a CUDA device from its properties (``torch.cuda.get_device_properties``:
    ``name``, ``major``, ``minor``, ``multi_processor_count`` and, where this torch has
    them, ``clock_rate`` and ``memory_clock_rate`` in kHz and ``memory_bus_width`` in bits)."""
    arch = CUDA_ARCHS.get((props.major, props.minor), CUDA_ARCH_DEFAULT)
    sms = props.multi_processor_count
    clock = getattr(props, "clock_rate", 0) * 1e3 or arch.clock_hz
    memory_clock, bus_bits = getattr(props, "memory_clock_rate", 0) * 1e3, getattr(props, "memory_bus_width", 0)
    byte_rate = 2 * memory_clock * bus_bits / 8 if memory_clock and bus_bits else arch.bytes_per_second_per_sm * sms
    return DeviceProfile(
        f"cuda: {props.name} ({props.major}.{props.minor})",
        flop_rate=2 * sms * arch.fp32_lanes * clock,
        byte_rate=byte_rate,
        flop_rate_fp64=2 * sms * arch.fp64_lanes * clock,
        overhead=CUDA_OVERHEAD,
    )


def profile_for(device: torch.device | str | None) -> DeviceProfile:
    """The profile of ``device`` (``None``: the CPU), derived once per device.

    CUDA devices get :func:`cuda_profile`; the CPU, and device types without a profile
    of their own (``mps``, ``xpu``...), get :data:`CPU_PROFILE`."""
    if device is None:
        return CPU_PROFILE
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _profile(device)


@functools.cache
def _profile(device: torch.device) -> DeviceProfile:
    if device.type == "cuda":
        return cuda_profile(torch.cuda.get_device_properties(device))
    return CPU_PROFILE


def estimated_seconds(cost: Cost, itemsize: int, profile: DeviceProfile = CPU_PROFILE) -> float:
    """The cost model: one number to compare strategies by, on the device of ``profile``."""
    return (
        cost.flops / profile.flops_per_second(itemsize)
        + cost.workspace * itemsize / profile.byte_rate
        + profile.overhead
    )


def keep_budget(chunk_bytes: float) -> float:
    """Bytes that per-sample gradients kept through one backward pass may take beyond
    the inputs and output gradients that they let go (ClipGrad keeps them where they
    save a second product at the end of the pass): :data:`KEEP_CHUNKS` × ``chunk_bytes``,
    512 MiB at the block's default (a 2-layer GPT-2 at N=8 keeps all of its blocks'
    matrices in 360 MB)."""
    return KEEP_CHUNKS * chunk_bytes
