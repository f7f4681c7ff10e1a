"""Two fused CPU loops for ReLU's 1-bit mask, compiled from C at first use.

With stock ops, packing ``out != 0`` to bits takes three passes over the output (a
cast to bool, an in-place multiply, a strided copy) and applying the bits to a gradient
two (a table lookup into a float mask, then stock's threshold kernel). Here each
direction is one pass:

* ``relu_pack``: ``out = relu(x)`` exactly as ``torch.relu`` (``x < 0 ? 0 : x``: -0 and
  NaN pass through) and the bits of ``out != 0``, uint8 ``[ceil(n / 8)]`` with bit ``k``
  of byte ``j`` for element ``8j + k``, the layout of
  :func:`jacmem.memory.functions.pack_bits` (NaN counts as nonzero: stock's backward
  lets the gradient through where the output is NaN);
* ``select``: ``g`` where the bit is set, else +0 (even where ``g`` is infinite or
  NaN, as stock's threshold kernel).

**Building.** The C source is compiled once with the system's C compiler (``$CC``, else
``cc``) into ``$JACMEM_CACHE`` (default ``~/.cache/jacmem``) and loaded with ctypes: no
Python or torch headers, about a second. Never with ``-march=native``: the instruction set
is chosen from the features that the running CPU reports (``/proc/cpuinfo``'s flags), in
tiers, and only these are enabled:

* ``avx512``: ``-mavx2 -mfma -mavx512f -mavx512bw -mavx512vl`` where the CPU has all five;
* ``avx2``: ``-mavx2 -mfma`` where it has both;
* ``base``: the architecture's baseline (SSE2 on x86-64, NEON on arm64), elsewhere.

**The cache key** is a hash of the source, the compiler (its resolved path, its
``--version`` line and target triple), the flags, the architecture and the feature set the
flags need. The library's file name, ``relu_bits-<tier>-<key>-<digest>.so``, holds the
tier, the key and the first hex digits of the SHA-256 of its own bytes, and the library
embeds the key's full text. Before loading, jacmem checks that the digest matches the
bytes, that the embedded text is this key's, and that the running CPU has every feature
the key names. A file that fails any check is never handed to the dynamic loader: it is
removed and rebuilt. So a cache shared between hosts (a network home directory), or a VM
whose CPU flags are masked, gets one library per feature set and never runs an
instruction its CPU lacks; a truncated or corrupt file is rebuilt.

**Falling back.** Where there is no compiler, the build or the load fails, the tensor is
not a contiguous float32/float64 CPU tensor, or ``JACMEM_NO_KERNELS`` is set (to anything
but ``0`` or the empty string), :func:`available` is False and the callers use the stock
ops, which give the same output, bits and gradients, bit for bit. The loops run on one
thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = r"""
#include <stdint.h>

/* out = relu(x) as torch computes it (x < 0 ? 0 : x, so -0 and NaN pass), and bit k of
   byte j set where out[8j + k] != 0; out may be x itself */
#define RELU_PACK(NAME, T)                                                       \
void NAME(const T* x, T* out, uint8_t* bits, int64_t n) {                       \
    int64_t full = n / 8;                                                        \
    for (int64_t j = 0; j < full; j++) {                                         \
        uint8_t b = 0;                                                           \
        for (int k = 0; k < 8; k++) {                                            \
            T v = x[8 * j + k];                                                  \
            T r = v < 0 ? (T)0 : v;                                              \
            out[8 * j + k] = r;                                                  \
            b |= (uint8_t)((r != 0) << k);                                       \
        }                                                                        \
        bits[j] = b;                                                             \
    }                                                                            \
    if (n % 8) {                                                                 \
        uint8_t b = 0;                                                           \
        for (int64_t i = 8 * full; i < n; i++) {                                 \
            T r = x[i] < 0 ? (T)0 : x[i];                                        \
            out[i] = r;                                                          \
            b |= (uint8_t)((r != 0) << (i - 8 * full));                          \
        }                                                                        \
        bits[full] = b;                                                          \
    }                                                                            \
}

/* branch-free: the gradient's bits, ANDed with all ones or all zeros (an infinite or
   NaN gradient becomes +0 where the bit is clear, as stock's threshold kernel) */
#define SELECT(NAME, T, U)                                                       \
void NAME(const T* g, const uint8_t* bits, T* out, int64_t n) {                 \
    const U* gu = (const U*)g;                                                   \
    U* ou = (U*)out;                                                             \
    int64_t full = n / 8;                                                        \
    for (int64_t j = 0; j < full; j++) {                                         \
        U b = bits[j];                                                           \
        for (int k = 0; k < 8; k++)                                              \
            ou[8 * j + k] = gu[8 * j + k] & (U)(0 - ((b >> k) & 1));             \
    }                                                                            \
    for (int64_t i = 8 * full; i < n; i++)                                       \
        ou[i] = gu[i] & (U)(0 - (U)((bits[full] >> (i - 8 * full)) & 1));        \
}

RELU_PACK(relu_pack_f32, float)
RELU_PACK(relu_pack_f64, double)
SELECT(select_f32, float, uint32_t)
SELECT(select_f64, double, uint64_t)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_LIBRARY: ctypes.CDLL | None = None
_TRIED = False

# x86-64 instruction-set tiers, best first: (name, CPU flags needed, compiler flags)
_X86_TIERS = (
    (
        "avx512",
        frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
        ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"),
    ),
    ("avx2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
)
_BASE = ("-O3", "-fno-strict-aliasing", "-shared", "-fPIC")
_MARK = "jacmem-build:"


def disabled() -> bool:
    """Whether ``JACMEM_NO_KERNELS`` turns the loops off (any value but "" and "0")."""
    return os.environ.get("JACMEM_NO_KERNELS", "") not in ("", "0")


def cpu_features() -> frozenset[str]:
    """The features the running CPU reports: the ``flags`` (x86) or ``Features`` (arm)
    line of ``/proc/cpuinfo``; empty where there is none (other systems: baseline only)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def tiers(machine: str, features: frozenset[str]) -> list[tuple[str, frozenset[str], tuple[str, ...]]]:
    """The tiers this CPU can run, best first, each ``(name, features it needs, flags)``;
    always ending with ``base``."""
    found = []
    if machine.lower() in ("x86_64", "amd64"):
        found = [tier for tier in _X86_TIERS if tier[1] <= features]
    return [*found, ("base", frozenset(), ())]


@dataclass(frozen=True)
class Key:
    """What a build depends on. ``text`` is embedded in the library; ``digest`` names it."""

    tier: str
    compiler: tuple[str, ...]
    flags: tuple[str, ...]
    features: frozenset[str]
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    @property
    def pattern(self) -> str:
        return f"relu_bits-{self.tier}-{self.digest}-*.so"


def make_key(
    compiler: tuple[str, ...], identity: str, machine: str, tier: str, features: frozenset[str], flags: tuple[str, ...]
) -> Key:
    """The key of one build: the source, the compiler (command and ``identity``, its
    version and target), the flags, the architecture and the features the flags need."""
    source = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    text = (
        f"source={source};compiler={' '.join(compiler)};identity={identity};machine={machine};"
        f"tier={tier};features={','.join(sorted(features))};flags={' '.join(flags)}"
    )
    text = text.replace("\\", "/").replace('"', "'")  # a C string literal as it stands
    return Key(tier, compiler, flags, features, text)


def _compiler() -> tuple[tuple[str, ...], str] | None:
    """``$CC`` (or ``cc``) as a command, and its identity: resolved path, ``--version``
    line, target triple; None where there is none that answers."""
    words = shlex.split(os.environ.get("CC", "cc"))
    path = shutil.which(words[0]) if words else None
    if path is None:
        return None
    command = (path, *words[1:])
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
        target = subprocess.run([*command, "-dumpmachine"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if version.returncode != 0:
        return None
    first = (version.stdout.strip().splitlines() or [""])[0]
    return command, f"{os.path.realpath(path)}|{first}|{target.stdout.strip()}"


def cache_dir() -> Path:
    return Path(os.environ.get("JACMEM_CACHE", Path.home() / ".cache" / "jacmem"))


def verified(path: Path, key: Key, features: frozenset[str]) -> bool:
    """Whether ``path`` may be loaded for ``key`` on a CPU with ``features``: its name's
    digest is that of its bytes, it embeds the key's text, and the CPU has every feature
    the key needs. Reads the file; loads nothing."""
    if not key.features <= features:
        return False
    prefix = f"relu_bits-{key.tier}-{key.digest}-"
    if not (path.name.startswith(prefix) and path.name.endswith(".so")):
        return False
    try:
        data = path.read_bytes()
    except OSError:
        return False
    digest = path.name[len(prefix) : -len(".so")]
    return (
        hashlib.sha256(data).hexdigest()[: len(digest)] == digest
        and len(digest) == 12
        and ((_MARK + key.text).encode() + b"\0") in data
    )


def _compile(key: Key, cache: Path) -> Path | None:
    """Build the library for ``key`` into ``cache``, named by its own digest; None where
    the compiler fails."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # then one rename: safe for parallel builds
        src, lib = Path(tmp) / "relu_bits.c", Path(tmp) / "relu_bits.so"
        src.write_text(f'{_SOURCE}\nconst char jacmem_build_key[] = "{_MARK}{key.text}";\n')
        command = [*key.compiler, *_BASE, *key.flags, "-o", str(lib), str(src)]
        if subprocess.run(command, capture_output=True, timeout=120).returncode != 0:
            return None
        digest = hashlib.sha256(lib.read_bytes()).hexdigest()[:12]
        target = cache / f"relu_bits-{key.tier}-{key.digest}-{digest}.so"
        os.replace(lib, target)
        return target


def _find_or_build(key: Key, cache: Path, features: frozenset[str]) -> Path | None:
    """A verified library for ``key``: from the cache, else built. A cached file that fails
    the checks is removed, never loaded."""
    for path in sorted(cache.glob(key.pattern)):
        if verified(path, key, features):
            return path
        try:
            path.unlink()
        except OSError:
            pass
    path = _compile(key, cache)
    return path if path is not None and verified(path, key, features) else None


def _build() -> ctypes.CDLL | None:
    """Compile (or find the cached build of) the loops; None where that fails."""
    if disabled():
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    command, identity = compiler
    machine, features = platform.machine(), cpu_features()
    for tier, needs, flags in tiers(machine, features):  # the best tier the compiler can build
        key = make_key(command, identity, machine, tier, needs, flags)
        try:
            path = _find_or_build(key, cache_dir(), features)
            if path is None:
                continue
            library = ctypes.CDLL(str(path))
            for suffix in _SUFFIX.values():
                getattr(library, f"relu_pack_{suffix}").argtypes = (ctypes.c_void_p,) * 3 + (ctypes.c_int64,)
                getattr(library, f"select_{suffix}").argtypes = (ctypes.c_void_p,) * 3 + (ctypes.c_int64,)
        except (OSError, AttributeError, subprocess.SubprocessError):  # AttributeError: a symbol is missing
            continue
        return library
    return None


def _library() -> ctypes.CDLL | None:
    global _LIBRARY, _TRIED
    if not _TRIED:
        _LIBRARY, _TRIED = _build(), True
    return _LIBRARY


def available(t: Tensor) -> bool:
    """Whether the loops take ``t``: a contiguous float32/float64 CPU tensor, and a build."""
    return t.device.type == "cpu" and t.dtype in _SUFFIX and t.is_contiguous() and _library() is not None


def relu_pack(x: Tensor, out: Tensor) -> Tensor:
    """``out = relu(x)`` (``out`` may be ``x``), and the bits of ``out != 0``: uint8
    ``[ceil(numel / 8)]``; needs :func:`available` for both."""
    bits = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    getattr(_library(), f"relu_pack_{_SUFFIX[x.dtype]}")(x.data_ptr(), out.data_ptr(), bits.data_ptr(), x.numel())
    return bits


def select(g: Tensor, bits: Tensor) -> Tensor:
    """``g`` where the bit is set, else 0: ``g [*]``, uint8 bits -> ``[*]``; needs
    :func:`available` for ``g``."""
    out = torch.empty_like(g)
    getattr(_library(), f"select_{_SUFFIX[g.dtype]}")(g.data_ptr(), bits.data_ptr(), out.data_ptr(), g.numel())
    return out
