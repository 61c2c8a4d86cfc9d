"""Native CPU ops: C++ sources laid out per op family and compiled per instruction set (kernels/cpu/isa.h), built
on first use (build.py), their torch custom ops (ops.py) and the attention backend over them (backend.py).
`import kernels.cpu` compiles nothing."""
