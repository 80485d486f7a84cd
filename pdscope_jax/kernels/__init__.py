"""Native kernels run by JAX backends through XLA FFI custom calls, each with an XLA fallback of the same
semantics, or Pallas kernels. `cpu_ffn`: routed experts' SwiGLU FFN on the CPU backend. `gather_matvec`: few-row
products with gathered expert weights on a CUDA GPU (Pallas, Triton lowering). `expert_math`: the routed
expert's definition they implement. `build`: compiles their C++ sources on
first use into a per-user cache."""
