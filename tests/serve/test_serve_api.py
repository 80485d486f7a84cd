"""The real server through the official `openai` client: chat, completion, streaming, stop strings, logprobs,
cancellation, and every error status in OpenAI's shape."""

import asyncio
import re

import httpx
import numpy as np
import openai
import pytest

from pdscope_jax.generation.chat import ChatTemplate
from pdscope_jax.serve.server import ServerThread
from pdscope_jax.serve.service import Limits, Service

CODE = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"


def ids(runner, n: int) -> list[int]:
    tokens = runner.tokenizer.encode(CODE * 4)
    return tokens[:n]


def alone(runner, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Greedy tokens of the prompt run alone through `generate`, cut after EOS (id 0), and their text."""
    tokens = runner.generate([prompt], max_new_tokens=max_tokens).tokens[0].tolist()
    if 0 in tokens:
        tokens = tokens[: tokens.index(0) + 1]
    return tokens, runner.tokenizer.decode([t for t in tokens if t != 0])


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_completion_equals_generate_and_reports_usage(client, runner):
    prompt = ids(runner, 8)
    out = client.completions.create(model="reference-moe", prompt=prompt, max_tokens=12)
    tokens, text = alone(runner, prompt, 12)
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == len(tokens)
    assert out.choices[0].finish_reason == ("stop" if tokens[-1] == 0 else "length")


def test_chat_renders_the_template_and_streams_the_same_text(client, runner):
    messages = [{"role": "user", "content": "import"}]
    prompt = runner.tokenizer.encode(ChatTemplate.from_dir(runner.checkpoint).render(messages))
    whole = client.chat.completions.create(model="reference-moe", messages=messages, max_tokens=10)
    _, text = alone(runner, prompt, 10)
    assert whole.choices[0].message.content == text and whole.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model="reference-moe", messages=messages, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_stop_strings_end_the_text_before_them(client, runner):
    prompt = ids(runner, 8)
    _, text = alone(runner, prompt, 24)
    stop = text[6:9]
    want = text[: text.index(stop)]
    out = client.completions.create(model="reference-moe", prompt=prompt, max_tokens=24, stop=[stop, "@@never"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    streamed = client.completions.create(model="reference-moe", prompt=prompt, max_tokens=24, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_logprobs_are_the_chosen_tokens(client, runner):
    prompt = ids(runner, 8)
    out = client.completions.create(model="reference-moe", prompt=prompt, max_tokens=4, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    logits = runner.logits([prompt])[0, -1]
    want = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert lp.token_logprobs[0] == pytest.approx(float(want.max()), abs=1e-4)


def test_sampling_settings_reach_the_sampler(client, runner):
    prompt = ids(runner, 8)
    kw = dict(model="reference-moe", prompt=prompt, max_tokens=12, temperature=1.5, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    c = client.completions.create(**{**kw, "seed": 8}).choices[0].text
    assert a == b and a != c


def test_disconnect_cancels_the_generation_and_frees_the_model(client, runner, server):
    before = metric(server, "pdscope_generated_tokens_total")
    stream = client.completions.create(model="reference-moe", prompt=ids(runner, 8), max_tokens=480, stream=True)
    for _ in range(3):
        next(iter(stream))
    stream.close()
    out = client.completions.create(model="reference-moe", prompt=ids(runner, 8), max_tokens=2)  # served next
    assert out.usage.completion_tokens == 2
    generated = metric(server, "pdscope_generated_tokens_total") - before - 2
    assert 3 <= generated < 480  # stopped long before max_tokens


@pytest.mark.parametrize("call, status, phrase", [
    (dict(temperature=-1), 400, "temperature must be"),
    (dict(top_p=0), 400, "top_p must be"),
    (dict(extra_body={"repetition_penalty": 0}), 400, "repetition_penalty"),
    (dict(n=2), 400, "n=2 is not supported"),
    (dict(max_tokens=501), 400, r"max_tokens must lie in \[1, 500\]"),
    (dict(logprobs=21), 400, "logprobs alternatives"),
    (dict(prompt=list(range(1, 40))), 413, "more than the 32"),
    (dict(prompt=[8192]), 400, "token ids must lie"),
    (dict(prompt=[[1, 2], [3]]), 400, "bad request body|one prompt per request"),
])
def test_bad_requests_get_openai_errors(client, runner, call, status, phrase):
    kw = {"model": "reference-moe", "prompt": ids(runner, 8), "max_tokens": 2, **call}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**kw)
    assert err.value.status_code == status
    body = err.value.response.json()["error"]
    assert re.search(phrase, body["message"]) and body["type"]


def test_api_key_is_required(server, api_key):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    good = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}).json()
    assert [m["id"] for m in good["data"]] == ["reference-moe"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_not_ready_is_503():
    service = Service("loading")
    with ServerThread(service) as s:
        assert httpx.get(s.url + "/health").status_code == 503
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]


def test_a_full_queue_is_429(runner, server):
    """A server of its own with one slot and room for one waiting request: one runs, one waits, the third is
    refused."""
    service = Service("small", Limits(max_tokens=480, max_queue=1, max_batch=1))
    service.attach(runner)
    with ServerThread(service) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)

        async def scenario():
            long = dict(model="small", prompt=ids(runner, 8), max_tokens=480, stream=True)
            first = await client.completions.create(**long)
            await first.__anext__()  # running
            second = asyncio.create_task(client.completions.create(**long))
            while service.worker.queued < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as err:
                await client.completions.create(**long)
            assert "busy" in err.value.response.json()["error"]["message"]
            await first.close()
            await (await second).close()

        asyncio.run(scenario())
