"""Orbax checkpoints of a `PredictorSet`, tied to the model configuration they were trained for.

Contract
- `save_predictors(pset, model_cfg, root, corpus=..., metrics=...) -> Path` writes
  `<root>/<model name>/` holding `state/` (Orbax StandardCheckpointer, every (phase, layer) parameter
  tree) and `manifest.json` (format version, model name and `ModelConfig.fingerprint()`, corpus
  description, metrics, layer groups, MoE layers, architecture hyper-parameters, parameter bytes).
  Everything is written into a hidden temporary sibling `.<name>.tmp-<id>` and renamed into place only at
  the end, manifest last, so an interrupted save never looks like a checkpoint. An older checkpoint of the
  same name is replaced.
- `load_predictors(path, model_cfg) -> (PredictorSet, manifest)`: `path` is a checkpoint directory or the
  root holding `<model name>/`. A temporary directory, a directory without `manifest.json`, or a manifest
  not marked complete raises `PredictorCheckpointError` saying the save was interrupted. A fingerprint
  different from `model_cfg.fingerprint()` raises an error naming both fingerprints (and model names).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet

FORMAT_VERSION = 1
_TMP_MARK = ".tmp-"


class PredictorCheckpointError(RuntimeError):
    """A predictor checkpoint that is missing, unfinished, or made for another model."""


def checkpoint_name(model_cfg: ModelConfig) -> str:
    return model_cfg.name or f"model-{model_cfg.fingerprint()}"


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def _tree_key(phase: str, layer: int) -> tuple[str, str]:
    return phase, f"layer{layer}"


def _write_manifest(directory: Path, manifest: dict) -> None:
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


def save_predictors(pset: PredictorSet, model_cfg: ModelConfig, root: str | Path = "predictors", *,
                    corpus: str = "", metrics: dict | None = None) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(model_cfg)
    target = root / name
    tmp = root / f".{name}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    tree: dict[str, dict] = {}
    for phase, layer in pset.keys():
        p, l = _tree_key(phase, layer)
        tree.setdefault(p, {})[l] = nnx.to_pure_dict(pset.state(phase, layer))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((tmp / "state").absolute(), tree)
    checkpointer.wait_until_finished()
    manifest = {
        "format_version": FORMAT_VERSION,
        "complete": True,
        "model_name": model_cfg.name,
        "fingerprint": model_cfg.fingerprint(),
        "corpus": corpus,
        "created_unix": time.time(),
        "moe_layers": list(pset.moe_layers),
        "groups": {"input_end": pset.groups[0], "middle_end": pset.groups[1]},
        "hparams": pset.hp.to_dict(),
        "param_bytes": pset.sizes(),
        "metrics": _json_safe(metrics or {}),
    }
    _write_manifest(tmp, manifest)
    old = None
    if target.exists():
        old = root / f".{name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old)
    return target


def _resolve(path: Path, model_cfg: ModelConfig) -> Path:
    if _TMP_MARK in path.name:
        raise PredictorCheckpointError(f"{path} is the temporary directory of an unfinished save; it is never loaded")
    if (path / "manifest.json").exists() or (path / "state").exists():
        return path
    candidate = path / checkpoint_name(model_cfg)
    if candidate.exists():
        return candidate
    if path.is_dir() and any(_TMP_MARK in p.name for p in path.iterdir()):
        raise PredictorCheckpointError(
            f"no predictor checkpoint for {checkpoint_name(model_cfg)!r} under {path}: only the temporary "
            "directory of an interrupted save is there (ignored)"
        )
    raise PredictorCheckpointError(f"no predictor checkpoint at {path} (nor {candidate})")


def load_predictors(path: str | Path, model_cfg: ModelConfig) -> tuple[PredictorSet, dict]:
    directory = _resolve(Path(path), model_cfg)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except FileNotFoundError:
        raise PredictorCheckpointError(
            f"{directory} has no manifest.json: the checkpoint is incomplete (its save was interrupted)"
        ) from None
    if not manifest.get("complete"):
        raise PredictorCheckpointError(f"{directory}: manifest is not marked complete (interrupted save)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PredictorCheckpointError(
            f"{directory}: checkpoint format {manifest.get('format_version')} != supported {FORMAT_VERSION}"
        )
    want = model_cfg.fingerprint()
    if manifest["fingerprint"] != want:
        raise PredictorCheckpointError(
            f"predictor checkpoint {directory} was trained for model fingerprint {manifest['fingerprint']} "
            f"({manifest.get('model_name') or 'unnamed'}), but the given ModelConfig has fingerprint {want} "
            f"({model_cfg.name or 'unnamed'})"
        )
    groups = (manifest["groups"]["input_end"], manifest["groups"]["middle_end"])
    pset = PredictorSet(PredictorHParams(**manifest["hparams"]), manifest["moe_layers"], groups)
    abstract: dict[str, dict] = {}
    for phase, layer in pset.keys():
        p, l = _tree_key(phase, layer)
        abstract.setdefault(p, {})[l] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(pset.state(phase, layer))
        )
    restored = ocp.StandardCheckpointer().restore((directory / "state").absolute(), abstract)
    for phase, layer in pset.keys():
        p, l = _tree_key(phase, layer)
        state = pset.state(phase, layer)
        nnx.replace_by_pure_dict(state, restored[p][l])
        pset.set_state(phase, layer, state)
    return pset, manifest
