"""A push-mode P/D proxy for the serving tests: what vLLM's push proxy
(``toy_push_proxy_server.py`` in vLLM's NIXL integration tests) does with a completion,
written here with the standard library.

1. P's leg: the client's request with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params`` ``{"do_remote_decode": True, "do_remote_prefill": False}``
   (every ``remote_*`` None);
2. P answers its ``kv_transfer_params`` (its engine, request id, side channel, TP size);
3. D's leg: the client's request with ``{"do_remote_prefill": True, "do_remote_decode":
   False}`` and P's ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
   ``remote_port``, ``tp_size`` (no ``remote_block_ids``: D allocates its blocks and
   registers them with P, which writes into them);
4. D's answer goes to the client, streamed as it comes when the client asked for a
   stream (as vLLM's proxies do: a client's time to first token is D's).

Run: ``python push_proxy.py --port N --prefill URL --decode URL`` (round robin over
several of each). ``/healthcheck`` answers 200 once it listens.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: The keys of P's answer D's leg carries, as vLLM's push proxy passes them.
D_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def post(url: str, body: dict, request_id: str, timeout: float = 300.0) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "X-Request-Id": request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def prefill_leg(p_url: str, body: dict, path: str, request_id: str) -> tuple[int, bytes, dict]:
    """Steps 1-2: P's leg; returns P's status, raw answer and ``kv_transfer_params``."""
    leg = dict(body)
    leg.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    status, raw = post(p_url + path, leg, request_id)
    params = {}
    if status == 200:
        params = json.loads(raw).get("kv_transfer_params") or {}
    return status, raw, params


def decode_body(body: dict, p_params: dict) -> dict:
    """Step 3: D's leg's body, naming P as the push proxy does."""
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **{k: p_params.get(k) for k in D_KEYS},
    }
    return leg


def decode_leg(d_url: str, body: dict, path: str, request_id: str, p_params: dict,
               timeout: float = 300.0) -> tuple[int, bytes]:
    """Steps 3-4: D's leg; D's status and whole answer."""
    return post(d_url + path, decode_body(body, p_params), request_id, timeout)


def serve(port: int, prefill: list[str], decode: list[str]) -> None:
    p_next, d_next = itertools.cycle(prefill), itertools.cycle(decode)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, raw: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._send(200 if self.path == "/healthcheck" else 404, b"{}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, b"{}")
                return
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            with lock:
                p_url, d_url = next(p_next), next(d_next)
            request_id = self.headers.get("X-Request-Id") or str(uuid.uuid4())
            try:
                status, raw, params = prefill_leg(p_url, body, self.path, request_id)
                if status != 200:
                    self._send(status, raw)
                    return
                self._relay(d_url, decode_body(body, params), request_id)
            except (OSError, http.client.HTTPException, ValueError) as e:
                # P or D unreachable, or an answer cut short: the client sees a 502 (or,
                # once D's stream began, a connection that closes early).
                if not self._started:
                    self._send(502, json.dumps({"error": repr(e)}).encode())

        _started = False

        def _relay(self, d_url: str, leg: dict, request_id: str) -> None:
            """Step 4: D's answer to the client, each chunk as it arrives (no length:
            HTTP/1.0, the connection's end ends the answer)."""
            req = urllib.request.Request(
                d_url + self.path, data=json.dumps(leg).encode(),
                headers={"content-type": "application/json", "X-Request-Id": request_id},
            )
            try:
                r = urllib.request.urlopen(req, timeout=300)
            except urllib.error.HTTPError as e:
                self._send(e.code, e.read())
                return
            with r:
                self._started = True
                self.send_response(r.status)
                self.send_header("content-type",
                                 r.headers.get("content-type", "application/json"))
                self.end_headers()
                while chunk := r.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()

        def log_message(self, fmt: str, *args) -> None:
            print(fmt % args, flush=True)

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", required=True)
    ap.add_argument("--decode", nargs="+", required=True)
    a = ap.parse_args()
    serve(a.port, a.prefill, a.decode)
