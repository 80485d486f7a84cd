"""Orbax checkpoints of a `PredictorSet`, tied to the model configuration they were trained for.

Contract
- `save_predictors(pset, model_cfg, root, corpus=..., metrics=...) -> Path` writes
  `<root>/<model name>/` holding `state/` (Orbax StandardCheckpointer, every (phase, layer) parameter
  tree) and `manifest.json` (format version, model name and `ModelConfig.fingerprint()`, corpus
  description, metrics, layer groups, MoE layers, architecture hyper-parameters, parameter bytes, and
  "files": the size and sha256 of every file under `state/`; the manifest is sealed with its own checksum,
  `integrity.seal`). Everything is written into a hidden temporary sibling and swapped into place only at
  the end (`integrity.swap_into_place`), so a process killed at any moment leaves the previous checkpoint
  loadable; temporaries of dead processes are removed by the next save.
- `load_predictors(path, model_cfg) -> (PredictorSet, manifest)`: `path` is a checkpoint directory or the
  root holding `<model name>/`. Before Orbax reads anything, the manifest's seal and every listed file's
  size and sha256 are checked; a temporary directory, a missing manifest or file, a corrupt byte anywhere,
  or a fingerprint different from `model_cfg.fingerprint()` (the message names both) raises
  `PredictorCheckpointError` naming the file, what is wrong and the fix (train again). Format 1 manifests
  (before checksums) still load, unchecked; hyper-parameters without `linear` mean a network without the path.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pdscope_jax.artifacts import integrity
from pdscope_jax.config import ModelConfig
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet

FORMAT_VERSION = 2
_LEGACY_VERSION = 1  # no checksums: loads unchecked
_TMP_MARK = ".tmp-"
REMEDY = "train the predictors again (`pdscope-jax train-predictors`) or restore the checkpoint from a copy"


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
    integrity.atomic_write_json(directory / "manifest.json", integrity.seal(manifest), indent=1)


def save_predictors(pset: PredictorSet, model_cfg: ModelConfig, root: str | Path = "predictors", *,
                    corpus: str = "", metrics: dict | None = None) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / checkpoint_name(model_cfg)
    integrity.recover(target)
    integrity.remove_stale(target)
    tmp = integrity.temp_sibling(target)
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
        "files": integrity.file_digests(tmp / "state"),
    }
    _write_manifest(tmp, manifest)
    integrity.swap_into_place(tmp, target)
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


def _read_manifest(directory: Path) -> dict:
    """The checked manifest of a checkpoint directory (seal, format, every state file's checksum)."""
    path = directory / "manifest.json"
    if not path.exists():
        raise PredictorCheckpointError(
            f"{directory} has no manifest.json: the checkpoint is incomplete (its save was interrupted); {REMEDY}")
    manifest = integrity.read_json(path, PredictorCheckpointError, REMEDY)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    integrity.check_seal(manifest, PredictorCheckpointError, path, REMEDY, required=version != _LEGACY_VERSION)
    if not manifest.get("complete"):
        raise PredictorCheckpointError(f"{directory}: manifest is not marked complete (interrupted save); {REMEDY}")
    if version not in (FORMAT_VERSION, _LEGACY_VERSION):
        raise PredictorCheckpointError(
            f"{directory}: checkpoint format {version} != supported {FORMAT_VERSION}; {REMEDY}")
    if version == FORMAT_VERSION:
        integrity.verify_files(directory / "state", manifest.get("files"), PredictorCheckpointError, REMEDY)
    return manifest


def load_predictors(path: str | Path, model_cfg: ModelConfig) -> tuple[PredictorSet, dict]:
    path = Path(path)
    for candidate in (path, path / checkpoint_name(model_cfg)):
        integrity.recover(candidate)  # a swap killed between its two renames
    directory = _resolve(path, model_cfg)
    manifest = _read_manifest(directory)
    want = model_cfg.fingerprint()
    if manifest.get("fingerprint") != want:
        raise PredictorCheckpointError(
            f"predictor checkpoint {directory} was trained for model fingerprint {manifest.get('fingerprint')} "
            f"({manifest.get('model_name') or 'unnamed'}), but the given ModelConfig has fingerprint {want} "
            f"({model_cfg.name or 'unnamed'}): pass that model's checkpoint, or train predictors for this one"
        )
    try:
        groups = (manifest["groups"]["input_end"], manifest["groups"]["middle_end"])
        hparams = {"linear": False, **manifest["hparams"]}  # checkpoints from before the linear path have none
        pset = PredictorSet(PredictorHParams(**hparams), manifest["moe_layers"], groups)
    except (KeyError, TypeError, ValueError) as err:
        raise PredictorCheckpointError(f"{directory}/manifest.json lacks or garbles {err}: {REMEDY}") from None
    abstract: dict[str, dict] = {}
    for phase, layer in pset.keys():
        p, l = _tree_key(phase, layer)
        abstract.setdefault(p, {})[l] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(pset.state(phase, layer))
        )
    try:
        restored = ocp.StandardCheckpointer().restore((directory / "state").absolute(), abstract)
    except Exception as err:  # noqa: BLE001 (checked files that Orbax still refuses: a legacy or edited checkpoint)
        raise PredictorCheckpointError(f"{directory}/state cannot be restored ({type(err).__name__}: "
                                       f"{str(err)[:300]}): {REMEDY}") from err
    for phase, layer in pset.keys():
        p, l = _tree_key(phase, layer)
        state = pset.state(phase, layer)
        nnx.replace_by_pure_dict(state, restored[p][l])
        pset.set_state(phase, layer, state)
    return pset, manifest
