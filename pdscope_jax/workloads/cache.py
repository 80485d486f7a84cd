"""A disk cache of fitted routing workloads: `routing.design` fits in numpy for tens of seconds on a real preset
(the angle and affinity bisections refit offsets many times), the same at every start for the same inputs.

Contract
- `cache_folder(setting)`: where designs are kept, or None (off). `setting`: False (off), a folder, or None /
  True: the environment variable `ENV` ("0", "off", "false", "no": off; another value: that folder), else
  `$XDG_CACHE_HOME/pdscope_jax/workloads`, else `~/.cache/pdscope_jax/workloads`.
- `design_key(cfg, name, seed, channel, calibration, setting, fates, stats)`: a hex digest of everything the fit
  reads: the config fields it uses (`CONFIG_FIELDS`), the workload, seed, channel width, calibration size,
  predictability setting, the per-pair target recalls (which carry the reference predictability file's values),
  the reference routing statistics' content (the skewed workload's; None for uniform), `DESIGN_VERSION` (raised
  whenever the fit changes what it produces) and numpy's version (its random streams).
- `load(path, cfg)` -> the saved fields of `Workload` (without `cfg`), or None when the file is missing or
  unreadable, or does not fit `cfg` (such a file is then rewritten by the caller).
- `save(path, workload)`: the workload's arrays and report in one .npz, written to a temporary file in the same
  folder and renamed over `path` (readers see the old file or the new one, never a part), so concurrent writers
  of the same key are safe. A folder that cannot be written leaves the design uncached, not failed.
Nothing here is pickled: arrays are plain numpy, the report and layout are JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from pdscope_jax.runtime import user_cache_dir

ENV = "PDSCOPE_WORKLOAD_CACHE"
DESIGN_VERSION = 2
CONFIG_FIELDS = ("num_experts", "num_experts_per_tok", "moe_layers", "hidden_size", "vocab_size",
                 "tie_word_embeddings")
_OFF = ("0", "off", "false", "no")


def cache_folder(setting: bool | str | Path | None = None) -> Path | None:
    if setting is False:
        return None
    if setting not in (None, True):
        return Path(setting).expanduser()
    configured = os.environ.get(ENV)
    if configured is not None and configured.strip().lower() in _OFF:
        return None
    if configured:
        return Path(configured).expanduser()
    return user_cache_dir("workloads")


def design_key(cfg, name: str, seed: int, channel: int, calibration: int, setting, fates: list,
               stats: dict | None) -> str:
    inputs = {"version": DESIGN_VERSION, "numpy": np.__version__, "workload": name, "seed": seed,
              "channel": channel, "calibration": calibration, "predictability": setting, "fates": fates,
              "config": {field: _plain(getattr(cfg, field)) for field in CONFIG_FIELDS}, "stats": stats}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=_plain).encode()).hexdigest()[:32]


def path_for(folder: Path, cfg, key: str) -> Path:
    stem = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(cfg.name))
    return folder / f"{stem}-{key}.npz"


def save(path: Path, workload) -> None:
    arrays = {"codes": workload.codes}
    if workload.successor is not None:
        arrays["successor"] = workload.successor
    arrays.update({f"rows_{layer}": rows for layer, rows in workload.rows.items()})
    arrays.update({f"masks_{layer}": mask for layer, mask in workload.masks.items()})
    meta = {"name": workload.name, "channel": workload.channel, "report": workload.report,
            "predictability": workload.predictability, "layout": workload.layout,
            "rows": list(workload.rows), "masks": list(workload.masks)}
    arrays["meta"] = np.array(json.dumps(meta, default=_plain))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    except OSError:
        return  # an unwritable cache costs the next start a fit, nothing else
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **arrays)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def load(path: Path, cfg) -> dict | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            fields = {"name": meta["name"], "channel": int(meta["channel"]), "codes": saved["codes"],
                      "rows": {int(layer): saved[f"rows_{layer}"] for layer in meta["rows"]},
                      "masks": {int(layer): saved[f"masks_{layer}"] for layer in meta["masks"]},
                      "report": meta["report"], "predictability": meta["predictability"], "layout": meta["layout"],
                      "successor": saved["successor"] if "successor" in saved.files else None}
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
        return None
    e, c = cfg.num_experts, fields["channel"]
    fits = (fields["codes"].shape == (cfg.vocab_size, c) and sorted(fields["rows"]) == sorted(cfg.moe_layers)
            and all(rows.shape == (c, e) for rows in fields["rows"].values())
            and all(mask.shape == (c,) for mask in fields["masks"].values())
            and (fields["successor"] is None) == bool(cfg.tie_word_embeddings)
            and (fields["successor"] is None or fields["successor"].shape == (cfg.vocab_size,)))
    return fields if fits else None


def _plain(value):
    """JSON for what the fit's inputs and report hold besides JSON types: numpy scalars and arrays, tuples."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, tuple, range)):
        return np.asarray(value).tolist()
    if isinstance(value, (list, dict, str, int, float, bool)) or value is None:
        return value
    raise TypeError(f"cannot key a workload design on {type(value).__name__}")
