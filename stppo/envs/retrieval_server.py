"""A Search-R1-compatible retrieval server over a bm25 index (standard library HTTP server).

    python -m stppo.envs.retrieval_server --corpus CORPUS.jsonl --host 127.0.0.1 --port 8000 [--topk 3]
    python -m stppo.envs.retrieval_server --task synthetic_multihop --port 8000

POST /retrieve  {"queries": [str, ...], "topk": int (optional), "return_scores": bool (default false)}
  → {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}   (return_scores)
  → {"result": [[{"id", "contents"}, ...], ...]}                                   (otherwise)
GET /health     → {"status": "ok", "docs": N}
The corpus is Search-R1's jsonl form, one {"id", "contents": "\\"Title\\"\\ntext"} per line.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stppo.envs.retrievers import BM25Retriever

MAX_BODY = 16 * 1024 * 1024  # bytes


def _handle_retrieve(retriever: BM25Retriever, body: Any, default_topk: int) -> dict:
    """The JSON answer to one /retrieve request; ValueError on a malformed request."""
    if not isinstance(body, dict) or not isinstance(body.get("queries"), list) or not all(
            isinstance(q, str) for q in body["queries"]):
        raise ValueError('expected JSON {"queries": [str, ...], "topk": int, "return_scores": bool}')
    topk = body.get("topk")
    topk = default_topk if topk is None else topk
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    scored = body.get("return_scores", False)
    hits = retriever.retrieve_scored(body["queries"], topk)
    result = []
    for row in hits:
        docs = [{"id": d.id, "contents": d.contents} for d, _ in row]
        result.append([{"document": doc, "score": s} for doc, (_, s) in zip(docs, row)]
                      if scored else docs)
    return {"result": result}


def make_server(retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 8000,
                default_topk: int = 3) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer answering /retrieve and /health (not started)."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "docs": len(retriever.corpus)})
            else:
                self._send(404, {"error": "unknown path; use GET /health or POST /retrieve"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": "unknown path; use POST /retrieve"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._send(413, {"error": f"request body over {MAX_BODY} bytes"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                self._send(200, _handle_retrieve(retriever, body, default_topk))
            except ValueError as err:  # includes JSON decode errors
                self._send(400, {"error": str(err)})

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
            pass

    return ThreadingHTTPServer((host, port), Handler)


def _load_corpus(args: argparse.Namespace):
    if args.corpus:
        from stppo.envs.datasets import read_corpus_jsonl
        return read_corpus_jsonl(args.corpus)
    from stppo.envs.tasks import build_task
    return build_task(args.task).corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stppo.envs.retrieval_server",
                                     description="Search-R1-compatible bm25 retrieval server")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="Search-R1 corpus jsonl: one {id, contents} per line")
    src.add_argument("--task", help="serve the corpus of a built-in task, e.g. synthetic_multihop")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3, help="default topk when a request has none")
    args = parser.parse_args(argv)
    try:
        retriever = BM25Retriever(_load_corpus(args))
        server = make_server(retriever, args.host, args.port, args.topk)
    except (FileNotFoundError, ValueError, OSError) as err:
        sys.exit(f"retrieval_server: {err}")
    print(f"retrieval_server: {len(retriever.corpus)} docs on http://{args.host}:"
          f"{server.server_address[1]} (POST /retrieve, GET /health)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
