"""PhasePer: per-layer, per-phase predictors of the next MoE layer's experts.

Independent of the model code: everything works on arrays.
- `traces`: trace records (a, w, e per layer and phase) written with bounded memory, read back aligned.
- `groups`: input / middle / output layer groups from inter-layer similarity.
- `predictor`: the NNX networks and `PredictorSet` (jitted forward per layer and phase).
- `losses`: the paper's losses from logits.
- `train`: offline training with validation, early stopping, recall@k and Table-5 metrics.
- `checkpoint`: Orbax save/restore bound to a `ModelConfig` fingerprint.
- `finetune`: online fine-tuning on a background thread.
"""

from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError, load_predictors, save_predictors
from pdscope_jax.phaseper.finetune import ErrorWindow, OnlineFineTuner
from pdscope_jax.phaseper.groups import detect_groups, group_of, groups_from_traces, layer_similarity, plot_groups
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.phaseper.traces import PHASES, TraceWriter, Traces, load_traces
from pdscope_jax.phaseper.train import TrainConfig, evaluate_predictors, train_predictors

__all__ = [
    "PHASES",
    "ErrorWindow",
    "OnlineFineTuner",
    "PredictorCheckpointError",
    "PredictorHParams",
    "PredictorSet",
    "TraceWriter",
    "Traces",
    "TrainConfig",
    "detect_groups",
    "evaluate_predictors",
    "group_of",
    "groups_from_traces",
    "layer_similarity",
    "load_predictors",
    "load_traces",
    "plot_groups",
    "save_predictors",
    "train_predictors",
]
