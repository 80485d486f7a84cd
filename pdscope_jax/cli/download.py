"""`pdscope-jax download NAME`: fetch a model's checkpoint from the Hugging Face hub into the local hub cache.

Contract: `main(argv)` takes a preset name the project knows (`HF_REPOS`: deepseek-v2-lite, qwen3-30b-a3b,
mixtral-8x7b, moonlight-16b-a3b) or any hub repo id ("org/name"), and fetches through
`huggingface_hub.snapshot_download` only what `load` reads (`ALLOW_PATTERNS`: safetensors and their index, the
config, generation config and tokenizer files) at `--revision` (default: main), into the hub cache that
`pdscope_jax.load` searches (HF_HUB_CACHE / HF_HOME), or into `--local-dir`. Files already cached are not fetched
again. It prints the snapshot directory and the name to load it by. Every failure it can name is an
`errors.InputError` (exit 2, one line): huggingface_hub missing (the `download` extra), no network or the hub
unreachable (HF_HUB_OFFLINE, HF_ENDPOINT) with the files not cached, an unknown or gated repo, an unknown revision.
"""

from __future__ import annotations

import argparse
import os

HF_REPOS = {  # the presets' published checkpoints
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "moonlight-16b-a3b": "moonshotai/Moonlight-16B-A3B",
}
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer*", "special_tokens_map.json"]


def repo_id(name: str) -> str:
    """The hub repo of a preset name, or `name` itself when it is "org/name"; InputError otherwise."""
    from pdscope_jax.errors import InputError

    if name in HF_REPOS:
        return HF_REPOS[name]
    if name.count("/") == 1 and all(name.split("/")):
        return name
    raise InputError(f"{name!r} is neither a hub repo id ('org/name') nor a model with a published "
                     f"checkpoint ({', '.join(HF_REPOS)}); tiny-* and reference-moe need no download")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdscope-jax download", description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"{', '.join(HF_REPOS)}, or a hub repo id such as deepseek-ai/DeepSeek-V2-Lite")
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")
    parser.add_argument("--local-dir", help="put the files in this directory instead of the hub cache")
    args = parser.parse_args(argv)
    repo = repo_id(args.name)
    path = fetch(repo, args.revision, args.local_dir)
    print(path)
    target = args.local_dir or repo
    revision = f" --revision {args.revision}" if args.revision and not args.local_dir else ""
    print(f"load it with: pdscope_jax.load({target!r}) or pdscope-jax generate {target}{revision} --policy pdscope")
    return 0


def fetch(repo: str, revision: str | None = None, local_dir: str | None = None) -> str:
    """Download `repo`'s ALLOW_PATTERNS files (what is cached already stays) -> the snapshot directory."""
    from pdscope_jax.errors import InputError

    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise InputError("download needs huggingface_hub: pip install 'pdscope_jax[download]'") from None
    try:
        return huggingface_hub.snapshot_download(repo, revision=revision, local_dir=local_dir,
                                                 allow_patterns=ALLOW_PATTERNS)
    except errors.GatedRepoError:  # before RepositoryNotFoundError, its base class
        raise InputError(f"{repo} is gated: accept its terms on https://huggingface.co/{repo}, then log "
                         "in (`hf auth login`) or set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise InputError(f"no hub repo {repo!r} (or it is private: log in with `hf auth login` or set "
                         "HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise InputError(f"{repo} has no revision {revision!r}; give a branch, tag or commit it "
                         "has") from None
    except errors.LocalEntryNotFoundError:  # offline, or the hub unreachable, and the files not cached
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set"
        else:
            why = f"the hub at {constants.ENDPOINT} cannot be reached"
        raise InputError(f"{why} and {repo} is not in the local cache: download it where a network "
                         "exists (unset HF_HUB_OFFLINE, check HF_ENDPOINT) and copy the checkpoint directory here, "
                         "then pass that directory as the model") from None
    except OSError as err:  # disk full, permissions: name the place
        where = local_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
        raise InputError(f"cannot write {repo} to {where}: {err}") from None
