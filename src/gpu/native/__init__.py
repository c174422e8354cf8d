"""The C kernels of the CPU path, their headers, and the build-on-first-use loader.

`build` compiles a source set with the machine's compiler and caches the shared object;
`panel` loads the panel matmul library (float32 and int8 / int4 panels, the fused decode step,
the MoE experts, the paged decode attention); `ringserve.gpu.attention.cpu_native` builds the
standalone attention kernel from the same sources.
"""
