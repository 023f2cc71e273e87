"""``tracecar doctor``: run from a worker's environment, it says whether traces will arrive.

Each check prints one line, ``PASS`` or ``FAIL`` with what to do; the exit code is 1 when any
check fails. It reads what a worker reads (TRACECAR_URL, TRACECAR_TOKEN,
TRACECAR_CLIENT_TOKENIZER) and sends one real trajectory, under the experiment
``tracecar-doctor`` so that it never counts against a real experiment's budget.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..loud import check_url

DOCTOR_EXPERIMENT = "tracecar-doctor"


@dataclass
class Report:
    lines: list[tuple[bool, str, str]] = field(default_factory=list)

    def ok(self, check: str, text: str) -> None:
        self.lines.append((True, check, text))
        print(f"PASS  {check}: {text}", flush=True)

    def fail(self, check: str, text: str) -> None:
        self.lines.append((False, check, text))
        print(f"FAIL  {check}: {text}", flush=True)

    @property
    def failed(self) -> bool:
        return any(not passed for passed, _, _ in self.lines)


class Doctor:
    def __init__(self, url: str | None, token: str | None, tokenizer: str | None, timeout_s: float) -> None:
        self.raw_url = url
        self.token = token
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.report = Report()
        self.url: str | None = None
        self.http = httpx.Client(timeout=5.0, headers={"Authorization": f"Bearer {token}"} if token else {})

    def get(self, path: str, **params: Any) -> httpx.Response:
        assert self.url is not None
        return self.http.get(self.url + path, params={k: v for k, v in params.items() if v is not None})

    def run(self) -> int:
        from .common import describe_http_error, describe_transport_error

        r = self.report
        try:
            if not self.check_url():
                return 1
            try:
                health = self.get("/healthz")
                health.raise_for_status()
                r.ok("collector", f"{self.url} answers (tracecar {health.json().get('version', '?')})")
            except httpx.HTTPStatusError as exc:
                r.fail("collector", describe_http_error(exc.response) + " (is this a tracecar collector?)")
                return 1
            except (httpx.HTTPError, ValueError) as exc:
                r.fail("collector", describe_transport_error(self.url or "", exc))
                return 1
            ready = self.get("/readyz")
            details = ready.json()
            if ready.status_code == 200 and details.get("ready"):
                r.ok("ready", f"accepting spans (spool depth {details.get('spool_depth')})")
            else:
                r.fail("ready", "the collector is not accepting spans (starting or draining): wait, or look at its log")
            if not self.check_token(describe_http_error):
                return 1
            self.check_tokenizer(describe_http_error)
            trace_id = self.check_spans()
            self.check_backend(trace_id)
        except (httpx.HTTPError, ValueError) as exc:
            r.fail("collector", describe_transport_error(self.url or "", exc))
        finally:
            self.http.close()
        return 1 if r.failed else 0

    def check_url(self) -> bool:
        if not self.raw_url:
            self.report.fail("TRACECAR_URL", "unset, so tracing is off in this worker: set TRACECAR_URL to the collector, "
                                             "e.g. http://127.0.0.1:9470 for a sidecar")
            return False
        url, warning = check_url(self.raw_url.strip().rstrip("/"))
        if url is None:
            self.report.fail("TRACECAR_URL", (warning or "").removeprefix("tracecar: "))
            return False
        self.url = url
        if warning:
            self.report.fail("TRACECAR_URL", warning.removeprefix("tracecar: "))
        else:
            self.report.ok("TRACECAR_URL", url)
        return True

    def check_token(self, describe: Any) -> bool:
        got = self.get("/v1/trajectories", limit=1, experiment=DOCTOR_EXPERIMENT)
        if got.status_code == 200:
            self.report.ok("token", "accepted" if self.token else "the collector requires none (TRACECAR_TOKEN unset on both sides)")
            return True
        if got.status_code == 401:
            self.report.fail("token", ("TRACECAR_TOKEN is unset, but the collector requires one" if not self.token else
                                       "the collector refused TRACECAR_TOKEN") +
                             ": set it to the collector's TRACECAR_TOKEN (e.g. the same Kubernetes Secret)")
            return False
        self.report.fail("token", describe(got))
        return False

    def check_tokenizer(self, describe: Any) -> None:
        got = self.get("/v1/tokenizers/check", name=self.tokenizer)
        if got.status_code == 404:
            self.report.fail("tokenizer", "this collector is older than the client (no /v1/tokenizers/check): upgrade it")
            return
        if got.status_code != 200:
            self.report.fail("tokenizer", describe(got))
            return
        answer = got.json()
        if answer.get("ok"):
            self.report.ok("tokenizer", f"the collector loads {answer['name']!r} (vocabulary {answer.get('vocab_size')})")
        elif not answer.get("name"):
            if answer.get("token2text") and answer.get("root"):
                self.report_root(answer)
            elif answer.get("token2text"):
                self.report.fail("tokenizer", "token2text is on but neither TRACECAR_CLIENT_TOKENIZER here nor TRACECAR_TOKENIZER "
                                              "on the collector names a tokenizer: set TRACECAR_TOKENIZER on the collector")
            else:
                self.report.ok("tokenizer", "none needed: token2text is off on the collector and no tokenizer is named")
        else:
            who = ("TRACECAR_CLIENT_TOKENIZER (or the VERL adapter's tokenizer_path)" if self.tokenizer
                   else "the collector's TRACECAR_TOKENIZER")
            tried = f"; {answer['tried']}" if answer.get("tried") else ""  # none when the policy refused the name unread
            self.report.fail("tokenizer", f"the collector cannot load {answer['name']!r} named by {who}: {answer.get('error')}"
                                          f"{tried}. Mount the model's tokenizer.json into the collector (shared volume or HF "
                                          "cache) and allow it (TRACECAR_TOKENIZER_ROOT or TRACECAR_TOKENIZERS), or set "
                                          "TRACECAR_TOKENIZER to it")

    def report_root(self, answer: dict[str, Any]) -> None:
        """token2text with TRACECAR_TOKENIZER_ROOT and no name here: the workers name their own tokenizer
        (VERL sends the model's tokenizer_path), so check what is under the root, as the collector sees it."""
        root = answer["root"]
        if not answer.get("root_exists"):
            self.report.fail("tokenizer", f"TRACECAR_TOKENIZER_ROOT={root} does not exist on the collector: mount the "
                                          "model directory there (read-only, the same path the workers see)")
            return
        found = answer.get("found") or []
        loads = [f for f in found if f.get("ok")]
        source = "the workers named" if answer.get("named_by_workers") else f"found under {root}"
        if loads:
            names = ", ".join(f"{f['name']} (vocabulary {f.get('vocab_size')})" for f in loads)
            self.report.ok("tokenizer", f"the collector loads the tokenizers workers name under TRACECAR_TOKENIZER_ROOT="
                                        f"{root} ({source}: {names}); another model: tracecar doctor --tokenizer PATH")
        elif found:
            self.report.fail("tokenizer", f"the collector cannot load the tokenizer {source}: {found[0].get('error')}")
        else:
            self.report.fail("tokenizer", f"no tokenizer.json under TRACECAR_TOKENIZER_ROOT={root} on the collector: mount "
                                          "the model directory (with its tokenizer.json) there, the path VERL's "
                                          "actor_rollout_ref.model.path names")

    def check_spans(self) -> str | None:
        """Sends one trajectory through the real client and reads it back."""
        from .. import tracer
        from ..tracing import rollout_trace_attr, rollout_trace_op

        worker = f"tracecar-doctor:{os.getpid()}"
        tr = tracer.configure(url=self.url, token=self.token, experiment=DOCTOR_EXPERIMENT, worker_id=worker,
                              tokenizer=self.tokenizer, flush_interval_s=0.05, retry_max_elapsed_s=self.timeout_s)
        if tr is None:
            self.report.fail("spans", "the client would not trace with this TRACECAR_URL")
            return None
        step = int(time.time())  # a fresh step per run: never mixes with an earlier doctor's

        @rollout_trace_op
        async def doctor_probe(prompt_ids: list[int]) -> dict[str, Any]:
            return {"response_ids": prompt_ids, "note": "tracecar doctor test trajectory"}

        async def one() -> str:
            with rollout_trace_attr(sample_index=0, step=step, rollout_n=0, name="agent_loop") as trajectory:
                await doctor_probe([1, 2, 3])
            assert trajectory is not None  # configured above: rollout_trace_attr records
            return trajectory.span_id  # a trajectory's root span id is its trace id

        trace_id = asyncio.run(one())
        drained = tracer.flush(self.timeout_s)
        stats = tr.stats()
        tracer.shutdown(1)
        if not drained or stats.get("dropped_total") or not stats.get("sent"):
            self.report.fail("spans", f"the test trajectory was not delivered (sent {stats.get('sent', 0)}, dropped "
                                      f"{stats.get('dropped', {})}): see the warnings above")
            return None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            got = self.get(f"/v1/trajectories/{trace_id}")
            if got.status_code == 200 and got.json().get("span_count", 0) >= 2:
                self.report.ok("spans", f"a test trajectory (experiment {DOCTOR_EXPERIMENT!r}, step {step}) "
                                        f"was sent and read back: {trace_id}")
                return trace_id
            time.sleep(0.2)
        mode = self.get("/v1/decisions", experiment=DOCTOR_EXPERIMENT, step=step)
        if mode.status_code == 200 and mode.json().get("mode") == "tail":
            self.report.ok("spans", f"the collector acknowledged the test trajectory; tail-based sampling holds experiment "
                                    f"{DOCTOR_EXPERIMENT!r} until its step is decided (tracecar decisions --experiment "
                                    f"{DOCTOR_EXPERIMENT} --step {step})")
            return None
        self.report.fail("spans", f"the collector acknowledged the test trajectory but it is not in its store after "
                                  f"{self.timeout_s:g} s: a sampling budget dropped it (tracecar decisions --experiment "
                                  f"{DOCTOR_EXPERIMENT} --step {step}) or TRACECAR_KEEP_FORWARDED=false")
        return None

    def check_backend(self, trace_id: str | None) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            forwarding = self.get("/readyz").json().get("forwarding") or {}
            backend = forwarding.get("backend")
            if backend in (None, "local"):
                self.report.ok("backend", "the collector keeps traces in its local store (no WANDB_API_KEY there): "
                                          "browse them at " + f"{self.url}/ui/")
                return
            if not forwarding.get("reachable"):
                self.report.fail("backend", f"the collector cannot forward to {backend}: {forwarding.get('last_error')} "
                                            f"({forwarding.get('consecutive_failures')} failures): check WANDB_API_KEY, the "
                                            "entity and the collector's network; spans wait in its spool meanwhile")
                return
            pending = self.get("/readyz").json().get("spool_depth", 0)
            if forwarding.get("last_success_at") and (trace_id is None or not pending):
                self.report.ok("backend", f"the collector forwards to {backend} (last delivery "
                                          f"{time.strftime('%H:%M:%SZ', time.gmtime(forwarding['last_success_at']))})")
                return
            if time.monotonic() > deadline:
                self.report.fail("backend", f"nothing delivered to {backend} within {self.timeout_s:g} s "
                                            f"({pending} spans pending): look at the collector's log and GET /readyz")
                return
            time.sleep(0.2)


def run_doctor(url: str | None, token: str | None, tokenizer: str | None, timeout_s: float) -> int:
    return Doctor(url, token, tokenizer, timeout_s).run()
