"""A router for disaggregated serving through handoff-broker: one OpenAI completion request, prefilled on one
`vllm serve` instance and decoded on another.

    python examples/proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each `POST /v1/completions` it sends the request to the prefill instance (a kv_producer) with `max_tokens` 1,
takes the `kv_transfer_params` its response carries (the hand-off's id, position, model and ticket), and sends the
original request with them to the decode instance (a kv_consumer), whose answer it returns. Standard library only;
no streaming, no retries: an example to read, not a production router.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def make_handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                return self._reply(404, {"error": f"{self.path}: only /v1/completions is routed"})
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            status, prefilled = post(f"{prefill}/v1/completions", {**body, "max_tokens": 1, "stream": False})
            if status != 200:
                return self._reply(status, prefilled)
            status, decoded = post(f"{decode}/v1/completions",
                                   {**body, "kv_transfer_params": prefilled.get("kv_transfer_params")})  # fmt: skip
            self._reply(status, decoded)

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
