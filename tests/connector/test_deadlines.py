"""A store that stops answering (an NFS hard mount in an outage, a stuck FUSE mount, a stalled RPC)
never freezes vLLM: lookups answer "miss" at their deadline and stop queueing behind the stuck
call; loads are abandoned at theirs and recomputed, and an abandoned read lands in staging, never
in cache memory vLLM reuses.

No store here can be made to hang for real on demand (the FIFO trick no longer works: block files
are opened non-blocking), so ``Stalled`` stands in: a real POSIX store whose answers are held back
until the test releases them."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn

from tests.connector.test_scheduler import CTX, Req, put, side, step
from tests.connector.test_worker import IDS, NB, kv_caches, loading, run_step, worker
from tests.store.test_cache import Recording
from ucm.deploy.ports import free_port
from ucm.integration.vllm.health import HEALTH_FILE_ENV, WARMUP_ENV, HealthMiddleware, StoreHealth, stuck_for
from ucm.integration.vllm.metadata import BlockTransfer, UCMConnectorMetadata
from ucm.integration.vllm.scheduler import PARAM_BLOCKS
from ucm.integration.vllm.stats import StatsRecorder
from ucm.integration.vllm.worker import WorkerSide
from ucm.store import Task, create_store
from ucm.store.breaker import BreakerConfig, BreakerStore


class Stalled:
    """A real store whose lookups and loads hang until ``release()``."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.released = threading.Event()
        self.pending: list[tuple[Task, list, object]] = []

    def lookup_prefix(self, ids):  # type: ignore[no-untyped-def]
        self.released.wait()
        return self.store.lookup_prefix(ids)

    def load(self, ids, buffers, landed=None):  # type: ignore[no-untyped-def]
        task = Task(len(ids))
        self.pending.append((task, buffers, landed))
        return task

    def release(self) -> None:
        """The store answers again: the held loads complete, late, with garbage in their buffers
        (and handed to the load's landing, as a store's I/O threads would)."""
        self.released.set()
        for task, buffers, landed in self.pending:
            for i, b in enumerate(buffers):
                b[:] = 0xAB
                if landed is not None:
                    landed(i, memoryview(b))
            task._set(range(len(buffers)), [True] * len(buffers))

    def dump(self, ids, payloads):  # type: ignore[no-untyped-def]
        return self.store.dump(ids, payloads)

    def close(self) -> None:
        self.store.close()


def stalled_worker(tmp_path, load_timeout_s: float, path: str = "landed"):  # type: ignore[no-untyped-def]
    """A worker loading by ``path`` from a ``Stalled`` store, and its KV caches."""
    stalled = Stalled(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}))
    w = WorkerSide(
        stalled,
        rank=0,
        tp_size=1,
        load_mode="layer",
        save_mode="layer",
        stats=StatsRecorder(),
        load_timeout_s=load_timeout_s,
    )
    kv = kv_caches(False)
    w.register(kv, NB)
    loading(w, path)
    return stalled, w, kv


@pytest.mark.parametrize("path", ["landed", "staged"])
def test_a_load_past_its_deadline_is_recomputed_and_its_late_read_lands_nowhere(tmp_path, path):
    stalled, w, kv = stalled_worker(tmp_path, 0.3, path)
    started = time.monotonic()
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [5, 6])]))
    assert time.monotonic() - started < 2  # the step went on at the deadline
    assert w.take_load_errors() == {5, 6}  # vLLM recomputes them
    assert w._stats.take().data["load_timeouts"] == 1
    stalled.release()  # the abandoned read completes now, after vLLM may have reused the blocks
    assert not any(t.any() for t in kv.values())  # nothing of it reached the cache


@pytest.mark.parametrize("path", ["landed", "staged"])
def test_a_load_no_layer_waited_for_is_recomputed_and_its_late_read_lands_nowhere(tmp_path, path):
    """vLLM did not call wait_for_layer_load: the blocks are recomputed, so the read still running
    must not reach them afterwards."""
    stalled, w, kv = stalled_worker(tmp_path, 30, path)
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [5, 6])]), report_layers=False)
    assert w.take_load_errors() == {5, 6}
    stalled.release()
    assert not any(t.any() for t in kv.values())
    assert len(w._abandoned) == 1  # the next loads are recomputed until it ends


def test_while_an_abandoned_read_is_stuck_new_loads_are_recomputed_at_once(tmp_path):
    """A store whose reads hang held every step that loaded for the whole deadline (fault_serving:
    requests queued behind them waited 2x the deadline); one abandoned read is enough to know."""
    stalled, w, kv = stalled_worker(tmp_path, 0.3)
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("r", IDS[:2], [5, 6])]))
    assert w.take_load_errors() == {5, 6}
    started = time.monotonic()
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("s", IDS[2:4], [7, 8])]))
    assert time.monotonic() - started < 0.1  # not another deadline's wait
    assert w.take_load_errors() == {7, 8}
    assert w._stats.take().data["store_skipped_blocks"] == 2
    stalled.release()  # the store answers again: the stuck read finishes, loads go to the store again
    deadline = time.monotonic() + 5
    while not all(t.done() for t in w._abandoned):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run_step(w, kv, UCMConnectorMetadata(loads=[BlockTransfer("t", IDS[2:4], [7, 8])]))
    assert w.take_load_errors() == {7, 8}  # IDS were never stored: a miss, but read from the store
    assert "store_skipped_blocks" not in w._stats.take().data


def test_without_a_deadline_cpu_loads_go_straight_into_the_cache(tmp_path):
    assert worker(tmp_path)._in_place_option is None
    w = worker(tmp_path)
    w.register(kv_caches(False), NB)
    assert w._in_place
    deadline = WorkerSide(
        create_store({"spec": "empty"}),
        rank=0,
        tp_size=1,
        load_mode="layer",
        save_mode="layer",
        stats=StatsRecorder(),
        load_timeout_s=1.0,
    )
    deadline.register(kv_caches(False), NB)
    assert not deadline._in_place  # staged: an abandoned read must not land in reused cache memory


def test_a_stuck_lookup_is_a_miss_and_later_lookups_do_not_queue_behind_it(tmp_path):
    real = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    tokens = list(range(16))
    put(real, tokens, 4)
    stalled = Stalled(real)
    s = side(stalled)
    s._lookups.timeout_s = 0.3
    started = time.monotonic()
    assert s.num_new_matched_tokens(Req("a", tokens), 0) == (0, False)  # at the deadline: a miss
    assert time.monotonic() - started < 1
    s.build_meta(step())  # the next step, with a budget of its own
    started = time.monotonic()
    assert s.num_new_matched_tokens(Req("b", tokens), 0) == (0, False)  # still stuck: at once
    assert time.monotonic() - started < 0.1
    stalled.release()
    time.sleep(0.1)
    s.build_meta(step())
    assert s.num_new_matched_tokens(Req("c", tokens), 0) == (4 * CTX.block_size - 1, False)  # answering again
    real.close()


class Slow:
    """A real store whose every lookup takes ``seconds``: slow (an overloaded NFS server), not stuck."""

    def __init__(self, store, seconds: float) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.seconds = seconds

    def lookup_prefix(self, ids):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)
        return self.store.lookup_prefix(ids)


def test_one_steps_lookups_share_one_deadline_and_the_rest_are_misses_at_once(tmp_path):
    """vLLM asks for every waiting request in one step: with a per-call deadline, six 0.3 s lookups held
    the scheduler 1.8 s. The step's budget is lookup_timeout_s for all of them together."""
    real = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    tokens = list(range(16))
    put(real, tokens, 4)
    s = side(Slow(real, 0.3))
    s._lookups.timeout_s = 0.5
    full_hit = (4 * CTX.block_size - 1, False)
    started = time.monotonic()
    answers = [s.num_new_matched_tokens(Req(f"r{i}", tokens), 0) for i in range(6)]
    assert time.monotonic() - started < 0.5 + 0.15
    # The first answers in 0.3 s; the second is cut at the deadline; the rest are not asked.
    assert answers == [full_hit] + [(0, False)] * 5
    stats = s._stats.take().data
    assert stats["lookup_timeouts"] == 1
    assert stats["lookup_deadline_skips"] == 4

    s.build_meta(step())  # the step ends: the next one has a fresh budget
    time.sleep(0.2)  # the lookup cut at the deadline returns meanwhile
    assert s.num_new_matched_tokens(Req("next", tokens), 0) == full_hit
    real.close()


def asgi_messages(app, path: str) -> list[dict]:  # type: ignore[no-untyped-def]
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "path": path, "method": "GET"}, None, send))
    return sent


def asgi_get(app, path: str) -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    sent = asgi_messages(app, path)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def store_state(app) -> tuple[int, str | None]:  # type: ignore[no-untyped-def]
    """/health's status and its X-UCM-Store header (None: absent)."""
    sent = asgi_messages(app, "/health")
    headers = dict(sent[0].get("headers", []))
    state = headers.get(b"x-ucm-store")
    return sent[0]["status"], None if state is None else state.decode()


async def vllm_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_a_store_stuck_past_its_limit_is_reported_by_health_until_it_answers(tmp_path, monkeypatch):
    real = create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}})
    tokens = list(range(16))
    stalled = Stalled(real)
    path = tmp_path / "stuck.json"
    s = side(stalled, health=StoreHealth(30.0, environ={HEALTH_FILE_ENV: str(path)}))
    s._lookups.timeout_s = 0.3
    started = time.time()
    assert s.num_new_matched_tokens(Req("a", tokens), 0) == (0, False)
    assert path.exists()  # written by the scheduler's process, read by the API server's

    since = json.loads(path.read_text())["since"]
    assert started - 0.1 <= since <= started + 0.1
    assert stuck_for(path, now=since + 29) is None  # a short stall keeps the engine in service
    assert stuck_for(path, now=since + 31) == (pytest.approx(31), 30)

    monkeypatch.setenv(HEALTH_FILE_ENV, str(path))
    app = HealthMiddleware(vllm_app)
    assert store_state(app) == (200, None)  # stuck for less than 30 s
    path.write_text(json.dumps({"since": since - 40, "unhealthy_after_s": 30}))
    # Still 200: the engine serves without its store; a 503 would take every engine sharing it out.
    assert store_state(app) == (200, "degraded; the KV store has not answered for 40 s (limit 30 s)")
    assert asgi_get(app, "/v1/models")[0] == 200  # only /health changes

    stalled.release()
    deadline = time.monotonic() + 5
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists()
    assert store_state(app) == (200, None)
    real.close()


def test_pd_steps_stop_waiting_on_a_store_whose_writes_hang_and_health_says_so_until_it_answers(tmp_path, monkeypatch):
    """Before the breaker every PD step waited the full pd_save_wait_s on a store whose writes hang, and
    /health said nothing. ``Recording`` with a closed gate stands in for a hung NFS or 3FS server."""
    gate = threading.Event()
    path = tmp_path / "stuck.json"
    health = StoreHealth(0.3, environ={HEALTH_FILE_ENV: str(path)}, worker=0)
    breaker = BreakerConfig(timeouts=2, timeout_s=0.2, probe_interval_s=0.2)
    store = BreakerStore(Recording(gate), breaker, on_degraded=health.stuck, on_recovered=health.answered)
    w = WorkerSide(
        store, rank=0, tp_size=1, load_mode="layer", save_mode="layer", stats=StatsRecorder(), pd_save_wait_s=0.5
    )
    kv = kv_caches(True)
    w.register(kv, NB)
    monkeypatch.setenv(HEALTH_FILE_ENV, str(path))
    app = HealthMiddleware(vllm_app)
    try:
        took = []
        for i in range(6):  # two PD prefills a step
            saves = [BlockTransfer(f"r{i}{j}", [bytes([i, j]) * 16], [2 * i + j], wait=True) for j in range(2)]
            started = time.monotonic()
            run_step(w, kv, UCMConnectorMetadata(saves=saves))
            took.append(time.monotonic() - started)
        assert took[0] >= 0.5  # the first step's saves hang: it waits pd_save_wait_s ...
        assert sum(took[1:]) < 0.3  # ... and the store is skipped from then on
        assert w._stats.take().data["save_failed_blocks"] == 10  # not saved: PD decodes are promised nothing
        assert store_state(app)[1].startswith("degraded")  # for longer than the 0.3 s limit

        gate.set()  # the server answers again: the next probe brings the store back
        deadline = time.monotonic() + 5
        while store_state(app)[1] is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        run_step(w, kv, UCMConnectorMetadata(saves=[BlockTransfer("again", [b"a" * 32], [15], wait=True)]))
        assert w._stats.take().data["saved_blocks"] == 3  # the two hung saves of step one, and this one
    finally:
        gate.set()
        w.close()


def test_the_scheduler_and_each_worker_keep_their_own_health_file(tmp_path, monkeypatch):
    path = tmp_path / "stuck.json"
    scheduler = StoreHealth(30.0, environ={HEALTH_FILE_ENV: str(path)})
    worker = StoreHealth(30.0, environ={HEALTH_FILE_ENV: str(path)}, worker=1)
    worker.stuck(time.time() - 40)
    scheduler.stuck(time.time())
    scheduler.answered()  # the scheduler's lookups answer again; the worker's store is still degraded
    monkeypatch.setenv(HEALTH_FILE_ENV, str(path))
    assert "has not answered for 40 s" in store_state(HealthMiddleware(vllm_app))[1]
    worker.answered()
    assert store_state(HealthMiddleware(vllm_app)) == (200, None)


def test_without_ucm_serve_nothing_is_written(tmp_path):
    health = StoreHealth(30.0, environ={})
    health.stuck(time.time())
    health.answered()
    assert health.path is None
    assert StoreHealth(None, environ={HEALTH_FILE_ENV: str(tmp_path / "x")}).path is None  # null: never unhealthy


def test_a_consumer_does_not_wait_for_promised_blocks_from_a_store_that_is_stuck(tmp_path):
    stalled = Stalled(create_store({"spec": "posix", "posix": {"roots": [str(tmp_path)]}}))
    s = side(stalled, timeout=30.0)
    s._lookups.timeout_s = 0.3
    pd = Req("r", list(range(16)), kv_transfer_params={"do_remote_prefill": True, PARAM_BLOCKS: 4})
    started = time.monotonic()
    assert s.num_new_matched_tokens(pd, 0) == (0, False)  # recompute now, not after 30 s of asking again
    assert time.monotonic() - started < 1
    assert s._stats.take().data["pd_wait_timeouts"] == 1
    stalled.release()
    stalled.store.close()


def test_health_waits_for_a_warm_up_request_on_the_server_itself(monkeypatch):
    """With UCM_ENGINE_WARMUP=1 the first /health starts one completion against the server that was
    probed (with the engine's key) and answers 503 until it returned."""
    calls: list[tuple[str, str | None]] = []
    release = threading.Event()

    async def engine(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        headers = dict(scope["headers"])
        calls.append((scope["path"], headers.get(b"authorization", b"").decode() or None))
        if scope["path"] == "/v1/completions":
            await asyncio.to_thread(release.wait, 10)
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    monkeypatch.setenv(WARMUP_ENV, "1")
    monkeypatch.setenv("VLLM_API_KEY", "engine-key")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(HealthMiddleware(engine), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        health = f"http://127.0.0.1:{port}/health"
        first = httpx.get(health)
        assert first.status_code == 503 and "warming up" in first.json()["error"]
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(health).status_code == 503  # the warm-up request has not returned
        release.set()
        while httpx.get(health).status_code != 200:
            assert time.monotonic() < deadline + 5, calls
            time.sleep(0.02)
        assert calls[:2] == [("/v1/models", "Bearer engine-key"), ("/v1/completions", "Bearer engine-key")]
    finally:
        server.should_exit = True
        thread.join(5)
