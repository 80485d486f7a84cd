"""Measure a model's cost table on the machine at hand (PAPER.md offline step 3; `pdscope-jax profile`).

Contract: `measure_cost_table(args, command) -> dict` (the saved table as a dict) takes the options of `pdscope-jax
profile` (attributes named as its flags) and measures, for one model (a preset name or a checkpoint directory; weights
are seeded random values, never read from disk) in `args.dtype`, its routed experts stored as `args.quantize` (None,
"int8", "int4": a table per precision, the expert times and transfers those of the stored bytes), on the accelerator and
the CPU backend that `runtime.select_devices` picks:
- `cpu_expert_seconds[b]`: one expert over b tokens on the engine's CPU path (`engine.cpu_experts`, store's CPU view);
- `gpu_expert_seconds[b]`: one expert over b tokens as one `combine_experts` program on the accelerator;
  `gpu_launch_seconds`: a trivial program on the accelerator (capped at the fastest expert time);
- `transfer_seconds[n]` for n = 1, 2, 4, ..., E experts copied pinned_host -> device memory in one batched `device_put`
  (as `ExpertStore.stage` issues them); `t_io` and `alpha` are the slope and intercept of a least-squares line through
  them (alpha clipped at 0, t_io at a positive floor); with `args.quality` one that loads int4 copies
  (`sched.precision`), the same for int4 copies of those experts, whose slope is the table's "int4" precision
  (`CostTable.precisions`, "measured");
- attention of the first MoE layer (`layer.attend`, random weights, a zero KV cache): prefill at batch 1 over b tokens;
  decode one step of b sequences against `args.decode_context` cached positions, measured up to `args.decode_max_batch`
  sequences and scaled proportionally to b beyond.
Every time is the median of `args.repeats` runs after one untimed run (compilation). The table (`sched.costs.CostTable`,
`source: "measured"`) is saved to `args.out`, by default `costs_dir()/<model>-<device>.json`,
`<model>-<scheme>-<device>.json` when quantized (`sched.costs.table_name`; <device> is the accelerator's kind, or
"cpu-standin" when a CPU device stands in for it); `meta` names both devices, says whether the accelerator is a
stand-in, and records `command`, date, dtype, quantize and jax version. A rich progress bar on stderr shows the
measurements; the last stdout line is a JSON summary (path, t_io, alpha). `errors.InputError` when no token bucket is
left (`cli.profile.check_args` finds that, and every other bad option, before anything is built).
"""

from __future__ import annotations

import datetime
import json
import sys


def measure_cost_table(args, command: str) -> dict:
    import jax

    from pdscope_jax.runtime import request_cpu_stand_in

    request_cpu_stand_in()
    from rich.console import Console
    from rich.progress import Progress

    from pdscope_jax.api import resolve
    from pdscope_jax.runtime import select_devices
    from pdscope_jax.sched.costs import CostTable, costs_dir, table_name
    from pdscope_jax.sched.precision import LOW

    cfg, _ = resolve(args.model)
    devices = select_devices()
    stand_in = devices.accel.platform == "cpu"
    label = "cpu-standin" if stand_in else getattr(devices.accel, "device_kind", devices.accel.platform)
    buckets = sorted(b for b in set(args.buckets) if args.max_tokens is None or b <= args.max_tokens)
    if not buckets or buckets[0] < 1:
        from pdscope_jax.errors import InputError

        raise InputError(f"no usable token buckets in {args.buckets} (max tokens {args.max_tokens}): give positive "
                         "--buckets, at least one of them <= --max-tokens")
    counts = [1 << i for i in range(cfg.num_experts.bit_length()) if 1 << i <= cfg.num_experts]
    if counts[-1] != cfg.num_experts:
        counts.append(cfg.num_experts)
    p = _Profiler(cfg, devices, args)
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)
    cpu, gpu, xfer, xfer_low, prefill, decode = [], [], [], [], [], []
    measures = [("cpu expert", cpu, p.cpu_expert, buckets), ("gpu expert", gpu, p.gpu_expert, buckets),
                ("transfer", xfer, p.transfer, counts),
                ("prefill attention", prefill, p.prefill_attention, buckets),
                ("decode attention", decode, p.decode_attention, buckets)]
    if p.host_low is not None:
        measures.append(("int4 copy transfer", xfer_low, p.transfer_low, counts))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"profiling {cfg.name}", total=sum(len(m[3]) for m in measures) + 1)
        for name, values, measure, sizes in measures:
            for size in sizes:
                progress.update(task, description=f"{cfg.name}: {name} {size}")
                values.append(measure(size))
                progress.advance(task)
        launch = min(p.launch(), min(gpu))
        progress.advance(task)
    t_io, alpha = _line(counts, xfer)
    meta = {"accelerator": f"{devices.accel} {getattr(devices.accel, 'device_kind', '')}".strip(),
            "cpu_backend": str(devices.cpu), "accelerator_is_cpu_standin": stand_in, "dtype": args.dtype,
            "quantize": args.quantize or "none",
            "weights": "random", "jax": jax.__version__, "repeats": args.repeats,
            "decode_context": args.decode_context, "decode_max_batch": args.decode_max_batch,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command}
    table = CostTable(token_buckets=tuple(buckets), cpu_expert_seconds=cpu, gpu_expert_seconds=gpu, t_io=t_io,
                      alpha=alpha, attn_prefill_seconds=prefill, attn_decode_seconds=decode,
                      gpu_launch_seconds=launch, transfer_counts=tuple(counts), transfer_seconds=xfer,
                      source="measured", model=cfg.name, meta=meta)
    if xfer_low:
        table = table.with_precision(LOW, t_io=_line(counts, xfer_low)[0])
    name = cfg.name if args.quantize is None else f"{cfg.name}-{args.quantize}"
    out = args.out or costs_dir() / f"{table_name(name, label)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    console.print(f"cost table for {name} on {meta['accelerator']} (CPU backend {devices.cpu}) -> {out}")
    print(json.dumps({"json": str(out), "model": cfg.name, "device": label, "t_io": t_io, "alpha": alpha}),
          flush=True)
    return table.to_dict()


def _line(counts: list[int], seconds: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line seconds ~ counts, slope floored, intercept clipped at 0."""
    import numpy as np

    n, s = np.asarray(counts, np.float64), np.asarray(seconds, np.float64)
    if n.size > 1:
        slope, intercept = np.polyfit(n, s, 1)
    else:
        slope, intercept = s[0] / n[0], 0.0
    floor = float(s.max() / n.max()) * 1e-3 + 1e-12
    return max(float(slope), floor), max(float(intercept), 0.0)


class _Profiler:
    """The measurements, each a median of `repeats` timed runs after one untimed run."""

    def __init__(self, cfg, devices, args):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pdscope_jax import models
        from pdscope_jax.engine.cpu_experts import CpuExperts
        from pdscope_jax.store.expert_store import ExpertStore
        from pdscope_jax.models.layers import combine_experts
        from pdscope_jax.quant.formats import is_quantized, quantize
        from pdscope_jax.sched.precision import loads_low
        from pdscope_jax.store.low_copies import low_copy

        self.cfg, self.devices, self.args = cfg, devices, args
        self.dtype = jnp.dtype(args.dtype)
        rng = np.random.default_rng(args.seed)
        d, f = cfg.hidden_size, cfg.moe_intermediate_size

        def weights(shape):
            return (rng.standard_normal(shape, np.float32) * 0.02).astype(self.dtype)

        def stored(w):  # an expert's matrix as the store keeps it: the dtype's array, or its quantized form
            return w if args.quantize is None else quantize(jnp.asarray(w), args.quantize)

        gate_up, down = stored(weights((1, d, 2 * f))), stored(weights((1, f, d)))
        store = ExpertStore(devices)  # one expert in pinned memory, read through its CPU view as the engine does
        store.add_layer(0, gate_up, down)
        self._cpu_experts = CpuExperts(store, args.cpu_min_rows)
        self.gpu_w = jax.device_put((gate_up, down), devices.accel)
        self._gpu_step = jax.jit(combine_experts)
        self._noop = jax.jit(lambda x: x + 1)
        pinned = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="pinned_host")
        self._device = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="device")
        host = [(stored(weights((d, 2 * f))), stored(weights((f, d)))) for _ in range(cfg.num_experts)]
        self.host = [jax.device_put(expert, pinned) for expert in host]
        self.host_low = None  # the int4 copies of the same experts, where --quality loads them
        if loads_low(getattr(args, "quality", None), args.quantize):
            self.host_low = [jax.device_put(jax.tree.map(lambda w: low_copy(w[None])[0], expert,
                                                         is_leaf=is_quantized), pinned) for expert in host]
        # the first MoE layer with random non-expert weights on the accelerator, for attention
        self.layer_index = cfg.moe_layers[0]
        self._attend = jax.jit(_attend, static_argnums=0)
        self.layer_graphdef, self.layer_state = _random_layer(cfg, self.dtype, self.layer_index, args.seed,
                                                              devices.accel)
        self._abstract = models.abstract_model(cfg, self.dtype)
        self._decode: dict[int, float] = {}  # decode batch -> seconds

    def _median(self, run) -> float:
        from pdscope_jax.bench.timing import median_seconds

        return median_seconds(run, self.args.repeats)

    def cpu_expert(self, tokens: int) -> float:
        import jax
        import numpy as np

        h = jax.device_put(np.ones((tokens, self.cfg.hidden_size), self.dtype), self.devices.cpu)
        groups = [(0, np.arange(tokens), np.ones(tokens, np.float32))]
        return self._median(lambda: self._cpu_experts.dispatch(0, h, groups))

    def gpu_expert(self, tokens: int) -> float:
        import jax
        import numpy as np

        slot_of = np.full(self.cfg.num_experts, -1, np.int32)
        slot_of[0] = 0
        x, weights, ids, slot_of = jax.device_put(
            (np.ones((tokens, self.cfg.hidden_size), self.dtype), np.ones((tokens, 1), np.float32),
             np.zeros((tokens, 1), np.int32), slot_of), self.devices.accel)
        return self._median(lambda: self._gpu_step(x, weights, ids, *self.gpu_w, slot_of))

    def launch(self) -> float:
        import jax
        import numpy as np

        x = jax.device_put(np.zeros((), np.float32), self.devices.accel)
        return self._median(lambda: self._noop(x))

    def transfer(self, n: int, low: bool = False) -> float:
        import jax

        host = self.host_low if low else self.host
        return self._median(lambda: jax.device_put(host[:n], self._device))

    def transfer_low(self, n: int) -> float:
        return self.transfer(n, low=True)

    def prefill_attention(self, tokens: int) -> float:
        import numpy as np

        positions = np.arange(tokens, dtype=np.int32)[None]
        return self._attention(1, tokens, positions, _round_up(tokens, 64))

    def decode_attention(self, batch: int) -> float:
        import numpy as np

        measured = min(batch, self.args.decode_max_batch)
        if measured not in self._decode:  # batches past the cap reuse the cap's measurement
            ctx = self.args.decode_context
            positions = np.full((measured, 1), ctx - 1, np.int32)
            self._decode[measured] = self._attention(measured, 1, positions, _round_up(ctx, 64))
        return self._decode[measured] * batch / measured

    def _attention(self, batch: int, tokens: int, positions, cache_len: int) -> float:
        import jax
        import jax.numpy as jnp
        import numpy as np

        accel = self.devices.accel
        shapes = jax.eval_shape(lambda: self._abstract.init_cache(batch, cache_len, self.dtype))[self.layer_index]
        cache = jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), accel), shapes)
        x = jax.device_put(np.full((batch, tokens, self.cfg.hidden_size), 0.01, self.dtype), accel)
        pos = jax.device_put(positions, accel)
        return self._median(lambda: self._attend(self.layer_graphdef, self.layer_state, x, pos, cache))


def _attend(graphdef, state, x, positions, cache):
    from flax import nnx

    return nnx.merge(graphdef, state).attend(x, positions, cache)


def _random_layer(cfg, dtype, index: int, seed: int, device):
    """(graphdef, state) of decoder layer `index` with seeded random non-expert weights on `device` (its routed
    expert stacks are empty placeholders: attention never reads them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pdscope_jax import models
    from pdscope_jax.store.expert_store import is_expert_path
    from pdscope_jax.weights.random_init import random_state

    graphdef, state = nnx.split(models.abstract_model(cfg, dtype).layers[index])
    flat = nnx.to_flat_state(state)
    prefix = f"layers.{index}."
    paths = {prefix + ".".join(str(k) for k in p): v for p, v in flat}
    sharding = jax.sharding.SingleDeviceSharding(device)
    values = random_state({p: v.get_value() for p, v in paths.items() if not is_expert_path(p)}, seed,
                          lambda path: sharding)
    for path, var in paths.items():
        value = values.get(path)
        var.set_value(value if value is not None else jax.device_put(jnp.zeros((0,), var.get_value().dtype), device))
    return graphdef, nnx.from_flat_state(flat)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
