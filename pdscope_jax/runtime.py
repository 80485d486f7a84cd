"""Runtime settings, kept apart from the model architecture (`pdscope_jax.config.ModelConfig`).

Contract: `RuntimeConfig` is frozen (and hashable while its policy options are). It says how a model runs on this
machine: the accelerator memory budget, the cap on the routed-expert slot pool, the expert-placement policy (a
planner name from `pdscope_jax.sched`, or None to run the model whole), CPU threads, prefill chunking, the largest
batch and sequence the KV cache is sized for, the token buckets that bound how many programs get compiled, the
planners' cost table, the hot-expert table (activation counts), two engine switches the ablation turns off
(`async_io`: transfers overlap compute; `batched_gpu`: one batched GPU program per layer) and the quality bound on
the precision of expert copies (`quality`, `mixed_threshold`: `sched.precision`).
Sizes are given as bytes or strings such as "24GB" (10^9), "24GiB" (2^30), "512MB", "1.5G"; a malformed size
raises `RuntimeConfigError` (an `errors.InputError`) naming the field and the accepted forms; a size must be
finite and positive (`expert_pool` may be 0: no slots). Every bad field is named in one error.

`select_devices()` is the one place that decides which device is the accelerator and which is the CPU
backend: the first GPU and the first CPU device when a GPU exists; otherwise, with two or more CPU devices
(tests set `jax_num_cpu_devices=2`), cpu:1 stands for the accelerator and cpu:0 for the CPU backend; with one
CPU device both roles fall on it. `select_accelerators(n)` extends it to the offload engine's n accelerators
(`request_cpu_stand_in(n)` asks for n + 1 CPU devices where no GPU exists). `allocator_peak(device, at_least)`:
the bytes its allocator has held at most so far in this process (it never goes down), or `at_least` where that is
more or the device reports none.

`hold_gpu_to_budget(gpu_memory)`, called by `load()` before JAX's backends start, makes XLA preallocate about the
budget (`PREALLOCATION_FACTOR` x budget + `PREALLOCATION_SLACK`) of the first GPU instead of its default 75 %.

`enable_compile_cache()` turns on JAX's persistent compilation cache (every compiled program, however small, is
written to disk and read back by later processes): by default in `compile_cache_dir()`, which is
`user_cache_dir("xla")` (`$XDG_CACHE_HOME`, else ~/.cache, then pdscope_jax/NAME: the package's caches); the
environment variable PDSCOPE_JAX_COMPILE_CACHE=0 turns it off, a path there chooses the directory. `load()` and the
CLI call it (`load(..., compile_cache=False)`, `--no-compile-cache`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import jax

from pdscope_jax import cuda_driver
from pdscope_jax.errors import InputError, collect

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class RuntimeConfigError(InputError):
    """A runtime setting that cannot be used (malformed size, unknown value, inconsistent fields)."""


def parse_size(value: int | float | str, field: str = "size") -> int:
    """'24GB' -> 24_000_000_000, '8GiB' -> 8 * 2**30, 1024 -> 1024 (any real number of bytes, numpy ones too).
    Raises RuntimeConfigError when malformed, negative, NaN or infinite."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise RuntimeConfigError(f"{field}: a size must be a finite number of bytes, got {value!r}")
        if value < 0:
            raise RuntimeConfigError(f"{field}: a size cannot be negative, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise RuntimeConfigError(f"{field}: expected a size such as '24GB' or a number of bytes, got "
                                 f"{type(value).__name__} {value!r}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise RuntimeConfigError(
            f"{field}: cannot read {value!r} as a size; write a number with an optional unit "
            "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '24GB' or '8GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """Bytes as a short human string in GB or MB (powers of 10, matching `parse_size`)."""
    if abs(nbytes) >= 10**9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _buckets(values: tuple[int, ...], field: str) -> tuple[int, ...]:
    try:
        ok = all(_is_int(v) for v in values)
    except TypeError:
        ok = False
    if not ok or not values or any(v <= 0 for v in values) or list(values) != sorted(set(values)):
        raise RuntimeConfigError(f"{field}: expected strictly increasing positive integer sizes, got {values!r}")
    return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    gpu_memory: int | str = "24GB"  # the whole accelerator budget: weights, KV cache, activations, expert slots
    expert_pool: int | str | None = None  # cap on the routed-expert slot pool (None: whatever the budget leaves)
    policy: str | None = None  # planner name (sched.make_planner); None runs the model whole
    policy_options: tuple[tuple[str, Any], ...] = ()  # extra planner options as sorted (key, value) pairs
    cpu_threads: int | None = None  # cores for the process: `bench` pins its affinity to them before JAX starts
    prefill_chunk: int = 256  # tokens per sequence per prefill step when the batch holds more than one sequence
    max_batch: int = 1  # the KV cache and activations are budgeted for this many sequences ...
    max_seq_len: int = 4096  # ... of this many tokens (prompt plus generated)
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # token counts of compiled decode programs
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    cpu_min_rows: int = 8  # CPU expert programs pad rows to at least this (XLA:CPU bf16 is slow at one row)
    cpu_kernel: bool = True  # the CPU expert kernel (kernels.cpu_ffn) for few-row steps, where built and supported
    cost_table: str | None = None  # name or path of a `pdscope-jax profile` table (sched.costs.find_cost_table)
    hot_table: str | None = None  # layer_stats.json or a trace directory: activation counts for hot experts
    async_io: bool = True  # stage transfers ahead of compute (False: wait for each right where it is issued)
    batched_gpu: bool = True  # one GPU program per layer for all GPU experts (False: one program per expert)
    device_decode: bool = True  # decode as one accelerator program per step where the policy allows it
    # (engine.device_decode; with async_io and batched_gpu on); False: the host plans every layer
    decode_bank: bool = True  # device decode adds slots in the memory prefill's activations and staging hold
    decode_bank_pieces: bool = False  # the decode bank as arrays of one layer's experts each (the shape of
    # prefill's staged stacks, whose freed memory they fit where the allocator is held and fragmented); False: one
    activation_memory: str = "measured"  # "measured": XLA's buffer assignment for the largest prefill step's
    # programs (engine.activations); "estimated": the formula of store.budget.activation_bytes (an upper bound)
    decode_cpu_experts: str = "auto"  # device decode computes part of a layer's misses on the host's CPU while
    # the rest are copied: "auto" through the CUDA bridge (kernels.host_experts) where it runs, else none (it
    # decoded faster than copying every miss on the H200: docs/MEASUREMENTS.md); "xla": XLA ops on the pinned
    # weights on any backend (tests); "off": every miss is copied
    decode_copy_share: float | None = None  # share of a layer's misses copied when the host computes the rest
    # (None: the host's time for an expert over the host's and the link's together: engine.host_split)
    decode_bridge_copies: bool = True  # device decode's copies are made by the CUDA bridge's worker (DMA) where
    # the bridge runs, so the step has no conditional per layer and the host runs ahead; False: by the program
    decode_zero_copy: bool | None = None  # device decode reads its misses from the store's page-locked stacks in
    # place (device-memory aliases, over PCIe: `ExpertStore.layer_device_views`) where the store has them (a CUDA
    # GPU, host_alloc "driver"). None (auto): only where the step then has no per-layer conditional, every miss the
    # GPU's (no host part, no bridge: a kernel keeps the misses worth keeping, the FFN reads the rest from host
    # memory, `device_decode._routed_in_place`); True: wherever views exist; False: the program copies misses from
    # pinned_host memory under a conditional on their count (docs/MEASUREMENTS.md)
    decode_copies_ahead: bool = False  # with the bridge's copies and a planner that reads next-layer scores,
    # each layer predicts the next one's experts (its router on this layer's input) and the worker copies them
    # ahead (off: on the H200 node the link was already busy, and the copies ahead slowed decode; MEASUREMENTS)
    decode_chunk: int | None = None  # device decode steps a program: >1 scans that many steps in one program, run as
    # XLA command buffers where a step has no bridge or host part (every miss copied by the program, or none missed:
    # `device_decode.EVERY_RESIDENT`; the whole model's chunks), else launched as issued; 1: a program a step; None:
    # 32 on a GPU unless XLA's host part computes misses (1.6-2.5x the decode of one step a program on the H200
    # without a host part, 1.04-1.07x with the CUDA bridge on the H100: docs/MEASUREMENTS.md), 1 elsewhere
    # (`engine.decode.chunk_steps`)
    decode_trial: int = 8  # where the planner chooses its decode mode (pdscope) and both executors can run a batch,
    # warm-up times this many decode steps of each (the one-program step, a program a step even where real runs
    # chunk it, and the host-planned loop) and decode runs the faster (`engine.decode_trial`); 0: the one-program
    # step wherever it can run
    quality: str | None = None  # the lowest precision a copy of an expert may load in (`sched.precision`): None
    # (the stored precision), "int8", "mixed" (int4 copies of light experts, the rest stored precision) or "int4"
    mixed_threshold: float = 1.0  # "mixed": a copy loads int4 when its expert's routing weight over the token's
    # mean top-k weight (predicted for prefetches) is below this (`sched.precision.DEFAULT_THRESHOLD`)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        problems: list[str] = []

        check = lambda fn, *args: collect(problems, fn, *args)  # noqa: E731
        size = check(parse_size, self.gpu_memory, "gpu_memory")
        if size is not None:
            set_("gpu_memory", size)
            if size <= 0:
                problems.append("gpu_memory must be positive")
        if self.expert_pool is not None:
            size = check(parse_size, self.expert_pool, "expert_pool")
            if size is not None:
                set_("expert_pool", size)
        if self.policy is not None and not isinstance(self.policy, str):
            problems.append(f"policy: expected a planner name or None, got {self.policy!r}")
        if isinstance(self.policy_options, dict):
            set_("policy_options", tuple(sorted(self.policy_options.items())))
        optional = ("cpu_threads", "decode_chunk")  # None stands for the default
        for name in ("prefill_chunk", "max_batch", "max_seq_len", "cpu_min_rows", *optional):
            value = getattr(self, name)
            if name in optional and value is None:
                continue
            if not _is_int(value) or value <= 0:
                problems.append(f"{name} must be a positive integer{' or None' if name in optional else ''}, "
                                f"got {value!r}")
            else:
                set_(name, int(value))
        if not _is_int(self.decode_trial) or self.decode_trial < 0:
            problems.append(f"decode_trial must be a non-negative integer, got {self.decode_trial!r}")
        else:
            set_("decode_trial", int(self.decode_trial))
        if self.activation_memory not in ("measured", "estimated"):
            problems.append(f"activation_memory: expected 'measured' or 'estimated', got {self.activation_memory!r}")
        if not isinstance(self.decode_bank_pieces, bool):
            problems.append(f"decode_bank_pieces: expected True or False, got {self.decode_bank_pieces!r}")
        if self.decode_zero_copy not in (None, True, False):
            problems.append(f"decode_zero_copy: expected None (auto), True or False, got {self.decode_zero_copy!r}")
        if self.decode_cpu_experts not in ("auto", "xla", "off"):
            problems.append(f"decode_cpu_experts: expected 'auto', 'xla' or 'off', got {self.decode_cpu_experts!r}")
        share = self.decode_copy_share
        if share is not None and (not isinstance(share, (int, float)) or not 0 <= share <= 1):
            problems.append(f"decode_copy_share must be between 0 and 1 or None, got {share!r}")
        from pdscope_jax.sched.precision import quality_value_problems, threshold_problems

        problems += quality_value_problems(self.quality) + threshold_problems(self.mixed_threshold)
        for name in ("decode_buckets", "prefill_buckets"):
            values = check(_buckets, getattr(self, name), name)
            if values is not None:
                set_(name, values)
        if problems:
            raise RuntimeConfigError("; ".join(problems), problems)

    @property
    def policy_kwargs(self) -> dict[str, Any]:
        return dict(self.policy_options)

    def replace(self, **changes: Any) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)


class Devices(NamedTuple):
    accel: jax.Device  # runs attention, the router and GPU-resident experts; holds the slot pool
    cpu: jax.Device  # the CPU backend: computes CPU-placed experts


def allocator_peak(device: jax.Device, at_least: int | None = None) -> int | None:
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return at_least if peak is None else max(int(peak), at_least or 0)


def request_cpu_stand_in(accelerators: int = 1) -> None:
    """Ask for CPU devices to stand in for `accelerators` accelerators (one more than that: device 0 is the CPU
    backend's) on machines without a GPU. Call before the first JAX computation; once backends have started (e.g.
    under pytest, whose conftest set two devices) the device count is fixed and this does nothing."""
    try:
        jax.config.update("jax_num_cpu_devices", max(accelerators + 1, jax.config.jax_num_cpu_devices))
    except RuntimeError:
        pass


def start_backends(xla_cpu_cores: int | None = None) -> None:
    """Start JAX's backends now. With `xla_cpu_cores`, XLA:CPU's compute threads (which size themselves from
    the cores the process may use when the backends start, and ignore XLA's thread flags) get the first that
    many cores, while the calling thread and every thread it starts later keep all of them: the host thread that
    drives the accelerator then never competes with the CPU experts' matmuls for a core. Does nothing to the
    thread pools when the backends have already started."""
    import os

    everything = os.sched_getaffinity(0)
    if xla_cpu_cores is not None:
        if not 0 < xla_cpu_cores <= len(everything):
            raise ValueError(f"xla_cpu_cores must lie in [1, {len(everything)}] (the cores this process may use), "
                             f"got {xla_cpu_cores}")
        os.sched_setaffinity(0, sorted(everything)[:xla_cpu_cores])
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, everything)


def select_devices() -> Devices:
    """The accelerator and the CPU backend (see the module docstring for the CPU-only stand-in)."""
    cpus, gpus = jax.devices("cpu"), _gpus()
    if gpus:
        return Devices(gpus[0], cpus[0])
    return Devices(cpus[1] if len(cpus) > 1 else cpus[0], cpus[0])


def select_accelerators(n: int) -> tuple[jax.Device, ...]:
    """The `n` accelerators the offload engine splits the routed experts over; the first is `select_devices()`'s.
    Without a GPU, CPU devices stand in: devices 1, 2, ... and then device 0 (the CPU backend's own) when the
    process has no more. Raises ValueError when the process has fewer than `n` devices of that kind."""
    cpus, gpus = jax.devices("cpu"), _gpus()
    pool = list(gpus) if gpus else cpus[1:] + cpus[:1]
    if not 0 < n <= len(pool):
        raise ValueError(f"{n} accelerators asked for, this process sees {len(pool)} "
                         f"({'GPUs' if gpus else 'CPU devices standing in'}): use 1 to {len(pool)}")
    return tuple(pool[:n])


def _gpus() -> list[jax.Device]:
    """This process's GPUs (none where jax has no GPU backend)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; beyond the last bucket, the next multiple of the last bucket."""
    for b in buckets:
        if n <= b:
            return b
    last = buckets[-1]
    return -(-n // last) * last


PREFILL_ROUND = 128  # a step capped at the KV cache's length is padded to a multiple of this


def prefill_rows(n: int, rc: RuntimeConfig, sequences: int) -> int:
    """Rows a prefill step of `n` tokens (the rows of its `sequences` sequences together) is padded to: the smallest
    prefill bucket >= n, but never past what their KV cache can hold, sequences x max_seq_len rounded up to
    PREFILL_ROUND (and never below n). So the largest step the budget reserves activations for is the cache's
    length, not the next bucket: at max_seq_len 4,160 (a 4,096-token prompt and 64 new tokens) 4,224 rows, not
    8,192. The engine pads a prompt (per sequence) and each step (its rows together) by this one rule, so a step
    is never padded past what its prompt was."""
    cap = -(-sequences * rc.max_seq_len // PREFILL_ROUND) * PREFILL_ROUND
    return min(bucket(n, rc.prefill_buckets), max(n, cap))


COMPILE_CACHE_ENV = "PDSCOPE_JAX_COMPILE_CACHE"  # 0/off/false/no: no cache; 1/on/unset: the default; else a path
COMPILE_CACHE_MAX_BYTES = 8 * 2**30  # least recently used programs go beyond this (jax's LRU cache, via filelock)
_OFF, _ON = {"0", "off", "false", "no"}, {"", "1", "on", "true", "yes"}


PREALLOCATION_FACTOR, PREALLOCATION_SLACK = 1.15, 1 << 30  # measured peaks at a 24 GB budget: 22.7-23.6 GB
PREALLOCATION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def hold_gpu_to_budget(gpu_memory: int) -> float | None:
    """Make XLA's GPU allocator preallocate `PREALLOCATION_FACTOR` x `gpu_memory` + `PREALLOCATION_SLACK` bytes of
    the first GPU (at most 90 %) instead of 75 % of it: a process given a budget takes about that much (the GPU
    may be shared, and a side by side at matching memory means it), and its start does not spend time
    preallocating the rest. Sets `PREALLOCATION_ENV` for this process, which XLA reads when the backends start.
    Does nothing where the user set it or XLA_PYTHON_CLIENT_PREALLOCATE=false, where JAX's backends already
    started (then it is too late), or where no CUDA driver answers. -> the fraction set, or None. A later call
    whose budget needs more than this process was held to raises `RuntimeConfigError` naming the fix."""
    global _held_bytes
    wanted = gpu_memory * PREALLOCATION_FACTOR + PREALLOCATION_SLACK
    from jax._src import xla_bridge  # private; absent, the backends count as started (nothing is changed)

    if getattr(xla_bridge, "backends_are_initialized", lambda: True)():
        if _held_bytes is not None and wanted > _held_bytes:
            raise RuntimeConfigError(
                f"gpu_memory {format_size(gpu_memory)}: this process's GPU allocator was held to "
                f"{format_size(_held_bytes)} for the budget of the first model it loaded; load the largest budget "
                f"first, or set {PREALLOCATION_ENV} (a share of the GPU) before the process starts JAX")
        return None
    if PREALLOCATION_ENV in os.environ or os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in _OFF:
        return None
    total = cuda_driver.total_memory()
    if not total:
        return None
    fraction = min(0.9, wanted / total)
    os.environ[PREALLOCATION_ENV] = f"{fraction:.4f}"
    _held_bytes = int(fraction * total)
    return fraction


_held_bytes: int | None = None  # what hold_gpu_to_budget held this process's GPU allocator to


def user_cache_dir(name: str) -> Path:
    """The package's user cache folder `name`: $XDG_CACHE_HOME/pdscope_jax/name, else ~/.cache/pdscope_jax/name."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdscope_jax" / name


def compile_cache_dir() -> Path:
    """The default persistent compilation cache: `user_cache_dir("xla")`."""
    return user_cache_dir("xla")


def enable_compile_cache(enabled: bool | str | Path = True) -> str | None:
    """Turn on JAX's persistent compilation cache for this process. -> its directory, or None when off.

    `enabled`: True (the directory PDSCOPE_JAX_COMPILE_CACHE names, else `compile_cache_dir()`), a directory, or
    False; PDSCOPE_JAX_COMPILE_CACHE=0 turns it off whatever `enabled` says. A cache directory already configured
    in this process (e.g. through JAX_COMPILATION_CACHE_DIR, or an earlier call) is kept as it is, and False
    never turns a configured cache off. Programs of any size and compile time are cached (jax's defaults skip
    those compiled in under a second, most of this project's); the directory holds at most
    COMPILE_CACHE_MAX_BYTES. A directory that cannot be created turns the cache off with a warning. Safe to call
    any number of times, before or after JAX has compiled anything."""
    configured = jax.config.jax_compilation_cache_dir
    setting = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if configured or enabled is False or setting.lower() in _OFF:
        return configured or None
    if enabled is not True:
        path = Path(enabled)
    else:
        path = compile_cache_dir() if setting.lower() in _ON else Path(setting)
    path = path.expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only home must not stop a run: it only compiles every time
        import warnings

        warnings.warn(f"compilation cache off: cannot create {path} ({err}); set {COMPILE_CACHE_ENV} to a writable "
                      "directory, or to 0 to silence this", stacklevel=2)
        return None
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # every entry (0 means jax's default)
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
    # jax decides whether to use the cache at its first compilation: start over, so a process that already
    # compiled something (without a cache) uses it from now on
    compilation_cache.reset_cache()
    return str(path)
