"""bm25 index cache, the http client against the shipped server, failures and retries."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from servers import free_port, start_on_free_port

from stppo.envs import build_task, write_corpus_jsonl
from stppo.envs import retrievers
from stppo.envs.base import Doc
from stppo.envs.retrievers import BM25Retriever, HttpRetriever, build_retriever, s_stem, tokenize

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def task():
    return build_task("synthetic_multihop", n_sft=10, n_train=10, n_val=60, n_test=10)


@pytest.fixture(scope="module")
def server(task, tmp_path_factory):
    """The shipped server as a subprocess on a free port; stopped by its pid."""
    tmp = tmp_path_factory.mktemp("server")
    corpus = write_corpus_jsonl(task.corpus, tmp / "corpus.jsonl")
    env = dict(os.environ, STPPO_CACHE_DIR=str(tmp / "cache"), OMP_NUM_THREADS="1")
    proc, url = start_on_free_port(lambda port: [sys.executable, "-m", "stppo.envs.retrieval_server", "--corpus",
                                                 str(corpus), "--host", "127.0.0.1", "--port", str(port)],
                                   "/health", 30, tmp / "server.log", env=env)
    try:
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STPPO_CACHE_DIR", str(tmp_path / "cache"))


def test_tokenize_lowercases_drops_stopwords_and_stems():
    assert tokenize("The Cities of Elara-Voss WORKS for us") == ["city", "elara", "voss", "work", "us"]
    assert [s_stem(w) for w in ("flies", "horses", "glass", "bus", "toes", "born")] == [
        "fly", "horse", "glass", "bus", "toe", "born"]


def test_bm25_index_is_cached_and_reloaded(task, tmp_path):
    before = retrievers.INDEX_BUILDS
    first = BM25Retriever(task.corpus)
    assert not first.from_cache and retrievers.INDEX_BUILDS == before + 1
    files = sorted(p for p in first.index_dir.iterdir())
    assert first.index_dir.parent == tmp_path / "cache" / "bm25" and files
    mtimes = {p.name: p.stat().st_mtime_ns for p in files}
    second = BM25Retriever(task.corpus)
    assert second.from_cache and retrievers.INDEX_BUILDS == before + 1  # loaded, not re-indexed
    assert {p.name: p.stat().st_mtime_ns for p in second.index_dir.iterdir()} == mtimes
    queries = [h[0] for q in task.split("val") for h in q.meta["plan"]]
    assert second.retrieve(queries, 3) == first.retrieve(queries, 3)
    other = BM25Retriever(task.corpus[:-1])  # another corpus → another entry
    assert not other.from_cache and other.index_dir != first.index_dir
    assert retrievers.INDEX_BUILDS == before + 2


def test_bm25_ranking_and_ties():
    docs = [Doc("a", "Alpha", "red apples"), Doc("b", "Beta", "green apples and red cherries"),
            Doc("c", "Gamma", "blue sky"), Doc("d", "Delta", "blue sky")]
    r = BM25Retriever(docs, use_cache=False)
    assert [d.id for d in r.retrieve(["red apples"], 2)[0]] == ["a", "b"]
    assert [d.id for d in r.retrieve(["blue sky"], 2)[0]] == ["c", "d"]  # tie → corpus order
    assert [d.id for d in r.retrieve(["zzz unknown"], 2)[0]] == ["a", "b"]  # no match: corpus order
    assert len(r.retrieve(["red"], 10)[0]) == 4  # topk beyond the corpus size
    assert r.retrieve([], 3) == []


FAKE_JAX = {"__init__.py": "import os\nopen(os.environ['JAX_MARKER'], 'w').close()\n",
            "lax.py": "def top_k(x, k):\n    return x[:k], list(range(k))\n"}


def test_bm25s_never_imports_jax(tmp_path):
    """bm25s runs a JAX op at import when JAX is installed (on a GPU machine that preallocates
    75% of the GPU): the retriever imports bm25s with JAX hidden. An installed stand-in `jax`
    package records whether anything imported it; a plain `import bm25s` does."""
    (tmp_path / "jax").mkdir()
    for name, text in FAKE_JAX.items():
        (tmp_path / "jax" / name).write_text(text)
    marker = tmp_path / "imported"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
           "JAX_MARKER": str(marker)}
    code = ("from stppo.envs.base import Doc; from stppo.envs.retrievers import BM25Retriever; "
            "r = BM25Retriever([Doc('a', 'Paris', 'Paris is in France'), "
            "Doc('b', 'Rome', 'Rome is in Italy')], use_cache=False); "
            "print(r.retrieve(['Where is Rome?'], 1)[0][0].id)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["b"] and not marker.exists()
    subprocess.run([sys.executable, "-c", "import bm25s"], env=env, check=True)
    assert marker.exists()  # the stand-in is found: the check above could fail


def test_http_client_matches_in_process_bm25(task, server):
    local = BM25Retriever(task.corpus)
    client = build_retriever("http", url=server, timeout_s=5, retries=1)
    queries = [h[0] for q in task.split("val") for h in q.meta["plan"]] + ["", "zzz", "é ß 漢字"]
    assert client.retrieve(queries, 3) == local.retrieve(queries, 3)
    assert HttpRetriever(server + "/retrieve/").retrieve(queries[:2], 1) == local.retrieve(queries[:2], 1)


def test_server_protocol(server, task):
    raw = requests.post(server + "/retrieve", json={"queries": ["a born", "b"], "topk": 2}).json()
    assert len(raw["result"]) == 2 and set(raw["result"][0][0]) == {"id", "contents"}
    scored = requests.post(server + "/retrieve",
                           json={"queries": ["x"], "topk": 1, "return_scores": True}).json()
    hit = scored["result"][0][0]
    assert set(hit) == {"document", "score"} and isinstance(hit["score"], float)
    default = requests.post(server + "/retrieve", json={"queries": ["x"]}).json()
    assert len(default["result"][0]) == 3  # the server's --topk default
    assert requests.get(server + "/health").json() == {"status": "ok", "docs": len(task.corpus)}
    bad = requests.post(server + "/retrieve", json={"query": "x"})
    assert bad.status_code == 400 and "queries" in bad.json()["error"]
    assert requests.post(server + "/retrieve", json={"queries": ["x"], "topk": 0}).status_code == 400
    assert requests.post(server + "/nope", json={}).status_code == 404


def test_server_down_is_a_clear_error_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    client = HttpRetriever(url, timeout_s=1.0, retries=2, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as err:
        client.retrieve(["q"], 2)
    elapsed = time.monotonic() - start
    msg = str(err.value)
    assert url in msg and "after 3 attempts" in msg and "python -m stppo.envs.retrieval_server" in msg
    assert "\n" not in msg
    print(f"server down: ConnectionError after {elapsed:.2f} s")
    assert elapsed < 5


class _TestServer:
    """A tiny protocol server in a thread: counts requests, fails the first ones as told, or
    (`hold`) answers none until the test is over."""

    def __init__(self, fail_first=0, hold=False):
        self.requests, self.fail_first = [], fail_first
        self.released = threading.Event()
        if not hold:
            self.released.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.released.wait(60)  # a held answer comes after the client gave up
                if len(outer.requests) <= outer.fail_first:
                    code, payload = 503, {"error": "busy"}
                else:
                    code, payload = 200, {"result": [[{"document": {"id": f"{q}-1", "contents": f'"{q}"\nt'},
                                                       "score": 1.0}] for q in body["queries"]]}
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def received(self, n: int, within_s: float = 60) -> bool:
        """Whether `n` requests arrived, waiting for them up to `within_s` (a hang guard: the
        handler threads may still be reading what the client sent before it gave up)."""
        deadline = time.monotonic() + within_s
        while len(self.requests) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.requests) == n

    def __exit__(self, *exc):
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_one_request_per_call_and_retry_on_5xx():
    with _TestServer(fail_first=1) as srv:
        docs = HttpRetriever(srv.url, timeout_s=2, retries=2, backoff_s=0.01).retrieve(["a", "b", "c"], 2)
    assert len(srv.requests) == 2  # one 503, then one successful request for all three queries
    assert srv.requests[1] == {"queries": ["a", "b", "c"], "topk": 2, "return_scores": True}
    assert docs == [[Doc("a-1", "a", "t")], [Doc("b-1", "b", "t")], [Doc("c-1", "c", "t")]]


def test_timeout_is_retried_then_reported():
    """The server holds every answer until the test ends: a client that raised did not wait for
    one (one that waited would hang here until the module's timeout)."""
    with _TestServer(hold=True) as srv:
        with pytest.raises(ConnectionError, match=r"no answer within timeout_s=0.2.*retrieval_server"):
            HttpRetriever(srv.url, timeout_s=0.2, retries=1, backoff_s=0.05).retrieve(["q"], 1)
        assert srv.received(2), srv.requests  # retries=1: two tries
    assert len(srv.requests) == 2, srv.requests
