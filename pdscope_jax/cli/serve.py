"""`pdscope-jax serve MODEL`: an OpenAI-compatible HTTP server (needs the `[serve]` extra).

Contract: `main(argv)` checks the load settings (dtype, seed, policy, sizes) before anything loads, then
listens on --host (127.0.0.1 by default: loopback only) and --port at once, answering 503 until the model is
loaded, and serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics (`serve.app`).
--api-key (or PDSCOPE_API_KEY) makes /v1 need `Authorization: Bearer KEY`; --max-prompt-tokens, --max-tokens
and --max-queue bound what one request may ask and how many wait; --max-batch N sequences are decoded together
(continuous batching; with --policy the engine budgets a KV cache for N, by default 1: one request at a time);
--chat-template FILE overrides the checkpoint's template; --accelerators N (with --policy) splits the engine's
experts over N accelerators.
"""

from __future__ import annotations

import argparse
import os

from pdscope_jax.cli.options import add_model_weights, quality_settings
from pdscope_jax.sched import POLICIES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and how to load it (shared with `chat`)."""
    parser.add_argument("model", nargs="?", default="reference-moe",
                        help="preset name, embedded model, checkpoint directory or HF-cache name")
    add_model_weights(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights")
    parser.add_argument("--policy", help=f"offloading policy: {', '.join(POLICIES)} (default: the whole model)")
    parser.add_argument("--gpu-memory", default="24GB")
    parser.add_argument("--expert-pool")
    parser.add_argument("--max-seq-len", type=int,
                        help="KV cache length, prompt + new tokens (with --policy: the engine's; serving the whole "
                             "model: the batch cache's, default the model's context up to 4096)")
    parser.add_argument("--predictors", help="PhasePer checkpoint directory (with --policy)")
    parser.add_argument("--accelerators", type=int,
                        help="with --policy: split each MoE layer's routed experts E/N over N accelerators, each with "
                             "its own pool and host copies (default: one)")
    parser.add_argument("--chat-template", help="a jinja2 chat template file (default: the checkpoint's)")


def loader(args):
    """(a function that loads the runner, the load settings) after checking every setting at once."""
    import pdscope_jax
    from pdscope_jax.api import check_load
    from pdscope_jax.errors import collect, raise_problems

    runtime = {} if args.policy is None else {"gpu_memory": args.gpu_memory, "expert_pool": args.expert_pool,
                                              "max_batch": args.max_batch or 1}  # the engine budgets its cache
    if args.policy is not None and args.max_seq_len is not None:
        runtime["max_seq_len"] = args.max_seq_len
    runtime |= quality_settings(args)
    problems = []
    if args.accelerators not in (None, 1) and args.policy is None:
        problems.append("--accelerators splits the offload engine's experts: give a --policy too (the server runs "
                        "the whole model on one device)")
    collect(problems, check_load, args.dtype, args.seed, args.policy, args.predictors, runtime, args.quantize,
            args.accelerators)
    raise_problems(problems, "bad arguments")
    return lambda: pdscope_jax.load(args.model, weights=args.weights, seed=args.seed, dtype=args.dtype,
                                    policy=args.policy, predictors=args.predictors, quantize=args.quantize,
                                    accelerators=args.accelerators, **runtime)


def chat_template(args):
    from pdscope_jax.generation.chat import ChatTemplate

    if args.chat_template is None:
        return None
    with open(args.chat_template) as f:
        return ChatTemplate(f.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdscope-jax serve", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PDSCOPE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $PDSCOPE_API_KEY)")
    parser.add_argument("--served-model-name", help="the name /v1/models reports (default: MODEL)")
    parser.add_argument("--max-prompt-tokens", type=int, help="longer prompts get 413 (default: the context)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="the most new tokens one request may ask")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond these get 429")
    parser.add_argument("--max-batch", type=int,
                        help="sequences decoded together (continuous batching; default 8). With --policy the default "
                             "is 1, one request at a time; N > 1 budgets a KV cache for N (host-planned batches "
                             "were slower than one stream on the H200; the device step over the batch is not yet "
                             "measured: docs/MEASUREMENTS.md)")
    args = parser.parse_args(argv)

    from pdscope_jax.errors import InputError

    problems = [f"--{name.replace('_', '-')} must be >= 1, got {value}"
                for name, value in (("max_tokens", args.max_tokens), ("max_queue", args.max_queue),
                                    ("max_prompt_tokens", args.max_prompt_tokens), ("max_batch", args.max_batch),
                                    ("max_seq_len", args.max_seq_len)) if value is not None and value < 1]
    if problems:
        raise InputError("; ".join(problems))
    load = loader(args)
    template = chat_template(args)
    try:
        from pdscope_jax.serve.server import serve
        from pdscope_jax.serve.service import Limits, Service
    except ImportError as err:
        raise InputError(f"serving needs the [serve] extra ({err}): pip install 'pdscope_jax[serve]'") from None

    batch_len = args.max_seq_len if args.policy is None else None  # with --policy the engine sizes its own
    limits = Limits(args.max_prompt_tokens, args.max_tokens, args.max_queue, args.max_batch or 8, batch_len)
    service = Service(args.served_model_name or args.model, limits, args.api_key, template)
    serve(service, load, args.host, args.port)
    return 0
