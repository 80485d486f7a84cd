"""kernel_sources.attribute on a made-up trace and HLO dump: kernels named by their HLO instruction land on the
innermost package frame of that instruction (a fusion without a frame: its computation's most frequent one),
parents resolved as the dump prints them (a parent's id plus one), other modules' kernels left out."""

import gzip
import json

from tests.benchmarks.script_import import BENCHMARKS, import_script

HLO = """HloModule jit_decode_step, is_scheduled=true

%fused_computation.1 (p: s32[8]) -> s32[8] {
  %p = s32[8]{0} parameter(0)
  ROOT %negate.1 = s32[8]{0} negate(%p), metadata={op_name="jit(decode_step)/neg" stack_frame_id=3}
}

ENTRY %main (a: s32[8]) -> s32[8] {
  %a = s32[8]{0} parameter(0)
  %loop_cosine_fusion = s32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, metadata={stack_frame_id=1}
  ROOT %fusion.7 = s32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1
}

FileNames
1 "/x/pdscope_jax/engine/device_decode.py"
2 "/x/site-packages/jax/_src/numpy.py"
FunctionNames
1 "decode_step"
2 "_victims"
3 "negative"
FileLocations
1 {file_name_id=1 function_name_id=1 line=440 end_line=440 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=350 end_line=350 column=1 end_column=9}
3 {file_name_id=2 function_name_id=3 line=7 end_line=7 column=1 end_column=9}
StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
"""


def _event(name, op, module, ts, dur):
    return {"ph": "X", "pid": 1, "tid": 2, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": op, "hlo_module": module}}


def test_kernels_land_on_their_innermost_package_line(tmp_path):
    attribute = import_script(BENCHMARKS / "probes" / "kernel_sources.py").attribute
    hlo = tmp_path / "m.txt"
    hlo.write_text(HLO)
    events = []
    for step in range(3):
        events += [_event("loop_cosine_fusion", "loop_cosine_fusion", "jit_decode_step", step * 100, 4),
                   _event("fusion_7", "fusion.7", "jit_decode_step", step * 100 + 10, 6),
                   _event("other", "fusion.7", "jit_prefill", step * 100 + 20, 50)]
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = attribute(trace, hlo, "jit_decode_step")
    assert got["steps"] == 3 and got["kernels_per_step"] == 2 and got["us_per_step"] == 10
    rows = {r["where"]: r for r in got["sources"]}
    assert set(rows) == {"device_decode.py:440 decode_step", "device_decode.py:350 _victims"}
    assert rows["device_decode.py:440 decode_step"]["us_per_step"] == 4
    # fusion.7 has no frame: its computation's only frame is jax's (3), whose parent (printed 3) is _victims (2),
    # whose parent (printed 2) is decode_step (1)
    victims = rows["device_decode.py:350 _victims"]
    assert victims["us_per_step"] == 6 and victims["kernels_per_step"] == 1
    assert victims["caller"] == "device_decode.py:440 decode_step"
