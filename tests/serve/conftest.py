"""One real server for the serve tests: the embedded reference MoE (it has a tokenizer) in float32, uvicorn on a
free loopback port, an API key, and limits small enough to hit."""

import openai
import pytest

import pdscope_jax
from pdscope_jax.serve.server import ServerThread
from pdscope_jax.serve.service import Limits, Service

KEY = "sk-test"
LIMITS = Limits(max_prompt_tokens=32, max_tokens=500, max_queue=64)


@pytest.fixture(scope="session")
def api_key():
    return KEY


@pytest.fixture(scope="session")
def runner():
    return pdscope_jax.load("reference-moe", dtype="float32")


@pytest.fixture(scope="session")
def server(runner):
    service = Service("reference-moe", LIMITS, api_key=KEY)
    service.attach(runner)
    with ServerThread(service) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
