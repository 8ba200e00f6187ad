"""Bad input gets a 4xx OpenAI error naming the field; the official openai client works unchanged."""

import json
import subprocess
import sys
import time

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucm.config import ConfigError, parse_config
from ucm_proxy.config import ProxyConfig
from ucm_proxy.decider import Decider
from ucm_proxy.errors import ProxyError
from ucm_proxy.requests import parse_body
from ucm_testing.fake_vllm import MODEL

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}


@pytest.fixture
def proxy(fakes, make_proxy):
    p, d = fakes.add("p"), fakes.add("d")
    running = make_proxy(prefill=[p.url], decode=[d.url], max_body_bytes=2048)
    with running.client() as c:  # the health checks learn the served models: unknown ones are 404
        deadline = time.monotonic() + 10
        while not c.get("/v1/models").json()["data"] and time.monotonic() < deadline:
            time.sleep(0.05)
    return running


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/v1/completions", b"{nope", 400, None),
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "x"}, 400, "model"),
        ("/v1/completions", {"model": 7, "prompt": "x"}, 400, "model"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": 3}, 400, "stream_options"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{}], "max_completion_tokens": -1},
            400,
            "max_completion_tokens",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "ucm_chunks": [[0, 1]]}, 400, "ucm_chunks"),  # text
        (
            "/v1/chat/completions",  # token offsets mean nothing in a chat: even with a token-id prompt beside
            {"model": MODEL, "messages": [{}], "prompt": [1, 2], "ucm_chunks": [[0, 1]]},
            400,
            "ucm_chunks",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "ucm_chunks": [[0, 4]]}, 400, "ucm_chunks"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "ucm_chunks": [[1, 2], [0, 1]]}, 400, "ucm_chunks"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "ucm_chunks": {"0": 1}}, 400, "ucm_chunks"),
        ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 5000}, 413, None),
        ("/v1/completions", b'{"model": "fake-model", "prompt": "\\ud800 hello"}', 400, None),
        ("/v1/chat/completions", b'{"model": "fake-model", "messages": [{"content": "a\\udfff"}]}', 400, None),
    ],
)
def test_bad_requests(proxy, route, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with proxy.client() as c:
        r = c.post(route, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]


def test_a_chunk_list_past_the_limit_is_refused():
    body = {"model": MODEL, "prompt": [1] * 2000, "ucm_chunks": [[i, i + 1] for i in range(1025)]}
    with pytest.raises(ProxyError, match="at most 1024 chunks") as caught:
        parse_body(json.dumps(body).encode(), "/v1/completions")
    assert caught.value.param == "ucm_chunks"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "text", "text": "Hi"}, {"type": "text", "text": 5}], "messages[0].content[1].text"),
        ([{"type": "text", "text": None}], "messages[0].content[0].text"),
        (5, "messages[0].content"),
        ({"type": "text", "text": "Hi"}, "messages[0].content"),
        (["Hi", 7], "messages[0].content[1]"),
        ([["Hi"]], "messages[0].content[0]"),
    ],
)
def test_malformed_chat_content_is_a_400_naming_the_field(fakes, make_proxy, content, param):
    """The routing decider reads the text parts (here for every request): one that is not a string
    was a 500."""
    d = fakes.add("d")
    running = make_proxy(prefill=[fakes.add("p").url], decode=[d.url], disaggregation={"min_prefill_tokens": 1})
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    with running.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert d.requests == []


def test_every_chat_content_shape_vllm_accepts_is_served(fakes, make_proxy):
    """Strings among the parts (text, to vLLM), parts without text, no content or null content."""
    running = make_proxy(
        prefill=[fakes.add("p").url], decode=[fakes.add("d").url], disaggregation={"min_prefill_tokens": 1}
    )
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": ["plain text parts", {"type": "text", "text": "typed ones"}, image]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
        {"role": "user"},
    ]
    with running.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_api_keys(fakes, make_proxy, tmp_path):
    p, d = fakes.add("p"), fakes.add("d")
    keys = tmp_path / "keys"
    keys.write_text("key-one\n\nkey-two\n")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], api_keys_file=str(keys))
    with proxy.client() as c:
        assert c.post("/v1/completions", json=COMPLETION).status_code == 401
        r = c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (
            c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer key-two"}).status_code == 200
        )
        assert c.get("/health").status_code == 200  # probes need no key


def test_metrics_and_the_pd_path_need_the_scrape_token_when_one_is_set(fakes, make_proxy, tmp_path):
    """A tenant's API key does not open the counters of every tenant; Prometheus' token does."""
    p, d = fakes.add("p"), fakes.add("d")
    (tmp_path / "keys").write_text("tenant-key\n")
    (tmp_path / "token").write_text("scrape-token\n")
    proxy = make_proxy(
        prefill=[p.url],
        decode=[d.url],
        api_keys_file=str(tmp_path / "keys"),
        metrics_token_file=str(tmp_path / "token"),
    )
    with proxy.client() as c:
        for path in ("/metrics", "/pd-path"):
            for auth in (None, "Bearer tenant-key", "Bearer scrape-token-not", "Basic scrape-token"):
                r = c.get(path, headers={"Authorization": auth} if auth else {})
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, auth)
            assert c.get(path, headers={"Authorization": "Bearer scrape-token"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200  # probes need none
        # ... and the token is no API key.
        assert (
            c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer scrape-token"}).status_code
            == 401
        )
        text = c.get("/metrics", headers={"Authorization": "Bearer scrape-token"}).text
    refused = [
        line
        for line in text.splitlines()
        if line.startswith('ucm_proxy_rejected_requests_total{reason="scrape_token"}')
    ]
    assert refused and float(refused[0].split()[-1]) >= 8


@pytest.mark.parametrize(("field", "what"), [("api_keys_file", "key"), ("metrics_token_file", "token")])
def test_a_key_file_that_holds_nothing_is_a_startup_error(tmp_path, field, what):
    (tmp_path / "keys").write_text("\n  \n")
    path = tmp_path / "proxy.yaml"
    path.write_text(f"decode: [http://d:8000]\nfallback_to_decode: true\n{field}: {tmp_path / 'keys'}\n")
    r = subprocess.run([sys.executable, "-m", "ucm_proxy", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{field}: " in r.stderr and f"holds no {what}" in r.stderr


def test_a_key_file_emptied_while_serving_locks_every_client_out(fakes, make_proxy, tmp_path):
    """Fail closed: a Secret whose keys are all removed must not turn authentication off."""
    p, d = fakes.add("p"), fakes.add("d")
    keys = tmp_path / "keys"
    keys.write_text("key-one\n")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], api_keys_file=str(keys))

    def status(headers: dict[str, str]) -> int:
        with proxy.client() as c:
            return c.post("/v1/completions", json=COMPLETION, headers=headers).status_code

    assert status({"Authorization": "Bearer key-one"}) == 200
    keys.write_text("\n")
    deadline = time.monotonic() + 5
    while status({"Authorization": "Bearer key-one"}) != 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status({"Authorization": "Bearer key-one"}) == 401 and status({}) == 401


def test_a_revoked_key_stops_working_without_a_restart(fakes, make_proxy, tmp_path):
    """Kubernetes updates a mounted Secret by swapping a directory behind a symlink."""
    p, d = fakes.add("p"), fakes.add("d")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "api-keys").write_text("old-key\n")
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "api-keys").symlink_to("..data/api-keys")
    proxy = make_proxy(prefill=[p.url], decode=[d.url], api_keys_file=str(tmp_path / "api-keys"))

    def status(key: str) -> int:
        with proxy.client() as c:
            return c.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"}).status_code

    assert status("old-key") == 200
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "api-keys").write_text("new-key\n")
    (tmp_path / "..data.tmp").symlink_to("v2")
    (tmp_path / "..data.tmp").rename(tmp_path / "..data")
    deadline = time.monotonic() + 5
    while status("old-key") != 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status("old-key") == 401 and status("new-key") == 200


def test_a_backend_4xx_is_passed_to_the_client_not_retried(fakes, make_proxy):
    from ucm_testing.fake_vllm import Behaviour

    p = fakes.add("p", Behaviour(fail_next=["400"]))
    other_p, d = fakes.add("p2"), fakes.add("d")
    proxy = make_proxy(prefill=[p.url, other_p.url], decode=[d.url], routing={"prefill": "round_robin"})
    with proxy.client() as c:
        r = c.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    assert other_p.requests == [] and d.requests == []


# Any code point, lone surrogates included (json.dumps writes them as \\ud800-style escapes).
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "", "other"]) | json_values,
        "prompt": any_text | json_values,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}), max_size=2
        )
        | json_values,
        "max_tokens": st.integers(-2, 20) | json_values,
        "max_completion_tokens": st.integers(-2, 20) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": json_values,
        "kv_transfer_params": json_values,
        "temperature": json_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fields | json_values, chat=st.booleans())
def test_fuzzed_bodies_never_get_a_proxy_5xx(proxy, body, chat):
    route = "/v1/chat/completions" if chat else "/v1/completions"
    with proxy.client() as c:
        r = c.post(route, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)


@settings(max_examples=300, deadline=None)
@given(content=json_values | st.lists(json_values | st.fixed_dictionaries({"text": json_values}), max_size=3))
def test_the_decider_reads_any_chat_content_that_passes_validation(content):
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
    try:
        body = parse_body(raw, "/v1/chat/completions")
    except ProxyError as exc:
        assert exc.status == 400, exc.message
        # No param: the body as a whole is refused (a lone surrogate escape), not the content.
        assert exc.param is None or exc.param.startswith("messages[0].content"), exc.message
        return
    Decider(1, 4.0, 100, 0.0).decide(body, "/v1/chat/completions")


def test_deeply_nested_json_is_a_400(fakes, make_proxy):
    running = make_proxy(prefill=[fakes.add("p").url], decode=[fakes.add("d").url])
    body = b'{"model": "fake-model", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with running.client() as c:
        r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]


def test_openai_client_unchanged(proxy):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert done.choices[0].text == " t0 t1 t2 t3"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True)
    )
    assert streamed == " t0 t1 t2 t3"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.content == " t0 t1 t2"
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t0 t1 t2"
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--decode", "ftp://x"], r"proxy\.decode: Value error|proxy\.decode: .*not an http"),
        (["--mode", "pd", "--decode", "http://d:1"], r"prefill: mode pd needs prefill backends"),
        (["--prefill", "http://p:1"], r"decode: at least one backend"),
        (["--decode", "http://d:1", "--prefill", "http://p:1", "--port", "99999"], r"proxy\.port"),
        (["--config", "/no/such.yaml"], r"--config: cannot read"),
    ],
)
def test_cli_config_errors_name_the_field(args, message):
    r = subprocess.run([sys.executable, "-m", "ucm_proxy", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert __import__("re").search(message, r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_yaml_config_and_flags(tmp_path):
    from ucm_proxy.cli import build_parser, load_config

    path = tmp_path / "proxy.yaml"
    path.write_text(
        "mode: pd\nprefill: [http://p:8000/]\ndecode: [http://d:8000]\nrouting: {prefill: round_robin}\n"
        "disaggregation: {chars_per_token: 3.5}\n"
    )
    args = ["-c", str(path), "--decode-policy", "prefix_affinity", "--port", "9", "--min-prefill-tokens", "0"]
    config = load_config(build_parser().parse_args(args))
    assert config.prefill == ["http://p:8000"] and config.port == 9
    assert (config.routing.prefill, config.routing.decode) == ("round_robin", "prefix_affinity")
    assert (config.disaggregation.min_prefill_tokens, config.disaggregation.chars_per_token) == (0, 3.5)
    # a flag turns a file's setting either way; no flag leaves it
    path.write_text("prefill: [http://p:8000]\ndecode: [http://d:8000]\nfallback_to_decode: true\n")
    read = [
        load_config(build_parser().parse_args(["-c", str(path), *flag])) for flag in ([], ["--no-fallback-to-decode"])
    ]
    assert [c.fallback_to_decode for c in read] == [True, False]


def test_check_validates_without_serving_or_reading_key_files(tmp_path):
    path = tmp_path / "proxy.yaml"
    path.write_text("decode: [http://d:8000]\nfallback_to_decode: true\napi_keys_file: /etc/ucm/api-keys/none\n")
    r = subprocess.run([sys.executable, "-m", "ucm_proxy", "--check", "-c", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["routing"]["decode"] == "least_outstanding"  # the proxy's own defaults
    path.write_text("decode: [http://d:8000]\nfallback_to_decode: true\nrouting: {decode: fastest}\n")
    r = subprocess.run([sys.executable, "-m", "ucm_proxy", "--check", "-c", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "proxy.routing.decode: Input should be" in r.stderr


@pytest.mark.parametrize("content", ["", "two\nlines", "caf\u00e9"])
def test_a_backend_key_file_that_cannot_be_a_header_is_a_startup_error(tmp_path, content):
    key = tmp_path / "backend-key"
    key.write_text(content)
    path = tmp_path / "proxy.yaml"
    path.write_text(f"decode: [http://d:8000]\nfallback_to_decode: true\nbackend_api_key_file: {key}\n")
    r = subprocess.run([sys.executable, "-m", "ucm_proxy", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "backend_api_key_file:" in r.stderr and "Traceback" not in r.stderr


def test_per_key_salts_keep_tenants_apart(fakes, make_proxy):
    """With cache_salt: per_key a tenant cannot choose another's salt to probe its cached prefixes."""
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url], api_keys=["acme", "globex"], cache_salt="per_key")

    def salt_seen(key: str, body: dict) -> str:
        with proxy.client() as c:
            r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return d.requests[-1]["body"]["cache_salt"]

    acme = salt_seen("acme", COMPLETION)
    assert salt_seen("acme", {**COMPLETION, "cache_salt": "globex-guess"}) == acme  # the client's is replaced
    assert salt_seen("globex", COMPLETION) != acme
    assert "acme" not in acme  # derived, not the key itself


def test_cache_salt_none_strips_it_and_per_key_needs_keys(fakes, make_proxy):
    d = fakes.add("d")
    proxy = make_proxy(mode="mixed", decode=[d.url], cache_salt="none")
    with proxy.client() as c:
        assert c.post("/v1/completions", json={**COMPLETION, "cache_salt": "x"}).status_code == 200
    assert "cache_salt" not in d.requests[-1]["body"]
    with pytest.raises(ConfigError, match="cache_salt: per_key needs api_keys"):
        parse_config(ProxyConfig, {"mode": "mixed", "decode": ["http://d:1"], "cache_salt": "per_key"}, "proxy")
