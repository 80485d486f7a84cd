"""The offload engine: run an MoE model whose routed experts do not fit the accelerator budget.

Every routed expert lives once in pinned host memory (`store.expert_store`, the only code that moves expert
weights); one slot pool on the accelerator (`store.slot_pool`), sized by `store.budget`, serves as the prefill
double buffers and the decode expert cache; experts not in a slot run on the JAX CPU backend (`cpu_experts`).
Reading order: `runner` (OffloadRunner: construction via `build`, policies, statistics, logits/generate/warmup);
`loop` (a host-planned step: per MoE layer `route` -> plan -> `execute` -> record, with `transfers` staging the
next layer and `calibration` scaling the planners' CPU costs); `decode` (the decode step executors: that loop, or
`device_decode`'s one program per step); `programs` (the jitted pieces), `stats`, `timeline`, `warmup`.
"""

from pdscope_jax.store.budget import Budget, BudgetError, plan_budget
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.store.expert_store import ExpertStore, Staged
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.engine.stats import PhaseStats

__all__ = ["Budget", "BudgetError", "plan_budget", "CpuExperts", "OffloadRunner", "PhaseStats", "ExpertStore",
           "Staged", "SlotPool"]
