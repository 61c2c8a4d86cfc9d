"""Native CPU attention: a C++ extension (attention.cpp) built on first use (build.py), its torch custom ops
(ops.py) and the attention backend over them (backend.py). `import kernels.cpu` compiles nothing."""
