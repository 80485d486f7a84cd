"""`pdscope-jax generate`: generate from a prompt (text or token ids) with any model and policy.

Contract: `main(argv)` loads MODEL through `pdscope_jax.load` (preset names use seeded random weights unless
`--weights DIR`; `--revision` picks a Hugging Face cache snapshot), runs the model whole or under `--policy` with
`--gpu-memory` / `--expert-pool` (the KV cache sized by `--max-seq-len` / `--max-batch`, copies bounded by
`--quality`), on `--accelerators N` devices with the routed experts split over them where asked, prints the
continuation (text when the checkpoint has a tokenizer, token ids otherwise), the per-phase throughput, and the
seconds of loading (offloaded: by the engine's build stages) and of the whole generation, compilation included.
Every argument that can be checked without weights (ids, sampling settings, policy, sizes, lengths) is checked
before the model loads; one `errors.InputError` names every problem.
"""

from __future__ import annotations

import argparse
import time

from pdscope_jax.cli.options import add_model_weights, quality_settings
from pdscope_jax.sched import POLICIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdscope-jax generate", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="reference-moe",
                        help="preset name, embedded model, checkpoint directory or HF-cache name")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="text (needs the checkpoint's tokenizer.json)")
    source.add_argument("--ids", help="comma-separated token ids")
    add_model_weights(parser)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", help=f"offloading policy: {', '.join(POLICIES)}")
    parser.add_argument("--gpu-memory", default="24GB")
    parser.add_argument("--expert-pool")
    parser.add_argument("--predictors", help="PhasePer checkpoint directory (with --policy)")
    parser.add_argument("--max-seq-len", type=int,
                        help="tokens per sequence (prompt plus new) the offloaded KV cache holds (with --policy; "
                             "default 4096)")
    parser.add_argument("--max-batch", type=int,
                        help="sequences the offloaded KV cache holds (with --policy; default 1)")
    parser.add_argument("--revision", help="branch, tag or commit of a Hugging Face cache model (default: refs/main)")
    parser.add_argument("--accelerators", type=int,
                        help="split each MoE layer's routed experts E/N over N devices: the whole model (no "
                             "--policy), or the offload engine's pools and host copies (default: one device)")
    args = parser.parse_args(argv)

    import pdscope_jax
    from pdscope_jax.api import check_load, resolve
    from pdscope_jax.errors import collect, raise_problems
    from pdscope_jax.generation.generator import check_request

    runtime = {} if args.policy is None else {"gpu_memory": args.gpu_memory, "expert_pool": args.expert_pool}
    # given without --policy, check_load names them as settings that need one
    runtime |= {k: v for k, v in (("max_seq_len", args.max_seq_len), ("max_batch", args.max_batch)) if v is not None}
    runtime |= quality_settings(args)
    # validate first, everything at once: the model's config is cheap to read, its weights are not
    problems, ids, rc = [], None, None
    if args.ids is not None:
        try:
            ids = [[int(token) for token in args.ids.split(",")]]
        except ValueError:
            problems.append(f"--ids: expected comma-separated integers such as 1,2,3, got {args.ids!r}")
    rc = collect(problems, check_load, args.dtype, args.seed, args.policy, args.predictors, runtime, args.quantize,
                 args.accelerators)
    limits = {} if rc is None else {"max_batch": rc.max_batch, "max_seq_len": rc.max_seq_len}
    collect(problems, check_request, ids if ids is not None else [[0]], None,
            resolve(args.model, args.revision)[0].vocab_size,
            args.new_tokens, args.temperature, args.top_k, args.seed, **limits)
    raise_problems(problems, "bad arguments")
    started = time.perf_counter()
    runner = pdscope_jax.load(args.model, weights=args.weights, seed=args.seed, dtype=args.dtype,
                              policy=args.policy, predictors=args.predictors, revision=args.revision,
                              quantize=args.quantize, accelerators=args.accelerators, **runtime)
    loaded = time.perf_counter()
    if ids is not None:
        prompt = ids
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        prompt = "def " if runner.tokenizer is not None else [[1, 2, 3, 4]]
    out = runner.generate(prompt, max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k,
                          seed=args.seed)
    print(out.text[0] if out.text else ",".join(str(t) for t in out.tokens[0]))
    print(f"prefill {out.prefill_tokens_per_s:.1f} tok/s ({out.prefill_seconds:.3f} s), "
          f"decode {out.decode_tokens_per_s:.2f} tok/s ({out.decode_seconds:.3f} s)")
    stages = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in runner.startup_seconds.items())
    print(f"load {loaded - started:.1f} s" + (f" ({stages})" if stages else "")
          + f", generate {time.perf_counter() - loaded:.1f} s (compilation included)")
    return 0
