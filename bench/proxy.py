"""The capture proxy's added latency: the same requests to the upstream directly (A) and through
``tracecar proxy`` (B), interleaved in one run (A B B A ...), recording on (a real collector).

Three processes on 127.0.0.1: a vLLM-shaped OpenAI server (tests/support/openai_upstream.py, the
deepseek tokenizer, ``return_token_ids`` + logprobs answered), ``tracecar proxy`` (the real CLI)
recording to a collector process (embedded store). One client (httpx, keep-alive) sends, per pair:

* a non-streamed chat completion: time to the whole answer, per request;
* a streamed one (``--tokens`` chunks, the upstream waiting ``--chunk-delay-ms`` before each, as a
  decode step): each server-sent event's arrival, from the request's start.

Prints p50 / p99 of A and B and of the paired differences B − A (per request, and per streamed
chunk: chunk k via the proxy against chunk k directly), and what the proxy recorded. Bounded by
``--pairs`` and ``--seconds``. Goal: p99 added ≤ 1 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from common import PY, REPO, clean_env, free_port, header, machine_note, percentile, start_collector, start_service, table

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "You are a calculator."},
                                      {"role": "user", "content": "What is two plus two, and why is it four today?"}],
        "logprobs": True, "return_token_ids": True}


def timed_request(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    response = client.post(url, json=body)
    response.read()
    elapsed = time.perf_counter() - start
    assert response.status_code == 200, response.text[:300]
    return elapsed


def timed_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> list[float]:
    """Arrival time (from the request's start) of each server-sent event."""
    arrivals: list[float] = []
    buffer = b""
    start = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            now = time.perf_counter() - start
            buffer += piece
            while b"\n\n" in buffer:
                _, buffer = buffer.split(b"\n\n", 1)
                arrivals.append(now)
    return arrivals


def summarize(name: str, a: list[float], b: list[float], diffs: list[float]) -> list[Any]:
    ms = 1000.0
    return [name, len(diffs), percentile(a, 50) * ms, percentile(a, 99) * ms, percentile(b, 50) * ms, percentile(b, 99) * ms,
            percentile(diffs, 50) * ms, percentile(diffs, 99) * ms, (percentile(b, 99) - percentile(a, 99)) * ms]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=600, help="A/B pairs of each kind (default 600)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens (chunks) per answer (default 16)")
    parser.add_argument("--chunk-delay-ms", type=float, default=1.0, help="the upstream's wait before each streamed chunk")
    parser.add_argument("--seconds", type=float, default=150.0, help="stop each phase after this long (default 150)")
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()

    print(machine_note())
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-proxy-"))
    with contextlib.ExitStack() as stack:
        run(args, work, stack)
    print(machine_note())


def run(args: argparse.Namespace, work: Path, stack: contextlib.ExitStack) -> None:
    up_port, proxy_port = free_port(), free_port()
    upstream = start_service("upstream", [PY, "-m", "tests.support.openai_upstream", "--port", str(up_port),
                                          "--chunk-delay-ms", str(args.chunk_delay_ms)],
                             f"http://127.0.0.1:{up_port}/v1/models", work / "upstream.log", env=clean_env(), cwd=str(REPO))
    stack.callback(upstream.stop)
    collector = start_collector(work / "collector")
    stack.callback(collector.stop)
    tracecar = str(Path(PY).parent / "tracecar")
    proxy = start_service("proxy", [tracecar, "proxy", "--upstream", f"http://127.0.0.1:{up_port}/v1", "--port", str(proxy_port),
                                    "--collector", collector.url, "--experiment", "bench-proxy"],
                          f"http://127.0.0.1:{proxy_port}/tracecar/healthz", work / "proxy.log",
                          env=clean_env(TRACECAR_PROXY_ROLLOUT_IDLE_S="2"), cwd=str(REPO))
    stack.callback(proxy.stop)
    import psutil

    proxy_proc = psutil.Process(proxy.pid)
    cpu: dict[str, float] = {}
    direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    proxied = f"http://127.0.0.1:{proxy_port}/rollout/{{}}/v1/chat/completions"
    unrecorded = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    body = {**CHAT, "max_tokens": args.tokens}
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    rows = []
    with httpx.Client(timeout=30, trust_env=False) as client:
        for _ in range(args.warmup):
            timed_request(client, direct, body)
            timed_request(client, proxied.format("warmup"), body)

        header("non-streamed: whole answer, per request")
        a: list[float] = []
        b: list[float] = []
        before = proxy_proc.cpu_times()
        deadline = time.monotonic() + args.seconds
        for i in range(args.pairs):
            if time.monotonic() > deadline:
                break
            rollout = proxied.format(f"req-{i // 8}")  # 8 requests a rollout
            first, second = (direct, rollout) if i % 2 == 0 else (rollout, direct)  # A B, then B A
            t1 = timed_request(client, first, body)
            t2 = timed_request(client, second, body)
            a.append(t1 if first is direct else t2)
            b.append(t2 if first is direct else t1)
        rows.append(summarize("request", a, b, [y - x for x, y in zip(a, b)]))
        after = proxy_proc.cpu_times()
        cpu["request"] = (after.user + after.system - before.user - before.system) / max(1, len(b))

        header("non-streamed, not recorded (no rollout id: forwarding alone), per request")
        a, c = [], []
        before = proxy_proc.cpu_times()
        deadline = time.monotonic() + args.seconds
        for i in range(args.pairs):
            if time.monotonic() > deadline:
                break
            first, second = (direct, unrecorded) if i % 2 == 0 else (unrecorded, direct)
            t1 = timed_request(client, first, body)
            t2 = timed_request(client, second, body)
            a.append(t1 if first is direct else t2)
            c.append(t2 if first is direct else t1)
        rows.append(summarize("request, not recorded", a, c, [y - x for x, y in zip(a, c)]))
        after = proxy_proc.cpu_times()
        cpu["unrecorded"] = (after.user + after.system - before.user - before.system) / max(1, len(c))

        header("streamed: each chunk's arrival, chunk k via the proxy against chunk k directly")
        sa: list[list[float]] = []
        sb: list[list[float]] = []
        before = proxy_proc.cpu_times()
        deadline = time.monotonic() + args.seconds
        for i in range(args.pairs):
            if time.monotonic() > deadline:
                break
            rollout = proxied.format(f"stream-{i // 8}")
            first, second = (direct, rollout) if i % 2 == 0 else (rollout, direct)
            r1 = timed_stream(client, first, stream_body)
            r2 = timed_stream(client, second, stream_body)
            sa.append(r1 if first is direct else r2)
            sb.append(r2 if first is direct else r1)
        after = proxy_proc.cpu_times()
        cpu["stream"] = (after.user + after.system - before.user - before.system) / max(1, len(sb))
        first_a = [x[0] for x in sa]
        first_b = [x[0] for x in sb]
        rows.append(summarize("stream, first chunk", first_a, first_b, [y - x for x, y in zip(first_a, first_b)]))
        chunk_a = [t for x, y in zip(sa, sb) for t in x[: len(y)]]
        chunk_b = [t for x, y in zip(sa, sb) for t in y[: len(x)]]
        rows.append(summarize("stream, every chunk", chunk_a, chunk_b, [y - x for x, y in zip(chunk_a, chunk_b)]))
        rel_a = [t - x[0] for x, y in zip(sa, sb) for t in x[1: len(y)]]
        rel_b = [t - y[0] for x, y in zip(sa, sb) for t in y[1: len(x)]]
        rows.append(summarize("stream, chunk k after the first", rel_a, rel_b, [y - x for x, y in zip(rel_a, rel_b)]))
        ends_a = [x[-1] for x in sa]
        ends_b = [y[-1] for y in sb]
        rows.append(summarize("stream, whole answer", ends_a, ends_b, [y - x for x, y in zip(ends_a, ends_b)]))
        chunks = sum(len(x) for x in sa) / max(1, len(sa))

    time.sleep(3)  # the idle rollouts close (TRACECAR_PROXY_ROLLOUT_IDLE_S=2) and the sender posts
    stats = httpx.get(f"http://127.0.0.1:{proxy_port}/tracecar/stats", timeout=10).json()
    listed = httpx.get(collector.url + "/v1/trajectories", params={"experiment": "bench-proxy", "limit": 1}, timeout=30).json()

    header("added latency (ms): A = upstream directly, B = through the proxy, same run, interleaved A B / B A")
    print(table(rows, ["what", "pairs", "A p50", "A p99", "B p50", "B p99", "B-A p50", "B-A p99", "p99(B)-p99(A)"]))
    print(f"\nstreamed answers: {chunks:.0f} server-sent events each (the upstream waits {args.chunk_delay_ms} ms before each)")
    print(f"proxy process CPU (its sender thread's recording included): {cpu['request'] * 1e6:.0f} us per non-streamed request "
          f"({cpu['unrecorded'] * 1e6:.0f} us forwarded without recording), "
          f"{cpu['stream'] * 1e6:.0f} us per streamed answer ({cpu['stream'] / max(1.0, chunks) * 1e6:.0f} us per chunk)")
    sender = stats.pop("sender")
    print(f"proxy: {json.dumps(stats)}")
    print(f"proxy's sender: sent {sender['sent']} spans in {sender['batches_sent']} batches, dropped {sender['dropped_total']}, "
          f"queued {sender['queued']}")
    print(f"collector: {listed['total']} trajectories of experiment bench-proxy stored")
    worst = max(rows[0][7], rows[4][7])
    print("\nRATIOS")
    print(f"p99 added per request (paired B-A): {rows[0][7]:.3f} ms; per streamed chunk: {rows[4][7]:.3f} ms "
          f"(goal <= 1 ms: {'met' if worst <= 1.0 else 'NOT met'})")


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    sys.exit(main())
