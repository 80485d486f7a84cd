"""The pieces of `pdscope-jax bench` that run the model: which runs, how each is timed and summarised, the plain
reference run and token parity, the hot table, the host profile.

Contract
- `plan_runs(args)`: the runs in order, each a dict with `label` (what the tables show), `policy` (a registry
  name, or `PLAIN`) and, for offload runs, the engine switches `hot`, `async_io`, `batched_gpu`,
  `device_decode`, `decode_bank`, `decode_cpu_experts`, `decode_copy_share`, `decode_bridge_copies`,
  `decode_zero_copy`, `decode_copies_ahead`, `decode_chunk`, `decode_trial`, `quality`, `mixed_threshold`. A label
  is a policy NAME with suffixes (`split_label`): `:host` (`device_decode` off), `:nobank` (`decode_bank` off),
  `:bankpieces` (`decode_bank_pieces` on),
  `:cpu` / `:nocpu` (`decode_cpu_experts` "auto" / "off"), `:copy=F` (`decode_copy_share` F), `:progcopy`
  (`decode_bridge_copies` off), `:zerocopy` / `:nozerocopy` (`decode_zero_copy` on / off; else auto), `:ahead`
  (`decode_copies_ahead` on), `:notrial` (`decode_trial` 0: no timing of both decode executors at warm-up),
  `:chunk=N` (`decode_chunk` N), `:quality=Q` (`quality` Q, else `args.quality`). With `args.ablation` the runs
  are `ABLATION` (no decode trial) then the plain run.
  `build_quality(args, runs)`: the quality the runner is built with (one that keeps the int4 copies where any run
  loads them).
- `engine_switches(run, hot_table)`: `OffloadRunner.set_policy`'s keyword arguments for a run.
- `planner_options(runner, policy, hot_per_layer)`: `--hot-per-layer` goes to the planners whose hot set
  stands without activation counts (a fixed resident set: `hot_slots(..., have_table=False)` is not None).
- `time_point(runner, run, prompt, args, tokens)`: `args.warmup` warm-ups, then `args.repeats` timed
  generations; the first starts from the pool `set_policy` left ("cold"), the others from the pool the one
  before left ("warm"). Returns the `summarise`d result row, with the allocator's peak before and after warm-up.
- `run_plain(...)`: the whole model on the default device (no budget), timed the same way; then
  `mark_parity(results, tokens)` sets `tokens_match_plain` / `tokens_before_divergence` on every offload row.
- `weights_loader`, `quantized_weights`, `record_hot_table`, `profile_runs`, `describe_runner`: see their docstrings.
"""

from __future__ import annotations

import statistics
import time

from pdscope_jax.bench.report import PHASE_TIMES
from pdscope_jax.runtime import allocator_peak
from pdscope_jax.sched import PLAIN, planner_class

HOST_DECODE = ":host"  # a policy name's suffix: RuntimeConfig.device_decode off
NO_BANK = ":nobank"  # a policy name's suffix: RuntimeConfig.decode_bank off (decode in the pool alone)
BANK_PIECES = ":bankpieces"  # a policy name's suffix: RuntimeConfig.decode_bank_pieces on (the bank in layer pieces)
NO_CPU = ":nocpu"  # a policy name's suffix: RuntimeConfig.decode_cpu_experts off (device decode copies every miss)
WITH_CPU = ":cpu"  # a policy name's suffix: decode_cpu_experts "auto" (the host computes part, through the bridge)
COPY_SHARE = ":copy="  # a policy name's suffix with a number: RuntimeConfig.decode_copy_share
PROGRAM_COPIES = ":progcopy"  # a policy name's suffix: RuntimeConfig.decode_bridge_copies off (the program copies)
ZERO_COPY = ":zerocopy"  # a policy name's suffix: RuntimeConfig.decode_zero_copy on (misses read in place, over PCIe)
NO_ZERO_COPY = ":nozerocopy"  # a policy name's suffix: decode_zero_copy off (the program copies misses: the old step)
AHEAD = ":ahead"  # a policy name's suffix: RuntimeConfig.decode_copies_ahead on (predicted experts copied ahead)
NO_TRIAL = ":notrial"  # a policy name's suffix: RuntimeConfig.decode_trial 0 (the one-program step where it can run)
QUALITY = ":quality="  # a policy name's suffix with a quality (int8, mixed, int4): RuntimeConfig.quality
CHUNK = ":chunk="  # a policy name's suffix with a step count: RuntimeConfig.decode_chunk
QUALITIES = ("int8", "mixed", "int4")  # sched.precision.QUALITIES (here: `--help` stays without numpy)
SUFFIXES = (HOST_DECODE, NO_BANK, BANK_PIECES, NO_CPU, WITH_CPU, PROGRAM_COPIES, ZERO_COPY, NO_ZERO_COPY, AHEAD,
            NO_TRIAL)


def split_label(label: str) -> tuple[str, dict]:
    """(policy, engine switches its suffixes set) of a run label: NAME, then any of `SUFFIXES` and
    `:copy=F` (0 <= F <= 1), `:chunk=N` (N >= 1) and `:quality=Q`; ValueError naming the part it does not know."""
    policy, *parts = label.split(":")
    switches = {}
    for part in parts:
        if f":{part}" == HOST_DECODE:
            switches["device_decode"] = False
        elif f":{part}" == NO_BANK:
            switches["decode_bank"] = False
        elif f":{part}" == BANK_PIECES:
            switches["decode_bank_pieces"] = True
        elif f":{part}" == NO_CPU:
            switches["decode_cpu_experts"] = "off"
        elif f":{part}" == WITH_CPU:
            switches["decode_cpu_experts"] = "auto"
        elif f":{part}" == PROGRAM_COPIES:
            switches["decode_bridge_copies"] = False
        elif f":{part}" == ZERO_COPY:
            switches["decode_zero_copy"] = True
        elif f":{part}" == NO_ZERO_COPY:
            switches["decode_zero_copy"] = False
        elif f":{part}" == AHEAD:
            switches["decode_copies_ahead"] = True
        elif f":{part}" == NO_TRIAL:
            switches["decode_trial"] = 0
        elif f":{part}".startswith(COPY_SHARE):
            try:
                share = float(part[len(COPY_SHARE) - 1:])
            except ValueError:
                share = -1.0
            if not 0 <= share <= 1:
                raise ValueError(f"{label!r}: {COPY_SHARE}F needs 0 <= F <= 1")
            switches["decode_copy_share"] = share
        elif f":{part}".startswith(CHUNK):
            steps = part[len(CHUNK) - 1:]
            if not steps.isdigit() or int(steps) < 1:
                raise ValueError(f"{label!r}: {CHUNK}N needs a whole number N >= 1")
            switches["decode_chunk"] = int(steps)
        elif f":{part}".startswith(QUALITY):
            quality = part[len(QUALITY) - 1:]
            if quality not in QUALITIES:
                raise ValueError(f"{label!r}: {QUALITY}Q takes one of {', '.join(QUALITIES)}")
            switches["quality"] = quality
        else:
            raise ValueError(f"{label!r}: unknown suffix ':{part}'")
    return policy, switches
# The paper's ablation steps (label, policy, hot table, async_io, batched_gpu): greedy with synchronous I/O and
# one GPU program per expert, +h hot table, +i asynchronous I/O, +p+a AdaptSched with next-layer scores,
# +g+c one batched GPU program per layer in prefill and decode as one program per step. The paper's "+c" (a
# CPU cache prefetch of expert weights) has no JAX counterpart and is not modelled.
ABLATION = (
    ("greedy", "greedy", False, False, False),
    ("+h", "greedy", True, False, False),
    ("+i", "greedy", True, True, False),
    ("+p+a", "pdscope", True, True, False),
    ("+g+c", "pdscope", True, True, True),
)
PHASE_KEYS = (*PHASE_TIMES, "seconds", "generate_seconds", "bytes_moved", "hit_rate", "prefetch_accuracy",
              "cpu_experts", "gpu_experts", "planner_ms_per_layer", "device_steps", "handoff_seconds",
              "prediction_recall", "experts_placed", "experts_loaded_low", "bytes_moved_low", "gpu_experts_low")


def plan_runs(args) -> list[dict]:
    """The runs in order: label, policy and engine switches (the hot table is filled in once it is known)."""
    precision = {"quality": getattr(args, "quality", None), "mixed_threshold": getattr(args, "mixed_threshold", None)}
    if args.ablation:
        # each step fixes how decode runs (+g+c: one program a step), so no warm-up trial chooses it
        return [{"label": label, "policy": policy, "hot": hot, "async_io": aio, "batched_gpu": batched,
                 "device_decode": True, "decode_bank": True, "decode_trial": 0, **precision}
                for label, policy, hot, aio, batched in ABLATION] + [{"label": PLAIN, "policy": PLAIN}]
    runs = []
    for label in args.policies:
        policy, switches = split_label(label)
        runs.append({"label": label, "policy": policy, "hot": args.hot_table is not None, "async_io": True,
                     "batched_gpu": True, "device_decode": True, "decode_bank": True,
                     "decode_cpu_experts": None, "decode_copy_share": None, **precision, **switches})
    return runs


def build_quality(args, runs: list[dict]) -> str | None:
    """The quality to build the runner with: the first of `args.quality` and the runs' that loads int4 copies (so
    the store keeps them for every run that does), else `args.quality`."""
    from pdscope_jax.sched.precision import loads_low

    wanted = [getattr(args, "quality", None)] + [r.get("quality") for r in runs]
    return next((q for q in wanted if loads_low(q, args.quantize)), wanted[0])


def default_setting(name: str):
    """RuntimeConfig's default of field `name`, what a label without the suffix that sets it runs (e.g.
    decode_cpu_experts without :cpu / :nocpu; imported here: `--help` stays without jax)."""
    from pdscope_jax.runtime import RuntimeConfig

    return getattr(RuntimeConfig, name)


def engine_switches(run: dict, hot_table) -> dict:
    """The engine switches of a run (`OffloadRunner.set_policy`'s keyword arguments)."""
    return {"hot_table": hot_table if run["hot"] else None, "async_io": run["async_io"],
            "batched_gpu": run["batched_gpu"], "device_decode": run["device_decode"],
            "decode_bank": run["decode_bank"], "decode_bank_pieces": run.get("decode_bank_pieces", False),
            "decode_cpu_experts": run.get("decode_cpu_experts") or default_setting("decode_cpu_experts"),
            "decode_copy_share": run.get("decode_copy_share"),
            "decode_bridge_copies": run.get("decode_bridge_copies", True),
            "decode_zero_copy": run.get("decode_zero_copy", default_setting("decode_zero_copy")),
            "decode_copies_ahead": run.get("decode_copies_ahead", False),
            "decode_chunk": run.get("decode_chunk") or default_setting("decode_chunk"),
            "decode_trial": run.get("decode_trial", default_setting("decode_trial")), "quality": run.get("quality"),
            "mixed_threshold": run.get("mixed_threshold") or default_setting("mixed_threshold")}


def planner_options(runner, policy: str, hot_per_layer: int | None) -> dict:
    """Planner options from the command line (the engine fills in the defaults)."""
    fixed_hot_set = planner_class(policy).hot_slots(runner.pool.num_slots, runner.config.num_experts,
                                                    runner.pool.can_double_buffer, False) is not None
    return {"hot_per_layer": hot_per_layer} if hot_per_layer is not None and fixed_hot_set else {}


def set_run(runner, run: dict, args, hot_table) -> dict:
    """Switch `runner` to `run`'s policy and engine switches, its CPU calibration forgotten (every run starts from
    the cost table, as a new process does); returns the switches."""
    engine = engine_switches(run, hot_table)
    runner.set_policy(run["policy"], planner_options(runner, run["policy"], args.hot_per_layer), **engine)
    runner.reset_calibration()
    return engine


def time_point(runner, run: dict, engine: dict, prompt, args, tokens: dict, advance) -> dict:
    """Warm-ups and timed repeats of one (run, batch, prompt length) point; `advance()` after each generation.
    The first repeat's tokens go into `tokens[(label, batch, prompt_len)]`; the row also holds the wall seconds of
    the warm-ups (compilation, trials) and of the whole point, and the accelerator allocator's peak so far (the
    process's: it never goes down) before and after the warm-ups, which tells the timed runs' own peak from the
    warm-ups' (None where the device reports none)."""
    b, t = prompt.shape
    started, peaks = time.perf_counter(), {"device_peak_before_warmup": allocator_peak(runner.devices.accel)}
    for _ in range(args.warmup):
        runner.warmup(b, t, args.new_tokens)  # the run's cache (and with decode_chunk, its chunks)
        advance()
    warmed = time.perf_counter()
    peaks["device_peak_after_warmup"] = allocator_peak(runner.devices.accel)
    compiled_after_warmup = runner.compiled_programs["total"]
    repeats = []
    for i in range(args.repeats):
        runner.reset_stats()
        out = runner.generate(prompt, args.new_tokens)
        tokens.setdefault((run["label"], b, t), out.tokens)
        repeats.append({"pool": "warm" if i else "cold", "prefill_tok_s": out.prefill_tokens_per_s,
                        "decode_tok_s": out.decode_tokens_per_s, **runner.stats})
        advance()
    row = summarise(run["policy"], t, repeats, compiled_after_warmup, variant=run["label"], batch=b, engine=engine)
    return {**row, **peaks, "warmup_seconds": warmed - started, "point_seconds": time.perf_counter() - started}


def summarise(policy: str, prompt_len: int, repeats: list[dict], compiled_after_warmup: int, *, variant: str,
              batch: int, engine: dict) -> dict:
    """One result row: medians over the repeats (cold and warm prefill apart), per-phase medians, the repeats."""
    out = {"variant": variant, "policy": policy, "batch": batch, "prompt_len": prompt_len, **engine,
           "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in repeats),
           "decode_tok_s": statistics.median(r["decode_tok_s"] for r in repeats),
           "prefill_tok_s_cold": repeats[0]["prefill_tok_s"],
           "prefill_tok_s_warm": statistics.median(r["prefill_tok_s"] for r in repeats[1:]) if repeats[1:] else None,
           "compiled_programs_after_warmup": compiled_after_warmup,
           "compiled_programs_after_runs": repeats[-1]["compiled_programs"]["total"],
           # the decode executor warm-up's trial chose for this batch, with both timings (None: no trial)
           "decode_trial_result": (repeats[-1].get("decode_trials") or {}).get(str(batch)),
           # how device decode split this batch's misses between copies and the host (None: it decided none)
           "decode_host_split": ((repeats[-1].get("decode_host") or {}).get("splits") or {}).get(str(batch))}
    for phase in ("prefill", "decode"):
        out[phase] = {key: _median(repeats, phase, key) for key in PHASE_KEYS}
    out["repeats"] = repeats
    return out


def _median(repeats: list[dict], phase: str, key: str):
    values = [r[phase][key] for r in repeats if r[phase][key] is not None]
    return statistics.median(values) if values else None


def weights_loader(cfg, checkpoint, shapes, seed: int, workload):
    """`loader(paths, placement)` of the benchmarked weights: the checkpoint's, or seeded random ones rewritten
    by the workload."""
    if checkpoint is not None:
        from pdscope_jax import models
        from pdscope_jax.weights.checkpoint import checkpoint_loader, open_checkpoint

        return checkpoint_loader(open_checkpoint(checkpoint), models.checkpoint_sources(cfg), shapes)
    from pdscope_jax.weights.random_init import random_state

    def random(paths, placement):
        return random_state({p: shapes[p] for p in paths}, seed, placement)

    return workload.loader(random) if workload is not None else random


def quantized_weights(cfg, dtype, shapes, loader, quantize: str | None):
    """(cfg, shapes, loader) of the benchmarked model with its experts quantized as they load (`quantize`: "int8",
    "int4"), from the dense model's; None: the dense model's as given."""
    if not quantize:
        return cfg, shapes, loader
    from pdscope_jax import models
    from pdscope_jax.quant.loader import quantizing_loader

    cfg = cfg.replace(expert_quant=quantize)
    return cfg, models.abstract_state(cfg, dtype), quantizing_loader(loader, quantize)


def record_hot_table(runner, cfg, args, rng, path) -> str:
    """Activation counts of one generation over prompts not used for timing, at the first batch size and the
    longest prompt (the most routed tokens: a short prompt gives too few picks per expert to tell popularity
    from noise), saved as a hot table at `path`. The policy that records them loads every activated expert."""
    import numpy as np

    from pdscope_jax.sched.hot import write_layer_stats

    b, t = args.batch[0], max(args.prompt_lens)
    runner.set_policy("ondemand")
    runner.generate(rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32), args.new_tokens)
    return str(write_layer_stats(path, cfg.moe_layers, runner.activation_counts))


def run_plain(cfg, dtype, loader, shapes, args, prompts, tokens, advance, describe) -> list[dict]:
    """The whole model on the accelerator (no budget), timed like the offload runs; one row per point.
    `describe(text)` names the point being measured, `advance()` follows each generation."""
    import jax

    from pdscope_jax import models
    from pdscope_jax.generation.generator import Generator

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # where `pdscope_jax.load` runs a model whole
    generator = Generator(models.from_flat(cfg, dtype, loader(list(shapes), lambda path: device)))
    rows = []
    for b in args.batch:
        for t in args.prompt_lens:
            describe(f"{PLAIN} batch {b} prompt {t}")
            for _ in range(args.warmup):
                generator.generate(prompts[b, t], args.new_tokens)
                advance()
            repeats = []
            for _ in range(args.repeats):
                out = generator.generate(prompts[b, t], args.new_tokens)
                tokens.setdefault((PLAIN, b, t), out.tokens)
                repeats.append({"prefill_tok_s": out.prefill_tokens_per_s, "decode_tok_s": out.decode_tokens_per_s})
                advance()
            rows.append({"variant": PLAIN, "policy": PLAIN, "batch": b, "prompt_len": t,
                         "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in repeats),
                         "decode_tok_s": statistics.median(r["decode_tok_s"] for r in repeats),
                         "repeats": repeats})
    return rows


def mark_parity(results: list[dict], tokens: dict) -> None:
    """Per offload row: whether its first repeat's tokens equal the plain run's at the same point, and how many
    new tokens agree before the first difference (None where either is missing). In bfloat16, reductions that
    add in another order can flip a near-tie between two tokens, after which the texts differ."""
    import numpy as np

    for r in results:
        plain = tokens.get((PLAIN, r["batch"], r["prompt_len"]))
        mine = tokens.get((r["variant"], r["batch"], r["prompt_len"]))
        if r["policy"] == PLAIN or plain is None or mine is None:
            r["tokens_match_plain"] = r["tokens_before_divergence"] = None
            continue
        r["tokens_match_plain"] = bool(np.array_equal(plain, mine))
        r["tokens_before_divergence"] = common_prefix(plain, mine)


def common_prefix(a, b) -> int:
    """New tokens the two [B, T] outputs agree on before their first difference (in any sequence)."""
    import numpy as np

    differs = np.flatnonzero((np.asarray(a) != np.asarray(b)).any(axis=0))
    return int(differs[0]) if differs.size else int(np.asarray(a).shape[1])


def profile_runs(runner, runs: list[dict], args, prompts, status, hot_table) -> dict:
    """Where the host's time goes: per run, the functions with the most own and cumulative time (cProfile) over
    one generation of `args.cprofile` tokens at the first batch size and the longest prompt (after its warm-up:
    the long prefill is the one worth a timeline), then one more generation's stage timeline.
    `status(text)` is a context manager that shows what runs."""
    import cProfile
    import pstats

    from pdscope_jax.engine.timeline import Timeline

    out = {}
    for run in runs:
        set_run(runner, run, args, hot_table)
        prompt = prompts[args.batch[0], args.prompt_lens[-1]]
        with status(f"profiling {run['label']}"):
            runner.generate(prompt, args.cprofile)
            profiler = cProfile.Profile()
            profiler.enable()
            result = runner.generate(prompt, args.cprofile)
            profiler.disable()
            runner.timeline = Timeline()  # once more without the profiler: stage timestamps per layer
            runner.generate(prompt, args.cprofile)
            timeline, runner.timeline = runner.timeline.summary(), None
        stats = pstats.Stats(profiler)
        rows = [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls": calls, "own_s": own,
                 "cumulative_s": cum} for (path, line, name), (_, calls, own, cum, _) in stats.stats.items()]
        out[run["label"]] = {
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
            "new_tokens": args.cprofile, "prompt_len": args.prompt_lens[-1], "timeline_ms": timeline,
            "by_own_time": sorted(rows, key=lambda r: -r["own_s"])[:25],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_s"])[:40]}
    return out


def describe_runner(runner) -> dict:
    """The budget, the engine's build stages (wall seconds), slots, double buffering and host memory of the offload
    runner (None values without one)."""
    if runner is None:
        return {"budget": None, "startup_seconds": None, "slots": None, "double_buffering": None,
                "host_bytes_per_model_byte": None, "host_expert_bytes": None, "host_peak_rss_bytes": None}
    import resource

    return {"budget": dict(runner.budget.lines()), "startup_seconds": dict(runner.startup_seconds),
            "slots": runner.pool.num_slots,
            "double_buffering": runner.pool.can_double_buffer,
            "host_bytes_per_model_byte": runner.store.host_bytes_per_model_byte,
            "host_expert_bytes": runner.store.host_bytes,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
