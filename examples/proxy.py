"""A router for disaggregated serving through handoff-broker: each OpenAI request prefilled on one `vllm serve`
instance and decoded on another, in vLLM's P/D convention (the one routers of NIXL-style connectors speak).

    python examples/proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each `POST /v1/completions` or `/v1/chat/completions` it sends the request to the prefill instance (a
kv_producer) with `max_tokens` 1, no streaming and `kv_transfer_params` `{"do_remote_decode": true}` (only a request
that asks is handed off), takes the `kv_transfer_params` its response carries (`do_remote_prefill`, the hand-off's
id, position, model, ticket and prompt digest), and sends the original request with them to the decode instance (a
kv_consumer), whose answer it relays: whole, or event by event when the request streams (`"stream": true`).
`GET /v1/models` is passed through to the decode instance. Standard library only, no retries: an example to read,
not a production router.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTED = ("/v1/completions", "/v1/chat/completions")
PREFILL_ONLY = {"max_tokens": 1, "max_completion_tokens": 1, "stream": False, "stream_options": None}


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def prefill_request(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, not streamed, its hand-off asked for."""
    request = {**body, **PREFILL_ONLY, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    if path == "/v1/completions":
        del request["max_completion_tokens"]
    return {key: value for key, value in request.items() if value is not None}


def make_handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/v1/models":
                return self._reply(404, {"error": f"{self.path}: only /v1/models is passed through"})
            try:
                with urllib.request.urlopen(f"{decode}/v1/models", timeout=30) as response:
                    return self._reply(response.status, json.loads(response.read()))
            except urllib.error.HTTPError as e:
                return self._reply(e.code, json.loads(e.read() or b"{}"))

        def do_POST(self) -> None:
            if self.path not in ROUTED:
                return self._reply(404, {"error": f"{self.path}: only {' and '.join(ROUTED)} are routed"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            status, prefilled = post(f"{prefill}{self.path}", prefill_request(self.path, body))
            if status != 200:
                return self._reply(status, prefilled)
            decoding = {**body, "kv_transfer_params": prefilled.get("kv_transfer_params")}
            if not body.get("stream"):
                return self._reply(*post(f"{decode}{self.path}", decoding))
            self._relay_stream(f"{decode}{self.path}", decoding)

        def _relay_stream(self, url: str, body: dict) -> None:
            """The decode instance's server-sent events, passed on as they come (the connection's end ends them)."""
            request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
            try:
                response = urllib.request.urlopen(request, timeout=300)
            except urllib.error.HTTPError as e:
                return self._reply(e.code, json.loads(e.read() or b"{}"))
            with response:
                self.send_response(response.status)
                self.send_header("Content-Type", response.headers.get("Content-Type", "text/event-stream"))
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for line in response:
                    self.wfile.write(line)
                    self.wfile.flush()

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    parser.add_argument("--decode", required=True, help="the decode instance's base URL")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(
        (args.host, args.port), make_handler(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    )
    print(f"proxy on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
