"""A bounded load test: many concurrent streaming requests of mixed lengths lose and duplicate no token, and
every greedy answer equals the same request run alone."""

import asyncio

PROMPT_LENS = (8, 12, 16)
MAX_TOKENS = (3, 9, 17, 24)
REQUESTS = 64


def test_concurrent_streams_equal_their_requests_run_alone(aclient, runner):
    source = runner.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n" * 4)
    cases = [(source[i % 5: i % 5 + PROMPT_LENS[i % 3]], MAX_TOKENS[i % 4]) for i in range(REQUESTS)]

    async def one(prompt, max_tokens):
        stream = await aclient.completions.create(model="reference-moe", prompt=prompt, max_tokens=max_tokens,
                                                  stream=True, logprobs=0, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        pieces = [p for c in chunks if c.choices and c.choices[0].logprobs for p in c.choices[0].logprobs.tokens]
        return text, pieces, chunks[-1].usage.completion_tokens

    async def everything():
        return await asyncio.gather(*(one(p, n) for p, n in cases))

    served = asyncio.run(everything())
    for (prompt, max_tokens), (text, pieces, used) in zip(cases, served):
        tokens = runner.generate([prompt], max_new_tokens=max_tokens).tokens[0].tolist()
        if 0 in tokens:  # EOS ends the answer; it counts as generated, but is no text
            tokens = tokens[: tokens.index(0) + 1]
        shown = [t for t in tokens if t != 0]
        assert used == len(tokens)
        assert pieces == [runner.tokenizer.decode([t]) for t in shown]  # one chunk per token, in order
        assert text == runner.tokenizer.decode(shown)
