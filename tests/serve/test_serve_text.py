"""Token deltas and stop strings on decoded text."""

from hypothesis import given
from hypothesis import strategies as st

from pdscope_jax.serve.text import TextStream

WORDS = ["ab", "c", "\n", "d\n", "EN", "D", "x"]


def decode(ids):
    return "".join(WORDS[i] for i in ids)


@given(st.lists(st.integers(0, len(WORDS) - 1), max_size=30), st.lists(st.sampled_from(["END", "\n\n", "cd"]),
                                                                           max_size=2))
def test_deltas_join_to_the_text_before_the_first_stop(ids, stop):
    stream = TextStream(decode, stop)
    out, stopped = [], False
    for i in ids:
        delta, stopped = stream.push(i)
        out.append(delta)
        if stopped:
            break
    if not stopped:
        out.append(stream.flush())
    text = decode(ids)
    cuts = [text.find(s) for s in stop if s in text]
    # a stop string that appears is always found, at its first place
    assert "".join(out) == (text[: min(cuts)] if cuts else text)
    assert stopped == bool(cuts)


def test_an_unfinished_character_waits():
    pieces = {0: "a", 1: "\ufffd"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids))
    assert stream.push(0) == ("a", False)
    assert stream.push(1) == ("", False)  # the replacement character of a half-decoded byte sequence is held
    pieces[1] = "é"  # the next token completes it: the decoded text changes
    assert stream.push(0) == ("éa", False)
