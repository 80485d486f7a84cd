"""benchmarks/start_times.py: generate's load line read back into seconds by stage."""


def test_load_line_becomes_seconds_by_stage(load_script):
    script = load_script("start_times")
    offloaded = ["1,2", "prefill 1.0 tok/s (1.000 s), decode 2.00 tok/s (0.500 s)",
                 "load 45.1 s (budget 0.3 s, weights and expert store 44.3 s, policy 0.0 s), generate 9.5 s "
                 "(compilation included)"]
    assert script.load_stages(offloaded) == {
        "load_s": 45.1, "generate_s": 9.5,
        "load_stages_s": {"budget": 0.3, "weights and expert store": 44.3, "policy": 0.0}}
    assert script.load_stages(["1,2", "load 6.4 s, generate 5.5 s (compilation included)"]) == {
        "load_s": 6.4, "load_stages_s": {}, "generate_s": 5.5}  # the whole model: no stages
    assert script.load_stages(["1,2", "prefill 1.0 tok/s"]) == {}  # an older generate: nothing to read
