"""`pdscope-jax chat MODEL`: a terminal chat that streams the model's answer token by token.

Contract: `main(argv, stdin=sys.stdin, stdout=sys.stdout)` loads MODEL (the `serve` command's model arguments),
then reads one user message per line until end of input (or a line "/exit"; "/reset" forgets the
conversation), renders the conversation with the checkpoint's chat template (`generation.chat`), and prints the
answer as it is generated, stopping at EOS, a --stop string or --max-tokens. Sampling: --temperature (default:
generation_config.json's, else greedy), --top-k, --top-p, --min-p, --repetition-penalty, --seed.
"""

from __future__ import annotations

import argparse
import sys

from pdscope_jax.cli.serve import add_model_arguments, chat_template, loader


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> int:
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    parser = argparse.ArgumentParser(prog="pdscope-jax chat", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--system", help="a system message opening the conversation")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    for name in ("temperature", "top-p", "min-p", "repetition-penalty"):
        parser.add_argument(f"--{name}", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the sampler")
    args = parser.parse_args(argv)

    from pdscope_jax.api import resolve
    from pdscope_jax.errors import InputError
    from pdscope_jax.generation.chat import ChatTemplate, eos_ids, generation_defaults
    from pdscope_jax.generation.sampling import SamplingParams
    from pdscope_jax.serve.text import TextStream

    given = {k: v for k, v in {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                               "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}.items()
             if v is not None}
    # every setting checked before the weights load: the model's config is cheap to read
    problems = SamplingParams(**given, seed=args.sample_seed).problems(resolve(args.model)[0].vocab_size)
    if args.max_tokens < 1:
        problems.append(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if problems:
        raise InputError("; ".join(problems))
    load = loader(args)
    template = chat_template(args)
    runner = load()
    if runner.tokenizer is None:
        raise InputError(f"{args.model} has no tokenizer.json, so it cannot chat; use a checkpoint with one")
    template = template or ChatTemplate.from_dir(runner.checkpoint)
    params = SamplingParams(**{**generation_defaults(runner.checkpoint), **given, "seed": args.sample_seed})
    sampling = {k: getattr(params, k) for k in ("top_p", "min_p", "repetition_penalty")}
    eos = eos_ids(runner.config, runner.checkpoint)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    stdout.write("pdscope-jax chat: one message per line; /reset forgets, /exit or end of input leaves\n> ")
    stdout.flush()
    for line in stdin:
        line = line.rstrip("\n")
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(opening)
        elif line.strip():
            messages.append({"role": "user", "content": line})
            ids = runner.tokenizer.encode(template.render(messages, add_generation_prompt=True))
            stream = TextStream(runner.tokenizer.decode, args.stop)
            steps = runner.steps([ids], args.max_tokens, params.temperature, params.top_k, params.seed, **sampling)
            said, stopped = [], False
            try:
                for picked in steps:
                    token = int(picked.token[0])
                    if token in eos:
                        break
                    delta, stopped = stream.push(token)
                    said.append(delta)
                    stdout.write(delta)
                    stdout.flush()
                    if stopped:
                        break
            finally:
                steps.close()
            if not stopped:  # what was held back for a stop string that never came
                said.append(stream.flush())
                stdout.write(said[-1])
            messages.append({"role": "assistant", "content": "".join(said)})
            stdout.write("\n")
        stdout.write("> ")
        stdout.flush()
    stdout.write("\n")
    return 0
