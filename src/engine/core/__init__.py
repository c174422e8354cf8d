"""The engine-core process: `EngineCore` (one step), its process with the busy loop and socket
threads, the fault sentinel, pause / sleep, the weight-sync side of RL, and the lockstep waves of
data + expert parallelism. Reached from frontends through `ringserve.engine.wire`; drives its
workers through `ringserve.gpu.executor`.
"""
