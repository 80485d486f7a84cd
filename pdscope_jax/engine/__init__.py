"""The offload engine: run an MoE model whose routed experts do not fit the accelerator budget.

Every routed expert lives once in pinned host memory (`expert_store`, the only code that moves expert
weights); one slot pool on the accelerator (`slot_pool`), sized by `budget`, serves as the prefill double
buffers and the decode expert cache; experts not in a slot run on the JAX CPU backend (`cpu_experts`);
`engine.OffloadRunner` runs route -> plan -> execute -> record per MoE layer with a planner from
`pdscope_jax.sched` and the jitted pieces of `programs`, counts in `stats`, and gives `logits`, `generate` and
`stats`.
"""

from pdscope_jax.store.budget import Budget, BudgetError, plan_budget
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.store.expert_store import ExpertStore, Staged
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.engine.stats import PhaseStats

__all__ = ["Budget", "BudgetError", "plan_budget", "CpuExperts", "OffloadRunner", "PhaseStats", "ExpertStore",
           "Staged", "SlotPool"]
