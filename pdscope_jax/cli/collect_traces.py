"""`pdscope-jax collect-traces`: record PhasePer routing traces of a model (PhasePer's offline step 1).

Contract: `collect_traces_main(argv) -> 0` loads `--model` (a preset with `--weights random` or a checkpoint
directory, through `pdscope_jax.load`), cuts `--prompts` windows of `--prompt-len` tokens from the `--split`
split of `pdscope_jax.text.corpus` (encoded with the checkpoint's tokenizer, or as UTF-8 bytes modulo the
vocabulary for a model without one), runs `phaseper.collect.collect_traces` (prefill, then `--decode-steps`
greedy decode steps, `--batch` prompts per forward) into a new trace directory `--out` (at most
`--max-prefill-tokens` / `--max-decode-tokens` kept per layer), writes `layer_stats.json` there, prints
"batch i/n" per batch and one JSON summary line last. `check_args(args)` checks every option before the model
loads (model known, --weights 'random' or a folder, counts positive, --batch <= --prompts, --out new and
writable) and raises one `errors.InputError` naming every problem; so does an empty split on this machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdscope_jax.cli.options import add_quantize


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdscope-jax collect-traces",
                                description="Record PhasePer routing traces (prefill and decode kept apart).")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--weights", help="'random', or a safetensors directory for a preset (see pdscope_jax.load)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    add_quantize(p)
    p.add_argument("--out", type=Path, required=True, help="new trace directory")
    p.add_argument("--split", default="train", choices=("train", "heldout", "ood"),
                   help="corpus split the prompts are cut from (pdscope_jax.text.corpus)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="prompts per forward")
    p.add_argument("--max-prefill-tokens", type=int, default=65536, help="prefill tokens kept per layer")
    p.add_argument("--max-decode-tokens", type=int, default=16384, help="decode tokens kept per layer")
    p.add_argument("--seed", type=int, default=0, help="corpus split and prompt offsets")
    return p


def _encoder(runner, vocab_size: int):
    """The checkpoint's tokenizer, or UTF-8 bytes (mod vocab) for a model without one (random weights)."""
    import numpy as np
    import tokenizers

    from pdscope_jax.text import corpus

    if runner.tokenizer is not None:
        return corpus.tokenizer_encoder(tokenizers.Tokenizer.from_file(str(runner.tokenizer.path))), "tokenizer.json"
    return (lambda texts: [np.frombuffer(t.encode(), np.uint8).astype(np.int32) % vocab_size for t in texts],
            "utf-8 bytes")


def check_args(args) -> None:
    """Every problem of the options at once (one InputError); reads the model's config only."""
    from pdscope_jax.cli import checks
    from pdscope_jax.errors import raise_problems

    problems: list[str] = []
    checks.check_model(problems, "--model", args.model)
    if args.weights not in (None, "random"):
        checks.check_dir(problems, "--weights", args.weights)
    for flag, value, low in (("--prompts", args.prompts, 1), ("--prompt-len", args.prompt_len, 1),
                             ("--decode-steps", args.decode_steps, 0), ("--batch", args.batch, 1),
                             ("--max-prefill-tokens", args.max_prefill_tokens, 1),
                             ("--max-decode-tokens", args.max_decode_tokens, 0)):
        checks.check_int(problems, flag, value, low)
    if isinstance(args.batch, int) and isinstance(args.prompts, int) and 1 <= args.prompts < args.batch:
        problems.append(f"--batch {args.batch} exceeds --prompts {args.prompts}: no full batch would run; lower "
                        "--batch or raise --prompts")
    checks.check_seed(problems, "--seed", args.seed)
    if (Path(args.out) / "manifest.json").exists():
        problems.append(f"--out {args.out} already holds traces (manifest.json): name a new folder")
    checks.check_writable_dir(problems, "--out", args.out)
    raise_problems(problems, "bad arguments")


def collect_traces_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    check_args(args)
    import numpy as np

    import pdscope_jax
    from pdscope_jax.phaseper.collect import collect_traces, moe_layers, write_stats
    from pdscope_jax.phaseper.traces import TraceWriter
    from pdscope_jax.text import corpus

    runner = pdscope_jax.load(args.model, weights=args.weights, seed=args.seed, dtype=args.dtype,
                              quantize=args.quantize)
    model, cfg = runner.model, runner.config
    encode, encoding = _encoder(runner, cfg.vocab_size)
    data = corpus.load_corpus(seed=args.seed)
    docs = {"train": data.train, "heldout": data.heldout, "ood": data.ood}[args.split]
    if not docs:
        from pdscope_jax.errors import InputError

        raise InputError(f"--split {args.split}: the split is empty on this machine (out-of-domain source: "
                         f"{data.ood_source}); pick another --split")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id < cfg.vocab_size else 0
    stream = corpus.token_stream(encode, docs, eos)
    prompts = corpus.sample_windows(stream, args.prompt_len, args.prompts, np.random.default_rng(args.seed))
    source = data.ood_source if args.split == "ood" else "stdlib"
    description = (f"{args.model} ({args.dtype}), split {args.split} ({source}), {args.prompts} prompts x "
                   f"{args.prompt_len} tokens ({encoding}), {args.decode_steps} greedy decode steps, "
                   f"batch {args.batch}, seed {args.seed}")
    writer = TraceWriter(args.out, cfg.fingerprint(), moe_layers(model), cfg.hidden_size, cfg.num_experts_per_tok,
                         cfg.num_experts, description=description,
                         max_tokens={"prefill": args.max_prefill_tokens, "decode": args.max_decode_tokens})
    with writer:
        stats = collect_traces(model, prompts, writer, args.decode_steps, args.batch,
                               progress=lambda done, total: print(f"batch {done}/{total}", flush=True))
    write_stats(stats, args.out)
    summary = {phase: {"tokens": s.tokens, "forwards": s.forwards} for phase, s in stats.phases.items()}
    print(json.dumps({"out": str(args.out), "description": description, "seconds": round(stats.seconds, 2),
                      **summary}))
    return 0
