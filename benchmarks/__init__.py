"""jacmem beside BackPACK, Opacus, torch.func and a plain backward: ``python -m benchmarks``.

Each (model, method) runs in its own process (:mod:`benchmarks.child`, started by
:mod:`benchmarks.harness`); the results go
to ``BENCHMARKS.md`` and ``benchmarks/results.png`` (:mod:`benchmarks.report`).
See ``python -m benchmarks --help``.
"""
