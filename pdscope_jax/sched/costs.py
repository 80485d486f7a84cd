"""Cost table: what one expert costs on the CPU, on the GPU and over PCIe, as a function of its token count.

Contract: a `CostTable` is a frozen description of one model on one machine. Measured tables come from `pdscope-jax
profile` and are stored as JSON (`to_json` / `from_json`, `save` / `load`); `CostTable.analytic` builds one from first
principles (bytes, FLOPs, bandwidths) for tests and unprofiled machines, labelled `"source": "analytic"`. Planners read
it; nothing here touches a device. Times in seconds:
- `t_cpu(tokens)`: one expert at `tokens` tokens on the CPU, interpolated linearly between the measured token buckets;
  below the first bucket the first bucket's time, above the last scaled proportionally. Given a sequence of token counts
  it returns the sum (CPU experts run one after another, each on every core).
- `t_gpu(tokens)`: a *set* of experts run as ONE batched program: `gpu_expert_seconds` is one expert alone in a program,
  including the launch cost `gpu_launch_seconds`; a batch pays the launch once and each expert's marginal time
  `gpu_expert_seconds(t) - gpu_launch_seconds`. A scalar argument means a single expert.
- `t_transfer(n)`: n experts moved host -> GPU back to back: `alpha + n * t_io`, or the measured `transfer_seconds`
  curve when the profile has one (linear with slope `t_io` past its last point).
- `t_attn(phase, tokens)`: one layer's attention (GPU) for `tokens` tokens in `phase`.
- `precisions` (optional): per other precision of a copy (the int4 copy) a `PrecisionCosts` (t_io measured or scaled by
  bytes: `with_precision`; compute where measured); `transfer_ratio(name)` = its t_io over the table's.
Zero tokens (or an empty set, or n = 0 transfers) cost nothing.
JSON layout: `CostTable.to_dict`. A malformed file raises `CostTableError` naming every problem at once. `save` writes
atomically (a killed process leaves the old table) and seals the JSON with a "checksum" key (`integrity.seal`);
`from_dict` / `load` refuse a table whose content does not match its checksum (a table without one is read).
Where tables live: `costs_dir()` ($PDSCOPE_JAX_COSTS, else ~/.cache/pdscope_jax/costs) holds `<model>-<device>.json`
(`table_name`); `find_cost_table(ref)` / `load_cost_table(ref)` accept a path or such a name, so
`RuntimeConfig.cost_table` may be either.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pdscope_jax.artifacts import integrity

VERSION = 1
PHASES = ("prefill", "decode")
SOURCES = ("measured", "analytic")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class CostTableError(ValueError):
    """A cost table (or its JSON file) that cannot be used; the message lists every problem found."""


REMEDY = "measure it again with `pdscope-jax profile MODEL --out PATH`"


_BELOW = 1e-9   # token counts in (0, first bucket) cost the first bucket: a knot just above zero
_FAR = 1e9      # proportional extrapolation past the last bucket, as a far knot on the same ray


def _knots(buckets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knots that make one `np.interp` call implement the module docstring's regimes: 0 -> 0, (0, b0) -> v0,
    linear between buckets, proportional past the last bucket (exact up to _FAR times the last bucket)."""
    xp = np.concatenate(([0.0, _BELOW], buckets, [buckets[-1] * _FAR]))
    fp = np.concatenate(([0.0, values[0]], values, [values[-1] * _FAR]))
    return xp, fp


@dataclasses.dataclass(frozen=True)
class PrecisionCosts:
    """One expert whose copy is in another precision: host -> GPU seconds, and its compute times where measured."""

    t_io: float
    cpu_expert_seconds: tuple[float, ...] = ()  # per token bucket; () where not measured
    gpu_expert_seconds: tuple[float, ...] = ()
    source: str = "bytes"  # "measured", or "bytes": the table's t_io times the ratio of the stored bytes

    def to_dict(self) -> dict[str, Any]:
        return {"t_io": self.t_io, "cpu_expert_seconds": list(self.cpu_expert_seconds),
                "gpu_expert_seconds": list(self.gpu_expert_seconds), "source": self.source}


@dataclasses.dataclass(frozen=True)
class CostTable:
    token_buckets: tuple[int, ...]
    cpu_expert_seconds: tuple[float, ...]
    gpu_expert_seconds: tuple[float, ...]
    t_io: float
    alpha: float
    attn_prefill_seconds: tuple[float, ...]
    attn_decode_seconds: tuple[float, ...]
    gpu_launch_seconds: float = 0.0
    transfer_counts: tuple[int, ...] = ()
    transfer_seconds: tuple[float, ...] = ()
    source: str = "measured"
    model: str = ""
    meta: tuple[tuple[str, str], ...] = ()  # free-form provenance (command, date, machine), as string pairs
    precisions: tuple[tuple[str, PrecisionCosts], ...] = ()  # the precision axis (module docstring)
    _arrays: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def set_(name: str, value) -> None:  # frozen dataclass: normalise inputs once, here
            object.__setattr__(self, name, value)

        for name in ("token_buckets", "transfer_counts"):
            set_(name, tuple(int(v) for v in getattr(self, name)))
        for name in ("cpu_expert_seconds", "gpu_expert_seconds", "attn_prefill_seconds", "attn_decode_seconds",
                     "transfer_seconds"):
            set_(name, tuple(float(v) for v in getattr(self, name)))
        for name in ("t_io", "alpha", "gpu_launch_seconds"):
            set_(name, float(getattr(self, name)))
        set_("meta", tuple((str(k), str(v)) for k, v in (self.meta.items() if isinstance(self.meta, dict)
                                                            else self.meta)))
        set_("precisions", tuple(sorted((str(k), _precision_costs(v)) for k, v in (
            self.precisions.items() if isinstance(self.precisions, dict) else self.precisions))))
        problems = self._problems()
        if problems:
            raise CostTableError("invalid cost table:\n  " + "\n  ".join(problems))
        buckets = np.asarray(self.token_buckets, dtype=np.float64)
        gpu = np.asarray(self.gpu_expert_seconds)
        set_("_arrays", {
            "cpu": _knots(buckets, np.asarray(self.cpu_expert_seconds)),
            "gpu_marginal": _knots(buckets, np.maximum(gpu - self.gpu_launch_seconds, 0.0)),
            "prefill": _knots(buckets, np.asarray(self.attn_prefill_seconds)),
            "decode": _knots(buckets, np.asarray(self.attn_decode_seconds)),
            "xfer_counts": np.asarray(self.transfer_counts, dtype=np.float64),
            "xfer_seconds": np.asarray(self.transfer_seconds),
            # between 0 and the first measured count: from the start-up cost alpha
            "xfer_knots": np.concatenate(([0.0], self.transfer_counts)),
            "xfer_knot_seconds": np.concatenate(([self.alpha], self.transfer_seconds)),
        })

    def _problems(self) -> list[str]:
        p: list[str] = []
        b = self.token_buckets
        if not b:
            p.append("token_buckets is empty")
        elif b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])):
            p.append(f"token_buckets must be strictly increasing positive integers, got {list(b)}")
        for name in ("cpu_expert_seconds", "gpu_expert_seconds", "attn_prefill_seconds", "attn_decode_seconds"):
            values = getattr(self, name)
            if len(values) != len(b):
                p.append(f"{name} has {len(values)} values for {len(b)} token buckets")
            if any(not math.isfinite(v) or v < 0 for v in values):
                p.append(f"{name} must be finite and >= 0")
        if not (math.isfinite(self.t_io) and self.t_io > 0):
            p.append(f"t_io must be finite and > 0, got {self.t_io}")
        for name in ("alpha", "gpu_launch_seconds"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                p.append(f"{name} must be finite and >= 0, got {v}")
        if self.gpu_expert_seconds and self.gpu_launch_seconds > min(self.gpu_expert_seconds):
            p.append("gpu_launch_seconds exceeds the fastest one-expert GPU time (the launch is part of it)")
        c, s = self.transfer_counts, self.transfer_seconds
        if len(c) != len(s):
            p.append(f"transfer_counts has {len(c)} values, transfer_seconds {len(s)}")
        if c and (c[0] < 1 or any(x >= y for x, y in zip(c, c[1:]))):
            p.append(f"transfer_counts must be strictly increasing positive integers, got {list(c)}")
        if any(not math.isfinite(v) or v < 0 for v in s):
            p.append("transfer_seconds must be finite and >= 0")
        if self.source not in SOURCES:
            p.append(f"source must be one of {SOURCES}, got {self.source!r}")
        for name, c in self.precisions:
            if not (math.isfinite(c.t_io) and c.t_io > 0):
                p.append(f"precisions.{name}.t_io must be finite and > 0, got {c.t_io}")
            for part in ("cpu_expert_seconds", "gpu_expert_seconds"):
                values = getattr(c, part)
                if values and len(values) != len(b):
                    p.append(f"precisions.{name}.{part} has {len(values)} values for {len(b)} token buckets")
            if c.source not in ("measured", "bytes"):
                p.append(f"precisions.{name}.source must be 'measured' or 'bytes', got {c.source!r}")
        return p

    # ---- costs -------------------------------------------------------------------------------------------

    def cpu_times(self, tokens) -> np.ndarray:
        """Per-expert CPU seconds for an array of token counts (same shape)."""
        return np.interp(tokens, *self._arrays["cpu"])

    def gpu_marginals(self, tokens) -> np.ndarray:
        """Per-expert GPU seconds inside a batched program (launch excluded), same shape as `tokens`."""
        return np.interp(tokens, *self._arrays["gpu_marginal"])

    def t_cpu(self, tokens) -> float:
        """CPU seconds: one expert for a scalar, the sum over experts for a sequence of token counts."""
        return float(np.sum(self.cpu_times(tokens)))

    def t_gpu(self, tokens) -> float:
        """GPU seconds of one batched program over experts with these token counts (scalar: one expert)."""
        t = np.atleast_1d(np.asarray(tokens, dtype=np.float64))
        return float(self.gpu_growing(self.gpu_marginals(t[t > 0]), ())[0])

    def gpu_growing(self, base_marginals, added_marginals) -> np.ndarray:
        """[len(added) + 1]: entry m is the batched GPU time of the experts with marginals `base` + `added[:m]`
        (from `gpu_marginals`, every expert activated): the launch is paid once, when the set is non-empty."""
        base = np.asarray(base_marginals, dtype=np.float64)
        grow = np.cumsum(np.concatenate(([float(np.sum(base))], np.asarray(added_marginals, dtype=np.float64))))
        if base.size:
            return grow + self.gpu_launch_seconds
        grow[1:] += self.gpu_launch_seconds
        return grow

    def t_transfer(self, n):
        """Seconds to move n experts host -> GPU back to back (n scalar or array; 0 -> 0)."""
        a = self._arrays
        n_arr = np.asarray(n, dtype=np.float64)
        if a["xfer_counts"].size:
            last_n, last_s = a["xfer_counts"][-1], a["xfer_seconds"][-1]
            out = np.where(n_arr > last_n, last_s + (n_arr - last_n) * self.t_io,
                           np.interp(n_arr, a["xfer_knots"], a["xfer_knot_seconds"]))
        else:
            out = self.alpha + n_arr * self.t_io
        out = np.where(n_arr > 0, out, 0.0)
        return float(out) if out.ndim == 0 else out

    def t_attn(self, phase: str, tokens) -> float:
        """One layer's attention for `tokens` tokens in `phase` ("prefill" or "decode")."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return float(np.interp(tokens, *self._arrays[phase]))

    def transfer_ratio(self, precision: str) -> float:
        """Seconds to move one expert's copy in `precision` over those of the table's own copy."""
        costs = dict(self.precisions).get(precision)
        if costs is None:
            raise CostTableError(f"the cost table has no transfer time for {precision!r} copies (precisions: "
                                 f"{[k for k, _ in self.precisions] or 'none'}); add one with `with_precision`")
        return costs.t_io / self.t_io

    def with_precision(self, precision: str, *, t_io: float | None = None, bytes_ratio: float | None = None,
                       cpu_expert_seconds=(), gpu_expert_seconds=()) -> "CostTable":
        """This table with `precision` on its axis: a measured `t_io`, or the table's t_io times `bytes_ratio`
        (the stored bytes of such a copy over the table's). A precision already there is kept as it is."""
        if precision in dict(self.precisions):
            return self
        if t_io is None:
            costs = PrecisionCosts(self.t_io * float(bytes_ratio), tuple(cpu_expert_seconds),
                                   tuple(gpu_expert_seconds), "bytes")
        else:
            costs = PrecisionCosts(t_io, tuple(cpu_expert_seconds), tuple(gpu_expert_seconds), "measured")
        return dataclasses.replace(self, precisions=self.precisions + ((precision, costs),))

    def with_cpu_scale(self, factor: float) -> "CostTable":
        """This table with every CPU expert time multiplied by `factor` (the engine's in-situ calibration)."""
        return dataclasses.replace(self, cpu_expert_seconds=tuple(v * factor for v in self.cpu_expert_seconds))

    # ---- construction ------------------------------------------------------------------------------------

    @classmethod
    def analytic(cls, expert_bytes: float, flops_per_token: float, pcie_GBps: float, cpu_GFLOPs: float,
                 gpu_TFLOPs: float, *, alpha: float = 20e-6, cpu_mem_GBps: float = 100.0,
                 gpu_mem_GBps: float = 3000.0, cpu_floor_seconds: float = 20e-6, gpu_launch_seconds: float = 80e-6,
                 attn_flops_per_token: float = 0.0, token_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 model: str = "") -> "CostTable":
        """A roofline table: each expert costs max(FLOPs / peak, weight bytes / memory bandwidth) plus a floor.

        CPU: `cpu_floor_seconds + max(t * flops_per_token / cpu_GFLOPs, expert_bytes / cpu_mem_GBps)`.
        GPU: `gpu_launch_seconds + max(t * flops_per_token / gpu_TFLOPs, expert_bytes / gpu_mem_GBps)`.
        PCIe: `t_io = expert_bytes / pcie_GBps`, start-up `alpha`. Attention (both phases, on the GPU):
        `gpu_launch_seconds + t * attn_flops_per_token / gpu_TFLOPs`. An expert FFN does
        `flops_per_token = 6 * hidden * intermediate` (three matmuls, two FLOPs per multiply-add).
        """
        t = np.asarray(token_buckets, dtype=np.float64)
        cpu = cpu_floor_seconds + np.maximum(t * flops_per_token / (cpu_GFLOPs * 1e9),
                                             expert_bytes / (cpu_mem_GBps * 1e9))
        gpu = gpu_launch_seconds + np.maximum(t * flops_per_token / (gpu_TFLOPs * 1e12),
                                              expert_bytes / (gpu_mem_GBps * 1e9))
        attn = gpu_launch_seconds + t * attn_flops_per_token / (gpu_TFLOPs * 1e12)
        meta = {"expert_bytes": expert_bytes, "flops_per_token": flops_per_token, "pcie_GBps": pcie_GBps,
                "cpu_GFLOPs": cpu_GFLOPs, "gpu_TFLOPs": gpu_TFLOPs, "cpu_mem_GBps": cpu_mem_GBps,
                "gpu_mem_GBps": gpu_mem_GBps}
        return cls(token_buckets=tuple(token_buckets), cpu_expert_seconds=tuple(cpu), gpu_expert_seconds=tuple(gpu),
                   t_io=expert_bytes / (pcie_GBps * 1e9), alpha=alpha, attn_prefill_seconds=tuple(attn),
                   attn_decode_seconds=tuple(attn), gpu_launch_seconds=gpu_launch_seconds, source="analytic",
                   model=model, meta=meta)

    def to_dict(self) -> dict[str, Any]:
        """The JSON layout (version 1); every per-bucket list has one value per token bucket:
            {"version": 1, "source": "measured" | "analytic", "model": str, "token_buckets": [int, ...],
             "cpu_expert_seconds": [...], "gpu_expert_seconds": [...], "gpu_launch_seconds": float,
             "t_io": float, "alpha": float, "attn_seconds": {"prefill": [...], "decode": [...]},
             "transfer_counts": [int, ...], "transfer_seconds": [...], "meta": {...}}
        and, only where the table has a precision axis, "precisions": {name: {"t_io": float, "cpu_expert_seconds":
        [...] or [], "gpu_expert_seconds": [...] or [], "source": "measured" | "bytes"}}."""
        out = {
            "version": VERSION,
            "source": self.source,
            "model": self.model,
            "token_buckets": list(self.token_buckets),
            "cpu_expert_seconds": list(self.cpu_expert_seconds),
            "gpu_expert_seconds": list(self.gpu_expert_seconds),
            "gpu_launch_seconds": self.gpu_launch_seconds,
            "t_io": self.t_io,
            "alpha": self.alpha,
            "attn_seconds": {"prefill": list(self.attn_prefill_seconds), "decode": list(self.attn_decode_seconds)},
            "transfer_counts": list(self.transfer_counts),
            "transfer_seconds": list(self.transfer_seconds),
            "meta": dict(self.meta),
        }
        if self.precisions:
            out["precisions"] = {name: costs.to_dict() for name, costs in self.precisions}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: Any) -> "CostTable":
        if not isinstance(d, dict):
            raise CostTableError(f"a cost table is a JSON object, got {type(d).__name__}")
        required = ("version", "token_buckets", "cpu_expert_seconds", "gpu_expert_seconds", "t_io", "alpha",
                    "attn_seconds")
        optional = ("source", "model", "gpu_launch_seconds", "transfer_counts", "transfer_seconds", "meta",
                    "precisions", integrity.CHECKSUM_KEY)
        integrity.check_seal(d, CostTableError, "cost table", REMEDY, required=False)
        problems = [f"missing key {k!r}" for k in required if k not in d]
        problems += [f"unknown key {k!r}" for k in d if k not in required + optional]
        if "version" in d and d["version"] != VERSION:
            problems.append(f"version {d['version']!r} is not supported (this package reads version {VERSION})")
        attn = d.get("attn_seconds", {})
        if not isinstance(attn, dict) or set(attn) != set(PHASES):
            problems.append(f"attn_seconds must be an object with exactly the keys {list(PHASES)}")
            attn = {}
        if problems:
            raise CostTableError("malformed cost table:\n  " + "\n  ".join(problems))
        try:
            return cls(token_buckets=d["token_buckets"], cpu_expert_seconds=d["cpu_expert_seconds"],
                       gpu_expert_seconds=d["gpu_expert_seconds"], t_io=d["t_io"], alpha=d["alpha"],
                       attn_prefill_seconds=attn["prefill"], attn_decode_seconds=attn["decode"],
                       gpu_launch_seconds=d.get("gpu_launch_seconds", 0.0),
                       transfer_counts=d.get("transfer_counts", ()), transfer_seconds=d.get("transfer_seconds", ()),
                       source=d.get("source", "measured"), model=d.get("model", ""), meta=d.get("meta", {}),
                       precisions=d.get("precisions", {}))
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CostTableError):
                raise
            raise CostTableError(f"malformed cost table: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> "CostTable":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CostTableError(f"cost table is not valid JSON ({e}): it is corrupt or truncated: {REMEDY}") from e
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        """Write the sealed JSON atomically: the file at `path` is the old table or the new one, never a mix."""
        integrity.remove_stale(Path(path))  # temporaries of a killed earlier save
        integrity.atomic_write_json(path, integrity.seal(self.to_dict()), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        d = integrity.read_json(Path(path), CostTableError, REMEDY)  # its messages name the path
        try:
            return cls.from_dict(d)
        except CostTableError as e:
            raise CostTableError(f"{path}: {e}") from None


def _precision_costs(value) -> PrecisionCosts:
    """A `PrecisionCosts` from itself or its JSON object (TypeError / ValueError when malformed)."""
    if isinstance(value, PrecisionCosts):
        value = value.to_dict()
    unknown = set(value) - {"t_io", "cpu_expert_seconds", "gpu_expert_seconds", "source"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in a precision's costs")
    return PrecisionCosts(float(value.get("t_io")), tuple(float(v) for v in value.get("cpu_expert_seconds", ())),
                          tuple(float(v) for v in value.get("gpu_expert_seconds", ())),
                          str(value.get("source", "measured")))


# ---- where measured tables live ------------------------------------------------------------------------------

COSTS_DIR_ENV = "PDSCOPE_JAX_COSTS"


def costs_dir() -> Path:
    """The cost-table directory: $PDSCOPE_JAX_COSTS, else ~/.cache/pdscope_jax/costs."""
    import os

    return Path(os.environ.get(COSTS_DIR_ENV) or Path.home() / ".cache" / "pdscope_jax" / "costs")


def table_name(model: str, device: str) -> str:
    """`<model>-<device>` with anything but letters, digits, '.', '_' and '-' turned into '-'."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{model}-{device}")


def find_cost_table(ref: str | Path) -> Path:
    """A cost table's file from a path, or from a name in `costs_dir()` (`<name>` or `<name>.json`)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    for candidate in (costs_dir() / str(ref), costs_dir() / f"{ref}.json"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in costs_dir().glob("*.json")) if costs_dir().is_dir() else []
    raise CostTableError(f"no cost table {str(ref)!r}: not a file, and not in {costs_dir()} "
                         f"(known: {', '.join(known) or 'none'}); make one with `pdscope-jax profile`")


def load_cost_table(ref: str | Path) -> CostTable:
    """`CostTable.load(find_cost_table(ref))`: RuntimeConfig.cost_table may be a name or a path."""
    return CostTable.load(find_cost_table(ref))
