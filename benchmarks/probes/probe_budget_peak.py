"""Where the accelerator allocator's peak rises above the budget: a ledger of the peak over one bench-like run.

Builds the offloaded model (`--model`, seeded random weights, `--workload`) at `--gpu-memory` for one `--prompt-len`
(the bench's RuntimeConfig: max_seq_len = prompt + tokens), sets `--policy`, runs the bench's warm-up, then
`--repeats` generations of `--tokens` new tokens. Before and after each stage named in WRAPPED (the warm-up's parts,
the decode bank's opening and fill, each decode program's dispatch and its wait, the decode's end) and at every
timeline mark of the prefill loop, it reads the allocator's bytes in use and its peak (the process's so far: it
never goes down); it keeps an entry wherever the peak grew. Each entry: the stage, seconds since the start, bytes in
use, the allocator's largest free block (where reported), the bytes of live arrays in the accelerator's memory (what
Python holds: in use less these is temporaries and buffers of queued programs), the peak, the growth, and whether
the peak is over the budget (a backend without allocator statistics, the CPU: the live arrays' bytes stand for both).
The first entry over the budget names the stage that took the process past it. Also kept: the budget's parts, the
live arrays on the accelerator by shape after the build and after the last decode, the allocator's statistics at
the end, each decode bank fill's time, XLA's memory analysis of each decode program (its temporaries: what the
budget's decode step reserve stands for), and whether each program given the pool or the decode bank donated wrote
them in place (`record_donations`).
Under a held allocator (`XLA_PYTHON_CLIENT_MEM_FRACTION`, as the matched runs hold it) a failure is kept with the
innermost wrapped stage that raised it and the allocator's reading there.
Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_budget_peak.py --gpu-memory 24399MiB --out F.json`. Random weights.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import time
from pathlib import Path

import numpy as np

from pdscope_jax.runtime import allocator_peak

WRAPPED = (  # (module, class or None, function): stages whose peak the ledger reads before and after
    ("pdscope_jax.engine.runner", "OffloadRunner", "warmup"),
    ("pdscope_jax.engine.runner", "OffloadRunner", "precompile_routed"),
    ("pdscope_jax.engine.decode_trial", None, "compile_loops"),
    ("pdscope_jax.engine.decode_trial", None, "trial"),
    ("pdscope_jax.store.slot_pool", "SlotPool", "open_decode_bank"),
    ("pdscope_jax.engine.decode", "DeviceDecode", "_fill_bank"),
    ("pdscope_jax.store.expert_store", "ExpertStore", "commit_bank"),  # each group of the bank's fill
    ("pdscope_jax.engine.decode", "DeviceDecode", "_fill_pool"),
    ("pdscope_jax.engine.decode", "DeviceDecode", "_one_step"),
    ("pdscope_jax.engine.decode", "DeviceDecode", "_one_chunk"),
    ("pdscope_jax.engine.decode", "DeviceDecode", "_unstacked"),
    ("pdscope_jax.engine.decode", "DeviceDecode", "finish"),
    ("pdscope_jax.engine.decode", "HostDecode", "step"),
)


def parse_args(argv):
    from pdscope_jax.runtime import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--gpu-memory", type=parse_size, required=True)
    p.add_argument("--policy", default="pdscope")
    p.add_argument("--workload", default="uniform", choices=["uniform", "skewed"])
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


class Ledger:
    """Allocator readings of `runner`'s accelerator, kept where the peak grew (or where asked), against a budget."""

    def __init__(self, runner, budget: int):
        self.runner, self.budget, self.start = runner, budget, time.perf_counter()
        self.entries: list[dict] = []
        self.peak = 0
        self.last: dict | None = None
        self.raised_in: dict | None = None

    def read(self, stage: str, keep: bool = False) -> None:
        held = self.runner.device_memory()  # live arrays' bytes, and the allocator's bytes in use where reported
        live = held["live_array_bytes"]
        # a backend without allocator statistics (the CPU): the live arrays stand for them
        peak = allocator_peak(self.runner.devices.accel, max(self.peak, live))
        in_use = live if held["bytes_in_use"] is None else held["bytes_in_use"]
        # the largest allocation the allocator could make now: below an array's size, it fails though bytes are free
        largest = (self.runner.devices.accel.memory_stats() or {}).get("largest_free_block_bytes")
        self.last = {"stage": stage, "bytes_in_use": in_use, "live_array_bytes": live,
                     "largest_free_block": largest}  # kept or not
        if peak > self.peak or keep:
            self.entries.append({"stage": stage, "seconds": round(time.perf_counter() - self.start, 4),
                                 "bytes_in_use": in_use, "live_array_bytes": live, "largest_free_block": largest,
                                 "peak": peak, "grew": peak - self.peak, "over_budget": peak > self.budget})
            self.peak = peak

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapped(*args, **kwargs):
            self.read(f"before {label}")
            try:
                result = inner(*args, **kwargs)
            except BaseException:
                self.read(f"raised in {label}", keep=True)
                self.raised_in = self.raised_in or self.last  # the innermost stage that raised
                raise
            self.read(f"after {label}")
            return result

        setattr(owner, name, wrapped)


def time_bank_fills() -> list[dict]:
    """Time each decode bank's fill (`DeviceDecode._fill_bank`): the seconds to issue it, and until its writes are
    done (waited for here; the first step would wait for them on the accelerator anyway). -> the list filled."""
    import jax

    from pdscope_jax.engine.decode import DeviceDecode

    fills, fill = [], DeviceDecode._fill_bank

    def timed(self):
        start = time.perf_counter()
        pairs = fill(self)
        issued = time.perf_counter()
        jax.block_until_ready(self.engine.pool.banks)
        fills.append({"experts": len(pairs), "issue_seconds": issued - start,
                      "done_seconds": time.perf_counter() - start})
        return pairs

    DeviceDecode._fill_bank = timed
    return fills


def record_decode_programs(runner) -> list[dict]:
    """XLA's memory analysis of each decode program `runner` dispatches (the one-step program and both chunk
    programs), read once per program and step count from the same arguments (lowered and compiled again: the
    compilation caches serve it). -> the list filled: program, steps, and the analysis' sizes in bytes."""
    seen, records = set(), []

    def wrap(name):
        program = getattr(runner, name)

        def wrapped(*args):
            key = (name, args[0] if name != "_decode_step" else 1)
            if key not in seen:
                seen.add(key)
                analysis = program.lower(*args).compile().memory_analysis()
                if analysis is not None:
                    records.append({"program": name, "steps": key[1], **{
                        field: int(getattr(analysis, f"{field}_size_in_bytes"))
                        for field in ("temp", "output", "argument", "alias", "generated_code")}})
            return program(*args)

        setattr(runner, name, wrapped)

    for name in ("_decode_step", "_decode_chunk", "_decode_chunk_issued"):
        wrap(name)
    return records


def record_donations() -> dict:
    """Whether each program that is given the pool or a decode bank donated writes them in place: the device
    addresses of the arrays it was given against those it returned (`ExpertStore._committed`, the slot and bank
    commits; `DeviceDecode._one_step` / `_one_chunk`, the decode programs). -> counts filled as they run, per
    program: in place, and moved (other buffers: the input copied, not donated, or a failed program's outputs), with
    the first moved."""
    import jax

    from pdscope_jax.engine.decode import DeviceDecode
    from pdscope_jax.store.expert_store import ExpertStore

    counts: dict = {}

    def addresses(tree) -> list[int]:
        return [a.unsafe_buffer_pointer() for a in jax.tree.leaves(tree)]

    def sharing(tree) -> list:  # live arrays at each leaf's address; more than one: who holds the others
        leaves = jax.tree.leaves(tree)
        at = collections.defaultdict(list)
        for a in jax.live_arrays():
            if not a.is_deleted() and a.sharding.memory_kind in (None, "device"):
                at[a.unsafe_buffer_pointer()].append(a)
        out = []
        for leaf in leaves:
            others = [a for a in at[leaf.unsafe_buffer_pointer()] if a is not leaf]
            out.append(len(others) + 1 if not others else {
                "arrays": len(others) + 1, "others_committed": [a.committed for a in others],
                "held_by": sorted({type(r).__name__ for a in others for r in gc.get_referrers(a)})[:10]})
        return out

    def tally(label: str, before: list[int], after: list[int], shapes: list, shared: list[int]) -> None:
        entry = counts.setdefault(label, {"in_place": 0, "moved": 0, "first_moved": None})
        moved = [str(shape) for b, a, shape in zip(before, after, shapes) if a != b]
        entry["moved" if moved else "in_place"] += 1
        if moved and entry["first_moved"] is None:
            entry["first_moved"] = {"shapes": moved, "arrays_at_each_address": shared}

    committed = ExpertStore._committed

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                            tree)

    def commit(self, bank, staged, slots):
        before, shapes, shared = addresses(bank), [a.shape for a in jax.tree.leaves(bank)], sharing(bank)
        calls, originals = [], dict(self._commit)
        for kind, program in originals.items():  # each program's arguments, for XLA's aliasing below
            def remembered(*args, _program=program):
                calls.append((_program, abstract(args)))
                return _program(*args)
            self._commit[kind] = remembered
        try:
            out = committed(self, bank, staged, slots)
        finally:
            self._commit.update(originals)
        if out is not bank:
            label = f"commit of {shapes[0][0]} slots"
            tally(label, before, addresses(out), shapes, shared)
            entry = counts[label]
            if entry["moved"] == 1 and entry["first_moved"] and calls and "xla_alias_bytes" not in entry:
                analysis = calls[0][0].lower(*calls[0][1]).compile().memory_analysis()
                entry["xla_alias_bytes"] = None if analysis is None else int(analysis.alias_size_in_bytes)
        return out

    ExpertStore._committed = commit
    for name in ("_one_step", "_one_chunk"):
        def step(self, *args, _inner=getattr(DeviceDecode, name), _name=name):
            pool = self.engine.pool
            before, shapes = addresses(pool.banks), [a.shape for a in jax.tree.leaves(pool.banks)]
            shared = sharing(pool.banks)
            out = _inner(self, *args)
            tally(f"decode {_name}", before, addresses(pool.banks), shapes, shared)
            return out

        setattr(DeviceDecode, name, step)
    return counts


def live_arrays(device) -> list[dict]:
    import jax

    by_shape = collections.Counter()
    count = collections.Counter()
    for a in jax.live_arrays():
        if device in a.devices() and a.sharding.memory_kind in (None, "device"):
            key = f"{a.dtype}{list(a.shape)}"
            by_shape[key] += a.nbytes
            count[key] += 1
    return [{"shape": k, "arrays": count[k], "bytes": v} for k, v in by_shape.most_common(25)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    import importlib

    import jax.numpy as jnp

    from _common import probe_result, random_loader
    from pdscope_jax import models
    from pdscope_jax.api import resolve
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.workloads import routing as workloads

    fills = time_bank_fills()
    donations = record_donations()
    cfg, _ = resolve(args.model)
    dtype = jnp.bfloat16
    shapes = models.abstract_state(cfg, dtype)
    loader = random_loader(shapes, 0, workloads.design(cfg, args.workload, seed=0))
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, policy="ondemand", max_seq_len=args.prompt_len + args.tokens)
    marked = OffloadRunner._mark  # the prefill loop holds the bound method: patched before the build

    def mark(self, phase, event, layer, at=None):
        ledger.read(f"{phase} {event} layer {layer}")
        marked(self, phase, event, layer, at)

    OffloadRunner._mark = mark
    runner = OffloadRunner(models.abstract_model(cfg, dtype), rc, loader)
    accel = runner.devices.accel
    ledger = Ledger(runner, args.gpu_memory)
    decode_programs = record_decode_programs(runner)
    ledger.read("built", keep=True)
    built_arrays = live_arrays(accel)
    for module, cls, name in WRAPPED:
        owner = importlib.import_module(module)
        ledger.wrap(getattr(owner, cls) if cls else owner, name, f"{cls + '.' if cls else ''}{name}")
    runner.set_policy(args.policy, {})
    runner.reset_calibration()
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.prompt_len)).astype(np.int32)
    repeats, failure = [], None
    try:  # under a held allocator (XLA_PYTHON_CLIENT_MEM_FRACTION) a run may fail: its ledger is kept
        ledger.read("warm-up starts", keep=True)
        runner.warmup(1, args.prompt_len, args.tokens)
        ledger.read("warm-up done", keep=True)
        for i in range(args.repeats):
            runner.reset_stats()
            ledger.read(f"repeat {i} starts", keep=True)
            out = runner.generate(prompt, args.tokens)
            ledger.read(f"repeat {i} done", keep=True)
            repeats.append({"prefill_tok_s": out.prefill_tokens_per_s, "decode_tok_s": out.decode_tokens_per_s})
            print(json.dumps(repeats[-1]), flush=True)
    except Exception as err:  # noqa: BLE001 (the stages read before it name where it failed)
        failure = {"error": f"{type(err).__name__}: {err}"[:2000],
                   "raised_in": ledger.raised_in, "last_read": ledger.last}
        print(json.dumps({"failure": failure}), flush=True)
    stats_end = accel.memory_stats()
    over = next((e for e in ledger.entries if e["over_budget"]), None)
    print(json.dumps({"bank_fills": fills, "decode_programs": decode_programs, "donations": donations}), flush=True)
    print(json.dumps({"budget": runner.budget.describe(), "first_over_budget": over,
                      "peak": ledger.peak, "gpu_memory": args.gpu_memory}), flush=True)
    for entry in ledger.entries:
        if entry["grew"] > 2**24 or entry["stage"].endswith(("starts", "done", "built")):
            print(json.dumps(entry), flush=True)
    return probe_result("the allocator's peak over a bench-like run, stage by stage (random weights)",
                        argparse.Namespace(accel=accel), ledger.entries, args.out, model=args.model,
                        policy=args.policy, workload=args.workload,
                        prompt_len=args.prompt_len, tokens=args.tokens, bank_fills=fills, decode_programs=decode_programs,
                        donations=donations,
                        budget=dict(runner.budget.lines()), first_over_budget=over, repeats=repeats, failure=failure,
                        live_arrays_built=built_arrays, live_arrays_end=live_arrays(accel),
                        slots=runner.pool.num_slots, decode_slots=runner.decode_slots, memory_stats_end=stats_end)


if __name__ == "__main__":
    main()
