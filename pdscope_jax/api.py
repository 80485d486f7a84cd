"""`load()` and the `Runner`: the public entry point.

`load(name_or_path, weights=None, seed=0, dtype="bfloat16", policy=None, predictors=None, revision=None,
compile_cache=True, quantize=None, quant_cache=True, accelerators=None, **runtime)`:
- Resolves, in order: a preset name (`presets`: random weights, or `weights=` a directory of its safetensors); an
  embedded checkpoint (`EMBEDDED`: "reference-moe", the default); a directory with config.json (its safetensors,
  or `weights="random"`); an "org/name" in the local Hugging Face cache (`refs/main`, or `revision=`; nothing is
  downloaded: `pdscope-jax download`). Else `UnknownModelError` listing the known names.
- No `policy`: the model runs whole (`Runner`) on the default device, or its routed experts split E/N over the
  first N devices (`accelerators=N`, `parallel.expert_parallel`; N divides E).
- A policy (`sched.POLICIES`): the offload engine (`engine.runner.OffloadRunner`; over N accelerators with
  `accelerators=N`, each owning E/N experts of every layer: `engine.shards`) under the
  `RuntimeConfig` of `policy` and `**runtime` (`gpu_memory`, `expert_pool`, `max_batch`, `max_seq_len`, ...),
  with the plain model's numbers (float32 logits within 1e-4; bf16 within its rounding: README). Called before
  JAX's backends start, it holds XLA's GPU preallocation to about `gpu_memory` (`runtime.hold_gpu_to_budget`).
- `predictors`: a PhasePer checkpoint (this model's fingerprint) for the planner. `quantize="int8" | "int4"`:
  routed experts stored quantized as they load (`quant`; from a checkpoint through a cache keyed by its
  fingerprint, `quant_cache=False` off, a directory there). `quality=` (runtime): the lowest precision of an
  expert's copy (docs/PRECISION.md). `compile_cache`: the persistent compilation cache (False off, a directory).
- Validates first: dtype, seed, policy, runtime settings and quantize / quality before any weight is read; ids
  (integers in [0, vocab) before any cast), shapes, sampling and the engine's max_batch / max_seq_len before any
  compilation. Every bad input raises one `errors.InputError` (a ValueError) naming each problem.
`Runner.logits(input_ids) -> np.float32 [B,T,V]`, `.generate(input_ids | text, ...)`, `.steps(...)` (one step per
`next`): rectangular batches; text needs the checkpoint's tokenizer.json; sampling keywords are `SamplingParams`'
fields. `.config` (ModelConfig), `.tokenizer` (or None), `.model` (plain) or `.engine` and `.startup_seconds`
(offloaded).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pdscope_jax import models
from pdscope_jax.config import ModelConfig
from pdscope_jax.errors import collect, raise_problems
from pdscope_jax.generation.generator import GenerationResult, Generator, check_request, host_steps, seed_problems
from pdscope_jax.models.layers import CausalLM
from pdscope_jax.presets import UnknownModelError, known_names, preset
from pdscope_jax.quant.cache import cached_quantizing_loader
from pdscope_jax.quant.formats import SCHEMES, scheme
from pdscope_jax.quant.loader import quantizing_loader
from pdscope_jax.sched.precision import quality_problems
from pdscope_jax.text.tokenizer import Tokenizer
from pdscope_jax.weights.checkpoint import checkpoint_loader, open_checkpoint
from pdscope_jax.weights.random_init import random_state

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
ASSETS = Path(__file__).parent / "assets"
EMBEDDED = {"reference-moe": ASSETS / "reference-moe"}  # checkpoints shipped inside the package


class Runner:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer | None = None,
                 input_sharding: jax.sharding.Sharding | None = None):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self._generator = Generator(model, input_sharding)

    _limits: dict = {}  # max_batch / max_seq_len the engine was sized for (none for the whole model)
    startup_seconds: dict = {}  # the offload engine's build stages (`OffloadRunner.startup_seconds`); none here

    def logits(self, input_ids):
        ids = check_request(input_ids, self.tokenizer, self.config.vocab_size, what="logits", **self._limits)
        return self._generator.logits(ids)

    checkpoint: Path | None = None  # the checkpoint directory (tokenizer, chat template), None for random weights

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, **sampling) -> GenerationResult:
        ids = check_request(input_ids, self.tokenizer, self.config.vocab_size, max_new_tokens, temperature, top_k,
                            seed, **self._limits, **sampling)
        result = self._generator.generate(ids, max_new_tokens, temperature, top_k, seed, **sampling)
        if self.tokenizer is not None:
            result.text = [self.tokenizer.decode(row) for row in result.tokens]
        return result

    def steps(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
              seed: int = 0, **sampling):
        """`generate` one step at a time: checks now, then yields each step's host `generation.sampling.Sampled`
        (token [B], logprobs); close it to stop early. EOS does not stop it: the caller decides."""
        ids = check_request(input_ids, self.tokenizer, self.config.vocab_size, max_new_tokens, temperature, top_k,
                            seed, **self._limits, **sampling)
        return host_steps(self._generator.steps(ids, max_new_tokens, temperature, top_k, seed, **sampling))


def hf_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache is, as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    if os.environ.get("HF_HOME"):
        return [Path(os.environ["HF_HOME"]) / "hub"]
    return [Path.home() / ".cache" / "huggingface" / "hub"]


def find_in_hf_cache(name: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of hub repo `name` ("org/name") that holds config.json, or None when the repo is
    not cached. The snapshot is the one `refs/<revision>` names (default `main`, what `huggingface_hub` writes
    on download), or `revision` itself when it is a cached commit hash. A cached repo without that ref (e.g.
    copied by hand) falls back to its only snapshot; with several and no ref the choice would be a guess, so it
    raises UnknownModelError naming the snapshots and how to pick one (`revision=`, `--revision`)."""
    folder = "models--" + name.replace("/", "--")
    for root in hf_cache_dirs():
        repo = root / folder
        snapshots = sorted(s for s in (repo / "snapshots").glob("*") if (s / "config.json").exists())
        if not snapshots:
            continue
        ref = repo / "refs" / (revision or "main")
        wanted = ref.read_text().strip() if ref.is_file() else revision
        if wanted is not None:
            match = [s for s in snapshots if s.name == wanted]
            if match:
                return match[0]
            raise UnknownModelError(
                f"{name}: revision {revision or 'main'!r} ({wanted}) is not among the cached snapshots with "
                f"config.json in {repo / 'snapshots'} ({', '.join(s.name for s in snapshots)}); download it "
                f"(`pdscope-jax download {name}`) or pass one of the cached commits as the revision")
        if len(snapshots) == 1:
            return snapshots[0]
        raise UnknownModelError(
            f"{name}: {repo} has no refs/main and {len(snapshots)} snapshots ({', '.join(s.name for s in snapshots)});"
            " pass the commit to use as revision= (CLI: --revision), or pass the snapshot directory itself")
    return None


def resolve(name_or_path: str, revision: str | None = None) -> tuple[ModelConfig, Path | None]:
    """(config, checkpoint directory or None for a preset) of a name or path; see the module docstring.
    `revision` (a branch, tag or commit of a Hugging Face hub repo) only applies to hub names."""
    try:
        return preset(name_or_path), None
    except UnknownModelError:
        pass
    path = EMBEDDED.get(name_or_path) or Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return ModelConfig.from_json(path / "config.json"), path
    snapshot = find_in_hf_cache(name_or_path, revision)
    if snapshot is not None:
        return ModelConfig.from_json(snapshot / "config.json", name=name_or_path), snapshot
    where = ", ".join(str(d) for d in hf_cache_dirs())
    fetch = f"; fetch it with `pdscope-jax download {name_or_path}`" if name_or_path.count("/") == 1 else ""
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: not a preset, not a directory with config.json, not in the Hugging Face "
        f"cache ({where}){fetch}; known names: {', '.join([*EMBEDDED, *known_names()])}")


def load(name_or_path: str, weights: str | None = None, seed: int = 0, dtype: str = "bfloat16",
         policy: str | None = None, predictors: str | Path | None = None, revision: str | None = None,
         compile_cache: bool | str | Path = True, quantize: str | None = None,
         quant_cache: bool | str | Path = True, accelerators: int | None = None, **runtime):
    rc = check_load(dtype, seed, policy, predictors, runtime, quantize, accelerators)  # before anything is read
    if rc is not None:
        from pdscope_jax.runtime import hold_gpu_to_budget

        hold_gpu_to_budget(rc.gpu_memory)
    cfg, checkpoint = resolve(str(name_or_path), revision)
    if quantize is not None:
        check_quantizable(cfg, quantize)  # the config alone tells: before any weight is opened
    mesh = None
    if accelerators not in (None, 1):  # the experts split evenly, or an error before any weight is read
        from pdscope_jax.parallel import expert_mesh, split_size

        split_size(cfg.num_experts, accelerators)
        if rc is None:  # the whole model over this process's first N devices (the offload engine picks its own)
            mesh = expert_mesh(jax.devices()[:accelerators])
    from pdscope_jax.runtime import enable_compile_cache

    enable_compile_cache(compile_cache)
    if weights == "random":
        checkpoint = None
    elif weights is not None:
        checkpoint = Path(weights)
    jdtype = DTYPES[dtype]
    dense_shapes = models.abstract_state(cfg, jdtype)
    if checkpoint is None:
        loader = lambda paths, placement: random_state({p: dense_shapes[p] for p in paths}, seed,  # noqa: E731
                                                       placement)
    else:
        ckpt = open_checkpoint(checkpoint)
        loader = checkpoint_loader(ckpt, models.checkpoint_sources(cfg), dense_shapes)
    shapes = dense_shapes
    if quantize is not None:  # the dense loader's experts are quantized as they arrive (quant.loader)
        if checkpoint is not None and quant_cache is not False:  # once, then read back (quant.cache)
            loader = cached_quantizing_loader(loader, quantize, ckpt, cfg.name, dense_shapes,
                                              None if quant_cache is True else quant_cache)
        else:
            loader = quantizing_loader(loader, quantize)
        cfg = cfg.replace(expert_quant=quantize)
        shapes = models.abstract_state(cfg, jdtype)
    tokenizer = None if checkpoint is None else Tokenizer.from_dir(checkpoint)
    if rc is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        model = models.from_flat(cfg, jdtype, loader(list(shapes), lambda path: device))
        inputs = None
        if mesh is not None:  # the experts split over the mesh, everything else and the inputs replicated
            from pdscope_jax.parallel import expert_parallel

            model = expert_parallel(model, mesh)
            inputs = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        runner = Runner(model, tokenizer, inputs)
        runner.checkpoint = checkpoint
        return runner
    from pdscope_jax.engine.runner import OffloadRunner

    predictor = None
    if predictors is not None:
        from pdscope_jax.phaseper.checkpoint import load_predictors

        from pdscope_jax.runtime import select_devices

        predictor, _manifest = load_predictors(predictors, cfg)
        predictor.to_device(select_devices().accel)  # it reads the hidden states where the model computes them
    engine = OffloadRunner(models.abstract_model(cfg, jdtype), rc, loader, predictor=predictor,
                           accelerators=accelerators or 1)
    runner = OffloadedRunner(engine, tokenizer)
    runner.checkpoint = checkpoint
    return runner


def quantize_problems(cfg: ModelConfig, quantize: str) -> list[str]:
    """Why the model's expert matrices cannot take the scheme `quantize` (a known name); empty when they can."""
    s = scheme(quantize)
    return [p for k in {cfg.hidden_size, cfg.moe_intermediate_size} if (p := s.check(k))]


def check_quantizable(cfg: ModelConfig, quantize: str) -> None:
    """Raise InputError naming `quantize_problems` when there are any."""
    raise_problems(quantize_problems(cfg, quantize), "load")


def accelerator_problems(accelerators, policy) -> list[str]:
    """Why `accelerators` cannot be used as given (empty when it can; None means one device, unsplit)."""
    if accelerators is None:
        return []
    if isinstance(accelerators, bool) or not isinstance(accelerators, int) or accelerators < 1:
        return [f"accelerators must be a positive integer (devices to split the experts over), got {accelerators!r}"]
    available = len(jax.devices())
    problems = []
    if accelerators > available:
        problems.append(f"accelerators={accelerators}, but this process sees {available} device(s) "
                        f"({jax.devices()[0].platform}); use at most {available}")
    return problems


def check_load(dtype, seed, policy, predictors, runtime: dict, quantize=None, accelerators=None):
    """The RuntimeConfig of a `load` call (None without a policy), after checking every setting at once."""
    import dataclasses

    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.sched import check_policy

    problems = []
    if quantize is not None and quantize not in SCHEMES:
        problems.append(f"quantize {quantize!r} is not a scheme; supported: {', '.join(SCHEMES)} (or None: the "
                        "experts stay in the model's dtype)")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        problems.append(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    problems += seed_problems(seed)
    problems += accelerator_problems(accelerators, policy)
    if policy is None:
        if runtime or predictors is not None:
            problems.append(f"{', '.join([*runtime, *(['predictors'] if predictors else [])])} only apply with a "
                            "policy (e.g. policy='pdscope'); without one the model runs whole")
        raise_problems(problems, "load")
        return None
    collect(problems, check_policy, policy)
    fields = {f.name for f in dataclasses.fields(RuntimeConfig)} - {"policy"}
    unknown = sorted(set(runtime) - fields)
    if unknown:
        problems.append(f"unknown runtime settings {unknown}; known: {', '.join(sorted(fields))}")
    rc = collect(problems, RuntimeConfig, policy=policy if isinstance(policy, str) else None,
                 **{k: v for k, v in runtime.items() if k in fields})
    if rc is not None and quantize in (None, *SCHEMES):
        problems += quality_problems(rc.quality, quantize)
    raise_problems(problems, "load")
    return rc.replace(policy=policy)


class OffloadedRunner(Runner):
    """The `Runner` calls over the offload engine; `engine.stats` holds the per-phase figures.

    As with the plain model, timings exclude compilation: the first `generate` of a shape (batch, prompt length and
    KV cache length: `engine.program_shape`) runs the engine's warm-up for it first (which also starts the slot pool
    afresh)."""

    def __init__(self, engine, tokenizer: Tokenizer | None = None):
        self.engine = engine
        self.model = None  # the engine holds the weights split over accelerator, pinned host and CPU views
        self.config = engine.config
        self.tokenizer = tokenizer
        self._generator = engine
        self._limits = {"max_batch": engine.runtime.max_batch, "max_seq_len": engine.runtime.max_seq_len}

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, **sampling) -> GenerationResult:
        # check before warm-up, which compiles for tens of seconds
        batch, prompt_len = check_request(input_ids, self.tokenizer, self.config.vocab_size, max_new_tokens,
                                          temperature, top_k, seed, **self._limits, **sampling).shape
        if self.engine.program_shape(batch, prompt_len, max_new_tokens) not in self.engine.warmed_shapes:
            self.engine.warmup(batch, prompt_len, max_new_tokens)
        return super().generate(input_ids, max_new_tokens, temperature, top_k, seed, **sampling)

    def steps(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
              seed: int = 0, **sampling):
        """`Runner.steps` over the engine (no warm-up: a step's first run compiles what it needs)."""
        ids = check_request(input_ids, self.tokenizer, self.config.vocab_size, max_new_tokens, temperature, top_k,
                            seed, **self._limits, **sampling)
        return self.engine.steps(ids, max_new_tokens, temperature, top_k, seed, **sampling)

    @property
    def stats(self) -> dict:
        return self.engine.stats

    @property
    def startup_seconds(self) -> dict:
        return self.engine.startup_seconds
