"""Which source lines a traced program's GPU kernels come from: a profiler trace joined with XLA's optimized HLO.

Why: a decode step is thousands of small kernels whose names (`input_reduce_fusion_506`) say nothing of the code
that made them. jax's profiler names each kernel's HLO instruction (`args.hlo_op`, `args.hlo_module`), and XLA's
optimized HLO dump (`XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`, the `*after_optimizations.txt` file)
gives every instruction a stack frame (`metadata={... stack_frame_id=N}`, resolved through the dump's FileNames,
FunctionNames, FileLocations and StackFrames tables, where a frame's printed parent is the parent's id plus one)
into the Python that traced it. A fusion with no frame of its
own takes the most frequent frame of the instructions it calls. Inside a command buffer (a CUDA graph) the trace's
hlo_op names the buffer, so a kernel is found by its own name (a fusion's instruction name with `.` as `_`, or the
Triton call's name in the dump; the longest such name it starts with, as Triton may add a suffix).
Per kernel of `--module` (the HLO module's name, `jit_decode_step`) this takes the innermost frame in the package
(`--package`, a path fragment: frames of jax itself are skipped) and its caller in the package, and sums kernels and
microseconds by that innermost line; steps are counted as `trace_summary` counts them (rotary-embedding kernels),
or given by `--steps`. Output: `sources`, rows of {where, caller, kernels_per_step, us_per_step, kinds}, most time
first.
Usage: python benchmarks/probes/kernel_sources.py TRACE.json.gz DUMP_after_optimizations.txt --module jit_decode_step
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import re
from pathlib import Path

STEP_START = "loop_cosine_fusion"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")


def frames(text: str) -> dict[int, list[tuple[str, str, int]]]:
    """stack_frame_id -> its call stack, innermost first: [(file, function, line)]."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and line[0].isdigit():
            key, _, rest = line.partition(" ")
            tables[section][int(key)] = rest.strip().strip('"')
        elif section and line.strip():
            section = None
    def fields(entry: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", entry)}
    locations = {}
    for key, entry in tables["FileLocations"].items():
        f = fields(entry)
        locations[key] = (tables["FileNames"].get(f["file_name_id"], "?"),
                          tables["FunctionNames"].get(f["function_name_id"], "?"), f.get("line", 0))
    out: dict[int, list] = {}
    for key in tables["StackFrames"]:
        stack, at, seen = [], key, set()
        while at in tables["StackFrames"] and at not in seen:
            seen.add(at)
            f = fields(tables["StackFrames"][at])
            stack.append(locations.get(f["file_location_id"], ("?", "?", 0)))
            at = f.get("parent_frame_id", 0) - 1  # the dump prints a parent's id plus one (0: none)
        out[key] = stack
    return out


def instruction_frames(text: str) -> dict[str, int | None]:
    """HLO instruction name -> its stack frame id (a fusion without one: its computation's most frequent); also
    each GPU kernel's name -> the frame: a fusion's kernel is its instruction's name with `.` and `-` as `_`, a
    Triton call's the `name` in its backend config (several calls of one name: their most frequent frame)."""
    own: dict[str, int | None] = {}
    triton: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls: dict[str, str] = {}
    by_computation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    computation = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, called = m.group(1), re.search(r"calls=%([\w.\-]+)", line)
        called = called.group(1) if called else None
        frame = re.search(r"stack_frame_id=(\d+)", line)
        own[name] = int(frame.group(1)) if frame else None
        kernel = re.search(r' name = "([^"]+)"', line) if "xla.gpu.triton" in line else None
        if kernel and frame:
            triton[kernel.group(1)][int(frame.group(1))] += 1
        if called:
            calls[name] = called
        if frame and computation:
            by_computation[computation][int(frame.group(1))] += 1
    for name, called in calls.items():
        if own.get(name) is None and by_computation.get(called):
            own[name] = by_computation[called].most_common(1)[0][0]
    kernels = {re.sub(r"[.\-]", "_", name): frame for name, frame in own.items()}
    kernels.update({name: frames.most_common(1)[0][0] for name, frames in triton.items()})
    return {**kernels, **own}


def attribute(trace: Path, hlo: Path, module: str, package: str = "pdscope_jax", steps: int | None = None) -> dict:
    text = hlo.read_text()
    stacks, owner = frames(text), instruction_frames(text)
    data = json.load(gzip.open(trace))
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module]
    steps = steps or max(1, sum(e["name"].startswith(STEP_START) for e in kernels))

    @functools.cache
    def by_name(kernel: str):
        """The frame of the longest known kernel name `kernel` starts with (Triton may add a suffix)."""
        known = [name for name in owner if kernel.startswith(name)]
        return owner[max(known, key=len)] if known else None

    rows: dict[tuple, list] = {}
    for e in kernels:
        # inside a command buffer (a CUDA graph) hlo_op names the buffer: the kernel's own name then says which
        frame = owner.get(e["args"].get("hlo_op", "")) or by_name(e["name"])
        ours = [f for f in stacks.get(frame, []) if package in f[0]]
        where = f"{Path(ours[0][0]).name}:{ours[0][2]} {ours[0][1]}" if ours else "(no frame)"
        caller = f"{Path(ours[1][0]).name}:{ours[1][2]} {ours[1][1]}" if len(ours) > 1 else ""
        row = rows.setdefault((where, caller), [0, 0.0, collections.Counter()])
        row[0] += 1
        row[1] += e["dur"]
        row[2][re.sub(r"([._]\d+)+$", "", e["name"])] += 1
    out = [{"where": w, "caller": c, "kernels_per_step": round(n / steps, 2), "us_per_step": round(us / steps, 1),
            "kinds": dict(kinds.most_common(4))} for (w, c), (n, us, kinds) in rows.items()]
    out.sort(key=lambda r: -r["us_per_step"])
    return {"trace": trace.name, "hlo": hlo.name, "module": module, "steps": steps,
            "kernels_per_step": round(len(kernels) / steps, 1),
            "us_per_step": round(sum(e["dur"] for e in kernels) / steps, 1), "sources": out}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("hlo", type=Path)
    p.add_argument("--module", default="jit_decode_step")
    p.add_argument("--package", default="pdscope_jax")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = attribute(args.trace, args.hlo, args.module, args.package, args.steps)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['module']}: {result['steps']} steps, {result['kernels_per_step']} kernels and "
          f"{result['us_per_step']} us a step")
    for r in result["sources"][:args.top]:
        print(f"{r['us_per_step']:8.1f} us {r['kernels_per_step']:6.1f} k  {r['where']:<50} <- {r['caller']:<45} "
              f"{r['kinds']}")
    return result


if __name__ == "__main__":
    main()
