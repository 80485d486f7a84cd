"""Native kernels run by JAX backends through XLA FFI custom calls, each with an XLA fallback of the same
semantics. `cpu_ffn`: routed experts' SwiGLU FFN on the CPU backend. `build`: compiles their C++ sources on
first use into a per-user cache."""
