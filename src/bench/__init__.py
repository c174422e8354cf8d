"""The benchmarks behind `ringserve bench ipc | throughput | frontend | serve`.

One module per benchmark (`ipc`, `throughput`, `frontend`, `serve`), each with a `main(argv)`
that the CLI calls; `scripts/bench_*.py` are thin entry points over the same functions. Nothing
in the engine imports this package.
"""
