"""The CUDA bridge's contract (`kernels.host_experts`: begin, fetched, end) in XLA ops, for the program's side of
the bridge on the CPU backend: begin's copy rows are gathered from the layers' weights (or taken from the layer
before's ahead rows for ids <= -2), its ahead rows from the next layer's, and end returns the host's sum. The
MoE position may be a traced value, as in the device decode step, so the layers are stacked and indexed by it."""

import jax
import jax.numpy as jnp

from pdscope_jax.models.layers import expert_ffn


class StandInBridge:
    can_copy = True  # as a bridge of bf16 experts

    def __init__(self, layers):
        """`layers`: per MoE position, (gate_up [E, D, 2F], down [E, F, D])."""
        self.stacked = tuple(jnp.stack([jnp.asarray(layer[k]) for layer in layers]) for k in range(2))
        self.pending, self.copies, self.aheads = None, [], []

    def install(self, monkeypatch):
        from pdscope_jax.kernels import host_experts

        for name in ("begin", "fetched", "end"):
            monkeypatch.setattr(host_experts, name, getattr(self, name))

    def layer(self, m):
        """(gate_up [E, D, 2F], down [E, F, D]) of MoE position m (an int or a traced int32)."""
        return tuple(part[m] for part in self.stacked)

    def close(self):
        pass

    def stats(self):
        return {"served": 0, "faults": 0, "seconds": 0.0}  # the real bridge's worker counts; here nothing runs

    def begin(self, bridge, m, h, ids, coef, picks, copy_ids=None, ahead_ids=None, ahead_rows=None):
        self.pending = (m, h, ids, coef)
        out = (h, picks)
        if copy_ids is not None:
            self.copies.append(copy_ids)
            rows = [part[jnp.maximum(copy_ids, 0)] for part in self.layer(m)]
            if ahead_rows is not None:  # ids <= -2 take row -2 - id of the layer before's ahead rows
                before = jnp.clip(-2 - copy_ids, 0, ahead_rows[0].shape[0] - 1)
                rows = [jnp.where((copy_ids <= -2)[:, None, None], got[before], own)
                        for got, own in zip(ahead_rows, rows)]
            out += tuple(rows)
        if ahead_ids is not None:
            self.aheads.append(ahead_ids)
            out += tuple(part[jnp.maximum(ahead_ids, 0)] for part in self.layer(m + 1))
        return out

    def fetched(self, bridge, gate_ups, downs, ahead_rows=None):
        return gate_ups, downs

    def end(self, bridge, dep, rows, hidden):
        m, h, ids, coef = self.pending
        gate_up, down = self.layer(m)
        outs = jax.vmap(lambda g, d: expert_ffn(h, g, d))(gate_up[jnp.maximum(ids, 0)], down[jnp.maximum(ids, 0)])
        return jnp.sum(jnp.where((ids >= 0)[:, None, None], coef[:, :, None] * outs, 0.0), axis=0)
