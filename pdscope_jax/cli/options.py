"""Options several commands share, defined once.

Contract: `add_model_weights(parser)` adds `--weights`, `--dtype`, `--quantize` (how `pdscope_jax.load` builds the
model) and the quality options below; `add_quantize(parser)` adds `--quantize` alone; `add_quality(parser)` adds
`--quality` and `--mixed-threshold` (RuntimeConfig's `quality` and `mixed_threshold`, `sched.precision`);
`quality_settings(args)` -> the runtime settings they give ({} when unset), which `api.check_load` checks with the
rest before anything loads.
"""

from __future__ import annotations

import argparse


def add_model_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", help="'random' or a checkpoint directory (default: the model's own)")
    parser.add_argument("--dtype", default="bfloat16")
    add_quantize(parser)
    add_quality(parser)


def add_quantize(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=("int8", "int4"),
                        help="store the routed experts int8 (per channel) or int4 (groups of 64), quantized as "
                             "they load (default: the model's dtype)")


def add_quality(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quality", choices=("int8", "mixed", "int4"),
                        help="with a policy, the lowest precision an expert's copy to the GPU may have: 'mixed' keeps "
                             "an int4 copy of every routed expert beside the stored one and copies it for experts of "
                             "small routing weight, 'int4' for every copy, 'int8' never below int8 (with --quantize "
                             "int8) (default: the stored precision)")
    parser.add_argument("--mixed-threshold", type=float,
                        help="--quality mixed: a copy is int4 when its expert's routing weight over the token's mean "
                             "top-k weight is below this (default 1.0)")


def quality_settings(args) -> dict:
    """RuntimeConfig settings of --quality and --mixed-threshold, those given."""
    return {key: value for key, value in (("quality", args.quality), ("mixed_threshold", args.mixed_threshold))
            if value is not None}
