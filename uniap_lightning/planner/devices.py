"""The device catalogue: datasheet facts of accelerators, for pricing clusters nobody here owns.

One YAML file per device in ``conf/device/<name>.yaml`` (shipped with the package):

=====================  ===================================================================================
field                  meaning
=====================  ===================================================================================
``name``               the catalogue key a cluster names (``device: h100_sxm``)
``memory_gib``         device memory (GiB as the vendor counts it: the cluster's default ``memory_gib``)
``hbm_gbps``           memory bandwidth, GB/s (1e9 bytes/s): what memory-bound kernels are priced with
``peak_tflops``        dense peak per matmul dtype: ``fp32`` (SIMT), ``tf32``, ``bf16``, ``fp16``, ``fp8``; a dtype
                       the device lacks is absent (``fp8`` is then never offered), or set to the rate the
                       device runs it at (bf16 on a V100 is fp32 arithmetic)
``sms``                streaming multiprocessors: a matmul's output tiles run in waves of this many
``host_link_gbps``     device <-> host memory, one direction, the datasheet's link rate (PCIe or NVLink-C2C);
                       activation offload is priced at :data:`HOST_LINK_EFFICIENCY` of it
``framework_reserve_gib``  what a process holds on the device besides its tensors and NCCL's buffers, whatever
                       the plan: the CUDA context (driver state and the kernels loaded lazily), the cuBLAS and
                       cuBLASLt workspaces, and an allowance for the caching allocator's cached free blocks and
                       rounding (see :data:`CUDA_CONTEXT_GIB`, :data:`CUBLAS_WORKSPACES_GIB`); NCCL's buffers
                       depend on the plan's communicators and are priced per layer
                       (:mod:`uniap_lightning.planner.cost.buffers`)
=====================  ===================================================================================

Torch-free: the planner reads it on a laptop. :mod:`uniap_lightning.profiling.roofline` prices operations with
these facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_yaml_limits, read_text

DEVICE_DIR = Path(__file__).resolve().parents[1] / "conf" / "device"
#: matmul dtypes a catalogue entry may give a peak for
MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: the share of the datasheet's dense peak a large matmul reaches (cuBLAS on square bf16 / tf32 / fp32 products of
#: a few thousand: 70-80% of peak on A100 and H100, NVIDIA's "Matrix Multiplication Background" user guide)
MATMUL_EFFICIENCY = 0.75
#: fused flash attention's share of the peak (FlashAttention-2 forward + backward: 50-70% on A100 / H100, Dao 2023)
ATTENTION_EFFICIENCY = 0.5
#: the share of the memory bandwidth a streaming kernel reaches (STREAM-like copies: 80-90%)
MEMORY_EFFICIENCY = 0.8
#: the share of the memory bandwidth torch's softmax (forward and backward) reaches over rows longer than 1024
#: elements (up to SOFTMAX_LATENCY_ROW): those run the block kernels (``cunn_SoftMaxForward``/``...Smem``,
#: ``cunn_SoftMaxBackward`` in ATen's SoftMax.cu: one row per thread block, a max, a sum and an epilogue separated
#: by block barriers), not the warp-per-row persistent kernel of rows up to 1024 (``dim_size <= 1024 &&
#: dim_size * itemsize <= 4096``), and are latency bound. Source: the GH200's per-operation profile in the Sailor
#: artifact (eth-easl/sailor, sailor/Planner/baselines/Aceso/profiler/GH-96/profiled-data-fp32/
#: OPT-350_mbs8_tp1_algo0.csv, Aceso's profiler): Megatron's scaled, masked fp32 softmax over 8 x 16 x 2048 rows
#: of 2048 takes 5.98 ms forward and 8.16 ms backward; less the scale and mask passes (8.6 GB each way at
#: MEMORY_EFFICIENCY: 2.7 ms), the softmax moves 4.3 GB forward at 1.30 TB/s and 6.4 GB backward at 1.18 TB/s,
#: 0.33 and 0.29 of the 4 TB/s. A kernel benchmark sees the same cliff: PyTorch's softmax at rows of 2048 takes
#: 10x the time of rows of 1024 (the warp kernel) for twice the bytes
SOFTMAX_LONG_ROW_EFFICIENCY = 0.3
#: the longest row the warp-per-row softmax kernel takes (ATen SoftMax.cu: dim_size <= 1024)
SOFTMAX_WARP_ROW = 1024
#: the longest row priced at SOFTMAX_LONG_ROW_EFFICIENCY: the block kernels' fixed phases per row are what binds at
#: rows of a few thousand (measured at 2048); longer rows amortize them over more elements per thread and are priced
#: at MEMORY_EFFICIENCY (no measurement here says otherwise)
SOFTMAX_LATENCY_ROW = 4096
#: the share of the host link's datasheet rate that pinned-memory copies (cudaMemcpyAsync) reach: PCIe 4.0 x16,
#: 32 GB/s per direction, measures ~25 GB/s (NVIDIA's bandwidthTest sample on A100 hosts); PCIe 5.0 x16, 64 GB/s,
#: ~50 GB/s on H100 SXM / H200 hosts; NVLink-C2C (450 GB/s per direction, GH200 datasheet) is priced alike
#: (a conservative ~360 GB/s)
HOST_LINK_EFFICIENCY = 0.8
#: the least time one eager operation takes: host dispatch + autograd + launch (PyTorch eager: ~10 us per op);
#: a cluster's ``kernel_floor_us`` replaces it
KERNEL_FLOOR_S = 10e-6
#: the CUDA context of a PyTorch process with lazy module loading (CUDA >= 11.7, torch's default, the driver's
#: from CUDA 12.2): 287 MB after one tensor op (pytorch/pytorch#86509, 667 MB with eager loading), "around 300-400
#: MB" (NVIDIA's ptrblck, pytorch/pytorch#107667 and #109888); Hopper's kernel images are larger, and a training
#: step loads the matmul, attention and NCCL kernels: half a GiB on the Hopper devices
CUDA_CONTEXT_GIB = 0.5
#: the cuBLAS and cuBLASLt workspaces torch allocates per handle and stream: 32 MiB each on Hopper (sm90: the size
#: the cuBLAS documentation recommends, cublasSetWorkspace; torch's CublasHandlePool.cpp default ":4096:8", and
#: pytorch/pytorch#120925 for cuBLASLt), 4 MiB + 1 MiB before (":4096:2:16:8" = 8.1 MiB); two streams (compute and
#: one side stream) on Hopper
CUBLAS_WORKSPACES_GIB = 4 * 32 / 1024
#: GPU memory of one NCCL communicator a rank has joined and used (its channels' buffers: NCCL_BUFFSIZE, 4 MiB per
#: channel and peer for the Simple protocol, plus the LL128 and LL buffers and the proxy's, for every channel; the
#: memory grows linearly with the channels, which NVLink GPUs run many of, NCCL maintainers in NVIDIA/nccl#864 and
#: #986): measured with torch on 4 NVLink A100s after one 4 MB all-reduce on each group, 688 MB for a group of 3-4
#: ranks (NVIDIA/nccl#964). NCCL 2.22's lazy connection (NCCL_RUNTIME_CONNECT) connects only the algorithms used,
#: Hopper's NVLink runs more channels: the A100 figure stands for both
NCCL_COMMUNICATOR_GIB = 688e6 / 2**30
#: a two-rank communicator (a pipeline hand-off's send/recv pair) against a larger group, in the same measurement:
#: 544 MB against 688 MB (NVIDIA/nccl#964: one peer per ring channel instead of two)
NCCL_PAIR_SHARE = 544 / 688
_FIELDS = {"name", "memory_gib", "hbm_gbps", "peak_tflops", "sms", "host_link_gbps", "framework_reserve_gib"}


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's datasheet facts (see the module docstring for the fields)."""

    name: str
    memory_gib: float
    hbm_gbps: float
    peak_tflops: tuple[tuple[str, float], ...]
    sms: int
    host_link_gbps: float
    framework_reserve_gib: float

    def peak(self, dtype: str) -> float | None:
        """Dense matmul peak in FLOP/s for ``dtype`` (None: the device has no such unit)."""
        for key, tflops in self.peak_tflops:
            if key == dtype:
                return tflops * 1e12
        return None

    def has(self, dtype: str) -> bool:
        return self.peak(dtype) is not None

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @classmethod
    def from_dict(cls, d: Any, where: str) -> DeviceSpec:
        if not isinstance(d, dict):
            raise UniAPError(f"{where} must hold a mapping of fields, got {type(d).__name__}")
        unknown, missing = sorted(set(d) - _FIELDS), sorted(_FIELDS - set(d))
        if unknown or missing:
            raise UniAPError(f"{where}: unknown field(s) {unknown}, missing field(s) {missing}; fields: "
                             f"{sorted(_FIELDS)}")
        peaks = d["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks or set(peaks) - set(MATMUL_DTYPES):
            raise UniAPError(f"{where}: peak_tflops must map some of {list(MATMUL_DTYPES)} to TFLOP/s, got {peaks!r}")
        for key in ("memory_gib", "hbm_gbps", "host_link_gbps", *[f"peak_tflops.{k}" for k in peaks]):
            value = peaks[key.split(".", 1)[1]] if key.startswith("peak_tflops.") else d[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value < 1e7:
                raise UniAPError(f"{where}: {key} must be a positive number, got {value!r}")
        reserve = d["framework_reserve_gib"]
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < d["memory_gib"]:
            raise UniAPError(f"{where}: framework_reserve_gib must be >= 0 and below memory_gib, got {reserve!r}")
        sms = d["sms"]
        if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= 10_000:
            raise UniAPError(f"{where}: sms must be a positive integer, got {sms!r}")
        if not isinstance(d["name"], str) or not d["name"]:
            raise UniAPError(f"{where}: name must be a non-empty string")
        return cls(name=d["name"], memory_gib=float(d["memory_gib"]), hbm_gbps=float(d["hbm_gbps"]),
                   peak_tflops=tuple((k, float(v)) for k, v in peaks.items()), sms=sms,
                   host_link_gbps=float(d["host_link_gbps"]), framework_reserve_gib=float(reserve))


def available_devices() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


@lru_cache(maxsize=64)
def lookup_device(name: str) -> DeviceSpec | None:
    """The catalogue entry ``name`` names (case and ``-``/``_`` ignored), or None when it names none (a free-text
    device name such as ``"H100-SXM5-80GB"`` of an older cluster file)."""
    if not isinstance(name, str) or not name.strip():
        return None
    key = _key(name)
    if key not in {_key(n) for n in available_devices()}:
        return None
    path = DEVICE_DIR / f"{key}.yaml"
    named = f"device file {str(path)!r}"
    text = read_text(path, "device file")
    check_yaml_limits(text, named)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UniAPError(f"{named} is not valid YAML: {' '.join(str(err).split())[:300]}") from err
    return DeviceSpec.from_dict(data, named)


def device_or_error(name: str) -> DeviceSpec:
    spec = lookup_device(name)
    if spec is None:
        raise UniAPError(f"unknown device {name!r}; the catalogue has: {', '.join(available_devices())}")
    return spec


#: the catalogue entry of a CUDA device by what ``torch.cuda.get_device_name`` says (the first rule that matches,
#: case ignored): only where the name says which part it is. Today only float8 matmuls read it (a local cluster
#: names its device by it, so ``fp8="auto"`` finds the device's fp8 peak on the machine it runs on)
CUDA_NAMES: tuple[tuple[tuple[str, ...], str], ...] = ((("gh200",), "gh200"), (("h200",), "h200"),
                                                       (("h100", "hbm3"), "h100_sxm"), (("h100", "sxm"), "h100_sxm"))


def catalogue_name(cuda_name: str) -> str | None:
    """The catalogue entry ``cuda_name`` (``"NVIDIA H100 80GB HBM3"``) is, or None (a part the catalogue lacks, or a
    name that does not say: an H100 PCIe has other peaks)."""
    key = cuda_name.lower()
    for words, name in CUDA_NAMES:
        if all(w in key for w in words):
            return name
    return None
