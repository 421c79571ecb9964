"""shop: a second real application for bmeg's testbed, in another runtime than socialnet's Go.

Nine small Python services shaped like Online Boutique (the Nezha dev set's application): a
frontend that fans out to a catalog, a cart in Redis, a currency converter and recommendations,
and a checkout that calls six services in turn. Each service is its own process, serves JSON over
HTTP/1.1 (`ThreadingHTTPServer`, a thread per connection, keep-alive) and is traced with the
OpenTelemetry Python SDK as a user sets it up: a `TracerProvider` whose resource comes from
`OTEL_SERVICE_NAME`, the `BatchSpanProcessor` and the OTLP/HTTP exporter with their defaults
(`OTEL_EXPORTER_OTLP_ENDPOINT` names the Collector). The W3C `traceparent` header carries the
context between services. A CPython process stamps its spans when its thread runs under the GIL,
so a CPU-starved service shows its backlog where this runtime puts it, not where Go's does.

    python shop.py serve SERVICE --port P --peers frontend=127.0.0.1:P0,... --redis 127.0.0.1:R
    python shop.py load --target 127.0.0.1:P0 --rate 30 --seconds 600 --seed 0

Every operation costs a fixed amount of CPU time (`WORK_US`, measured on the thread's own clock,
so contention stretches it in wall time) and makes its calls in groups (a group's calls run
together). Code faults are switched per operation by `POST /_admin/fault {"operation": OP,
"mode": "error" | "return" | null}`: "error" fails the request (the server span's status ERROR
with the exception recorded, HTTP 500, and the callers fail in turn); "return" answers at once with
an empty result, so the callers go on with less (an empty catalog needs no prices, an empty cart no
products): a shorter path, as an early return in real code.
"""

from __future__ import annotations

import argparse
import contextvars
import http.client
import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: CPU time (µs) each operation spends of its own, besides its calls
WORK_US: dict[str, int] = {
    "home": 400, "product": 300, "add_to_cart": 200, "checkout": 200,
    "place_order": 500, "get_cart": 150, "add_item": 150, "empty_cart": 100,
    "list_products": 300, "get_product": 150, "convert": 250, "currencies": 80,
    "list_recommendations": 250, "get_quote": 200, "ship_order": 250, "charge": 350, "send_confirmation": 400,
}
#: which service serves each operation
SERVES: dict[str, str] = {
    "home": "frontend", "product": "frontend", "add_to_cart": "frontend", "checkout": "frontend",
    "place_order": "checkout", "get_cart": "cart", "add_item": "cart", "empty_cart": "cart",
    "list_products": "catalog", "get_product": "catalog", "convert": "currency", "currencies": "currency",
    "list_recommendations": "recommendation", "get_quote": "shipping", "ship_order": "shipping",
    "charge": "payment", "send_confirmation": "email",
}
SERVICES = ("frontend", "checkout", "cart", "catalog", "currency", "recommendation", "shipping", "payment", "email")
#: the service the load calls (its server spans are the traces' roots)
ENTRY = "frontend"
#: the load's request mix over the frontend's operations
MIX = {"home": 0.6, "product": 0.2, "add_to_cart": 0.1, "checkout": 0.1}
PRODUCTS = 40
USERS = 500
TIMEOUT_S = 10.0
MAX_BODY_BYTES = 1 << 20


class Injected(Exception):
    """The exception a code fault of mode "error" raises."""


class Service:
    """One service: its operations, its peers' connections (one per thread and peer), its faults."""

    def __init__(self, name: str, peers: dict[str, str], redis_address: str | None):
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.name, self.peers = name, peers
        self.provider = TracerProvider(resource=Resource.create())  # service.name from OTEL_SERVICE_NAME
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = trace.get_tracer("shop", tracer_provider=self.provider)
        self.faults: dict[str, str] = {}
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="calls")
        self.redis: Any = None  # redis.Redis where the service has a store
        if redis_address:
            import redis

            host, port = redis_address.rsplit(":", 1)
            self.redis = redis.Redis(host=host, port=int(port), socket_timeout=TIMEOUT_S, max_connections=64)

    # --- tracing -------------------------------------------------------------------------

    def handle(self, operation: str, body: dict, headers) -> tuple[int, dict]:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        context = propagate.extract(dict(headers.items()))
        with self.tracer.start_as_current_span(operation, context=context, kind=SpanKind.SERVER,
                                               record_exception=False, set_status_on_exception=False,
                                               attributes={"http.request.method": "POST", "url.path": "/" + operation,
                                                           "rpc.method": operation}) as span:
            mode = self.faults.get(operation)
            try:
                if mode == "error":
                    raise Injected(f"injected fault in {self.name}.{operation}")
                answer = {} if mode == "return" else OPERATIONS[operation](self, body)
            except Exception as error:  # a request's failure is its answer; the server goes on
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, str(error)))
                span.set_attribute("http.response.status_code", 500)
                return 500, {"error": str(error)}
            span.set_attribute("http.response.status_code", 200)
            return 200, answer

    def call(self, operation: str, body: dict) -> dict:
        """Call `operation` on the service that serves it, under a client span."""
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        peer = SERVES[operation]
        host, port = self.peers[peer].rsplit(":", 1)
        with self.tracer.start_as_current_span(operation, kind=SpanKind.CLIENT, record_exception=False,
                                               attributes={"peer.service": peer, "server.address": host,
                                                           "server.port": int(port), "rpc.method": operation}) as span:
            headers = {"content-type": "application/json"}
            propagate.inject(headers)
            status, answer = self._post(peer, host, int(port), "/" + operation, json.dumps(body).encode(), headers)
            span.set_attribute("http.response.status_code", status)
            if status != 200:
                span.set_status(Status(StatusCode.ERROR, f"{peer} answered {status}"))
                raise RuntimeError(f"{peer}.{operation} answered {status}: {answer.get('error', '')}")
            return answer

    def _post(self, peer: str, host: str, port: int, path: str, data: bytes, headers: dict) -> tuple[int, dict]:
        connections = self.local.__dict__.setdefault("connections", {})
        for attempt in (0, 1):  # a kept-alive connection the peer closed is opened again once
            connection = connections.get(peer) or http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
            connections[peer] = connection
            try:
                connection.request("POST", path, data, headers)
                response = connection.getresponse()
                return response.status, json.loads(response.read() or b"{}")
            except (OSError, http.client.HTTPException):
                connection.close()
                connections.pop(peer, None)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def store(self, command: str, *args):
        """A Redis command under a client span, as the database semantic conventions name it."""
        from opentelemetry.trace import SpanKind

        with self.tracer.start_as_current_span(command, kind=SpanKind.CLIENT, attributes={
                "db.system.name": "redis", "db.system": "redis", "peer.service": "redis",
                "db.operation.name": command, "server.address": "127.0.0.1"}):
            return self.redis.execute_command(command, *args)

    def together(self, *calls: tuple[str, dict]) -> list[dict]:
        """Make calls at once, each on a pool thread in this context (the spans keep their parent)."""
        futures = [self.pool.submit(contextvars.copy_context().run, self.call, operation, body)
                   for operation, body in calls]
        return [future.result() for future in futures]


def burn(microseconds: int) -> None:
    """Spend this much CPU time of the calling thread (a starved thread takes longer in wall time)."""
    end = time.thread_time_ns() + microseconds * 1000
    while time.thread_time_ns() < end:
        pass


# --- the operations ----------------------------------------------------------------------


def home(service: Service, body: dict) -> dict:
    burn(WORK_US["home"])
    user = body.get("user", 0)
    catalog, cart, _ = service.together(("list_products", {}), ("get_cart", {"user": user}), ("currencies", {}))
    products = catalog.get("products", [])
    if products:
        service.together(("convert", {"amounts": [p["price"] for p in products], "to": "EUR"}),
                         ("list_recommendations", {"user": user}))
    return {"products": len(products), "cart": len(cart.get("items", {}))}


def product(service: Service, body: dict) -> dict:
    burn(WORK_US["product"])
    item, _ = service.together(("get_product", {"id": body.get("id", 0)}), ("get_cart", {"user": body.get("user", 0)}))
    if item:
        service.together(("convert", {"amounts": [item["price"]], "to": "EUR"}), ("list_recommendations", {"user": 0}))
    return {"product": item.get("id")}


def add_to_cart(service: Service, body: dict) -> dict:
    burn(WORK_US["add_to_cart"])
    item = service.call("get_product", {"id": body.get("id", 0)})
    if item:
        service.call("add_item", {"user": body.get("user", 0), "id": item["id"], "quantity": 1})
    return {}


def checkout(service: Service, body: dict) -> dict:
    burn(WORK_US["checkout"])
    return service.call("place_order", {"user": body.get("user", 0)})


def place_order(service: Service, body: dict) -> dict:
    burn(WORK_US["place_order"])
    user = body.get("user", 0)
    items = service.call("get_cart", {"user": user}).get("items", {})
    prices = [service.call("get_product", {"id": int(i)}).get("price", 0.0) for i in items]
    if prices:
        service.call("convert", {"amounts": prices, "to": "EUR"})
    service.call("get_quote", {"items": len(items)})
    service.call("charge", {"amount": sum(prices)})
    service.call("ship_order", {"user": user})
    service.call("send_confirmation", {"user": user})
    service.call("empty_cart", {"user": user})
    return {"items": len(items)}


def get_cart(service: Service, body: dict) -> dict:
    burn(WORK_US["get_cart"])
    raw = service.store("HGETALL", f"cart:{body.get('user', 0)}")
    return {"items": {key.decode(): int(value) for key, value in raw.items()} if isinstance(raw, dict)
            else {raw[i].decode(): int(raw[i + 1]) for i in range(0, len(raw), 2)}}


def add_item(service: Service, body: dict) -> dict:
    burn(WORK_US["add_item"])
    key = f"cart:{body.get('user', 0)}"
    service.store("HINCRBY", key, str(body.get("id", 0)), int(body.get("quantity", 1)))
    service.store("EXPIRE", key, 120)  # carts of users who never check out do not pile up
    return {}


def empty_cart(service: Service, body: dict) -> dict:
    burn(WORK_US["empty_cart"])
    service.store("DEL", f"cart:{body.get('user', 0)}")
    return {}


def list_products(service: Service, body: dict) -> dict:
    burn(WORK_US["list_products"])
    return {"products": json.loads(service.store("GET", "catalog") or b"[]")[:8]}


def get_product(service: Service, body: dict) -> dict:
    burn(WORK_US["get_product"])
    raw = service.store("HGET", "products", str(body.get("id", 0)))
    return json.loads(raw) if raw else {}


def convert(service: Service, body: dict) -> dict:
    burn(WORK_US["convert"] + 20 * len(body.get("amounts", [])))
    return {"amounts": [round(a * 0.93, 2) for a in body.get("amounts", [])]}


def currencies(service: Service, body: dict) -> dict:
    burn(WORK_US["currencies"])
    return {"currencies": ["EUR", "USD", "JPY", "GBP"]}


def list_recommendations(service: Service, body: dict) -> dict:
    burn(WORK_US["list_recommendations"])
    products = service.call("list_products", {}).get("products", [])
    return {"ids": [p["id"] for p in products[:4]]}


def leaf(operation: str):
    def run(service: Service, body: dict) -> dict:
        burn(WORK_US[operation])
        return {"ok": True}
    return run


OPERATIONS = {
    "home": home, "product": product, "add_to_cart": add_to_cart, "checkout": checkout, "place_order": place_order,
    "get_cart": get_cart, "add_item": add_item, "empty_cart": empty_cart, "list_products": list_products,
    "get_product": get_product, "convert": convert, "currencies": currencies,
    "list_recommendations": list_recommendations,
    **{operation: leaf(operation) for operation in ("get_quote", "ship_order", "charge", "send_confirmation")},
}


def seed_catalog(service: Service) -> None:
    """The catalog's products in Redis (untraced: set-up, not a request)."""
    rng = random.Random(7)
    products = [{"id": i, "name": f"product-{i}", "price": round(rng.uniform(5, 200), 2)} for i in range(PRODUCTS)]
    service.redis.set("catalog", json.dumps(products))
    service.redis.hset("products", mapping={str(p["id"]): json.dumps(p) for p in products})


# --- serving -----------------------------------------------------------------------------


def handler_for(service: Service):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # the headers and the body leave in two writes: with Nagle's algorithm the body waits for
        # the client's delayed ACK (40 ms), which no real RPC server makes its callers pay
        disable_nagle_algorithm = True
        timeout = TIMEOUT_S  # a client that stops sending frees its thread

        def log_message(self, format, *args):  # no access log
            pass

        def _answer(self, status: int, answer: dict) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/healthz":
                self._answer(200, {"service": service.name})
            elif self.path == "/_admin/fault":
                self._answer(200, service.faults)
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            try:
                length = int(self.headers.get("content-length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True  # the body is not read: the connection cannot carry another request
                self._answer(413, {"error": f"a body of 0-{MAX_BODY_BYTES} bytes with its content-length"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError as error:
                self._answer(400, {"error": f"body: {error}"})
                return
            if not isinstance(body, dict):
                self._answer(400, {"error": "the body is a JSON object"})
                return
            operation = self.path.lstrip("/")
            if self.path == "/_admin/fault":
                self._answer(*set_fault(service, body))
            elif SERVES.get(operation) == service.name:
                self._answer(*service.handle(operation, body, self.headers))
            else:
                self._answer(404, {"error": f"{service.name} does not serve {self.path}"})

    return Handler


def set_fault(service: Service, body: dict) -> tuple[int, dict]:
    operation, mode = str(body.get("operation")), body.get("mode")
    if SERVES.get(operation) != service.name or mode not in ("error", "return", None):
        return 400, {"error": f"{service.name} has no operation {operation!r} or mode {mode!r} is not error/return/null"}
    if mode is None:
        service.faults.pop(operation, None)
    else:
        service.faults[operation] = mode
    return 200, service.faults


def serve(args: argparse.Namespace) -> None:
    peers = dict(pair.split("=", 1) for pair in args.peers.split(",") if pair)
    service = Service(args.service, peers, args.redis)
    if args.service == "catalog":
        seed_catalog(service)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(service))
    server.daemon_threads = True

    def stop(signum, frame):  # flush the spans the batch processor holds, then exit
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    finally:
        service.provider.shutdown()


# --- the load ----------------------------------------------------------------------------


def load(args: argparse.Namespace) -> None:
    """Open-loop Poisson arrivals over the mix, from a thread pool; prints the answers' counts."""
    rng = random.Random(args.seed)
    host, port = args.target.rsplit(":", 1)
    local = threading.local()
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def send(operation: str, body: dict) -> None:
        connection = getattr(local, "connection", None) or http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
        local.connection = connection
        try:
            connection.request("POST", "/" + operation, json.dumps(body).encode(), {"content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            connection.close()
            local.connection = None
            status = 0
        with lock:
            counts[status] = counts.get(status, 0) + 1

    operations, weights = zip(*MIX.items())
    end = time.monotonic() + args.seconds
    at = time.monotonic()
    with ThreadPoolExecutor(max_workers=128) as pool:
        while at < end:
            at += rng.expovariate(args.rate)
            time.sleep(max(0.0, at - time.monotonic()))
            operation = rng.choices(operations, weights)[0]
            pool.submit(send, operation, {"user": rng.randrange(USERS), "id": rng.randrange(PRODUCTS)})
    print(json.dumps({str(k): v for k, v in sorted(counts.items())}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("serve", help="run one service")
    one.add_argument("service", choices=SERVICES)
    one.add_argument("--port", type=int, required=True)
    one.add_argument("--peers", default="", help="service=host:port,... of the services it calls")
    one.add_argument("--redis", default=None, help="host:port of Redis (cart, catalog)")
    traffic = commands.add_parser("load", help="send the request mix to the frontend")
    traffic.add_argument("--target", required=True)
    traffic.add_argument("--rate", type=float, default=30.0)
    traffic.add_argument("--seconds", type=float, default=60.0)
    traffic.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    (serve if args.command == "serve" else load)(args)


if __name__ == "__main__":
    main()
