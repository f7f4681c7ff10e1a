"""The compiled ReLU loops (jacmem.memory.kernels): the cache key, the checks before a
cached library is loaded, and the fallback to stock ops. Builds go to a temporary cache;
the process-wide library that the other tests use is left alone."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from jacmem.memory import kernels
from jacmem.memory.functions import ReLUFunction

AVX2 = frozenset({"avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


def _key(**change):
    args = dict(
        compiler=("/usr/bin/cc",),
        identity="/usr/bin/gcc-12|cc (Debian 12.2.0) 12.2.0|x86_64-linux-gnu",
        machine="x86_64",
        tier="avx2",
        features=AVX2,
        flags=("-mavx2", "-mfma"),
    )
    return kernels.make_key(**{**args, **change})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache, and kernels turned on whatever the environment says."""
    monkeypatch.setenv("JACMEM_CACHE", str(tmp_path))
    monkeypatch.delenv("JACMEM_NO_KERNELS", raising=False)
    return tmp_path


@pytest.fixture
def compiler():
    found = kernels._compiler()
    if found is None:
        pytest.skip("no C compiler here: only the fallback can be tested")
    return found


def _loads(monkeypatch):
    """Record every path handed to the dynamic loader."""
    paths = []
    real = ctypes.CDLL

    def spy(name, *args, **kwargs):
        paths.append(Path(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(kernels.ctypes, "CDLL", spy)
    return paths


def _replace(path, data):
    """Put ``data`` at ``path`` as a new file: the loaded library's pages stay as they were
    (writing into a mapped library in place would corrupt the running process instead)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _sound(path):
    """The file's bytes hash to the digest in its name."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] == path.stem.rsplit("-", 1)[1]


# -- the key ---------------------------------------------------------------------------


def test_key_changes_with_compiler_flags_features_and_machine():
    base = _key()
    assert _key().digest == base.digest  # deterministic
    variants = [
        _key(compiler=("/usr/bin/clang",)),
        _key(identity="/usr/bin/gcc-13|cc (Debian 13.1.0) 13.1.0|x86_64-linux-gnu"),
        _key(identity="/usr/bin/gcc-12|cc (Debian 12.2.0) 12.2.0|aarch64-linux-gnu"),
        _key(flags=("-mavx2",)),
        _key(flags=()),
        _key(features=frozenset({"avx2"})),
        _key(features=AVX512),
        _key(tier="avx512"),
        _key(machine="aarch64"),
    ]
    digests = {k.digest for k in variants}
    assert base.digest not in digests and len(digests) == len(variants)
    assert base.pattern == f"relu_bits-avx2-{base.digest}-*.so"


def test_tiers_follow_the_cpu_flags_and_never_native():
    names = lambda machine, features: [t[0] for t in kernels.tiers(machine, frozenset(features))]
    assert names("x86_64", AVX512 | {"sse4_2"}) == ["avx512", "avx2", "base"]
    assert names("x86_64", AVX2) == ["avx2", "base"]
    assert names("x86_64", {"avx2"}) == ["base"]  # no fma: a VM that masks it gets the baseline
    assert names("x86_64", set()) == ["base"]
    assert names("aarch64", {"asimd", "avx2", "fma"}) == ["base"]
    for _, needs, flags in kernels.tiers("x86_64", AVX512):
        assert "-march=native" not in flags and "-march=native" not in kernels._BASE
        for flag in flags:  # every -m flag names a feature the tier checks for
            assert flag[2:].replace("-", "") in needs


def test_cpu_features_read_proc_cpuinfo():
    features = kernels.cpu_features()
    assert isinstance(features, frozenset)
    if Path("/proc/cpuinfo").exists() and os.uname().machine == "x86_64":
        assert "sse2" in features


def test_switch_off(monkeypatch):
    for value, off in [("1", True), ("yes", True), ("0", False), ("", False)]:
        monkeypatch.setenv("JACMEM_NO_KERNELS", value)
        assert kernels.disabled() is off
    monkeypatch.setenv("JACMEM_NO_KERNELS", "1")
    assert kernels._build() is None


# -- the checks before loading -------------------------------------------------------------


def test_build_is_cached_and_named_by_key_and_digest(cache, compiler, monkeypatch):
    first = kernels._build()
    assert first is not None
    (path,) = cache.glob("relu_bits-*.so")
    tier = path.name.split("-")[1]  # the best tier this CPU runs and this compiler builds
    assert tier in [name for name, _, _ in kernels.tiers(os.uname().machine, kernels.cpu_features())]
    loads = _loads(monkeypatch)
    mtime = path.stat().st_mtime_ns
    assert kernels._build() is not None
    assert loads == [path] and path.stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt


@pytest.mark.slow
def test_corrupt_cached_library_is_not_loaded(cache, compiler, monkeypatch):
    assert kernels._build() is not None
    (path,) = cache.glob("relu_bits-*.so")
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    _replace(path, bytes(bad))
    loads = _loads(monkeypatch)
    assert kernels._build() is not None
    assert len(loads) == 1 and _sound(loads[0]) and loads[0].read_bytes() != bytes(bad)  # rebuilt
    _replace(loads[0], good[:100])  # truncated
    loads.clear()
    assert kernels._build() is not None
    assert len(loads) == 1 and _sound(loads[0]) and len(loads[0].read_bytes()) > 100


def test_library_for_other_cpu_features_is_not_loaded(cache, compiler, monkeypatch):
    """A cache shared with a host of other features: this host builds its own, and a file
    built for other features is refused even under this host's expected name."""
    command, identity = compiler
    machine = os.uname().machine
    if machine != "x86_64":
        pytest.skip("the tiers are x86-64's")
    wide = kernels.make_key(command, identity, machine, "avx2", AVX2, ("-mavx2", "-mfma"))
    built = kernels._compile(wide, cache)  # as a host with AVX2 would (compiling runs nothing)
    assert built is not None and kernels.verified(built, wide, AVX2)
    assert not kernels.verified(built, wide, frozenset({"avx2"}))  # a CPU without fma may not load it

    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"sse2"}))  # a VM with AVX masked
    narrow = kernels.make_key(command, identity, machine, "base", frozenset(), ())
    data = built.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    impostor = cache / f"relu_bits-base-{narrow.digest}-{digest}.so"  # right digest, wrong key inside
    shutil.copyfile(built, impostor)
    assert not kernels.verified(impostor, narrow, frozenset({"sse2"}))

    loads = _loads(monkeypatch)
    assert kernels._build() is not None
    assert len(loads) == 1 and loads[0].name.startswith(f"relu_bits-base-{narrow.digest}-")
    assert b"tier=base;" in loads[0].read_bytes() and loads[0] != impostor
    assert not impostor.exists() and built.exists()  # the impostor removed; the other host's build kept


def test_failed_build_falls_back(cache, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    assert kernels._build() is None
    monkeypatch.setenv("CC", "/no/such/compiler")
    assert kernels._build() is None
    assert not list(cache.glob("relu_bits-*.so"))


# -- the fallback's results ----------------------------------------------------------------


def _relu(x, g):
    leaf = x.clone().requires_grad_()
    out = ReLUFunction.apply(leaf * 1, False)
    (grad,) = torch.autograd.grad(out, leaf, g)
    return out.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fallback_gives_the_same_bits(dtype, monkeypatch):
    """Without the library (no compiler, a failed build or load, or the switch), a lean
    ReLU gives stock's output and gradient bit for bit, at -0, NaN and infinite gradients;
    with it, the same."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1001, generator=gen, dtype=dtype)
    x[::3], x[1::7], x[2::11] = -0.0, float("nan"), 0.0
    g = torch.randn(1001, generator=gen, dtype=dtype)
    g[::5] = float("inf")
    leaf = x.clone().requires_grad_()
    stock = torch.relu(leaf * 1)
    expected = (stock.detach(), torch.autograd.grad(stock, leaf, g)[0])

    with_library = _relu(x, g)
    monkeypatch.setattr(kernels, "_LIBRARY", None)
    monkeypatch.setattr(kernels, "_TRIED", True)  # as after a failed build
    assert not kernels.available(x)
    fallback = _relu(x, g)
    for a, b, c in zip(with_library, fallback, expected, strict=True):
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(b.view(torch.uint8), c.view(torch.uint8))
