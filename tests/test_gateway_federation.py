"""Any gateway answers for every gateway of the job (TRACECAR_GATEWAY_PEERS), with the caller's own credentials.

Two gateway-role collectors (uvicorn on 127.0.0.1, one token) list each other; each holds its own
trajectories. The merged answers need the caller's token at every gateway (no one reads through a gateway
what it would refuse), cover both, and a misconfigured peer list is refused at start. The whole cluster
(four nodes routing steps to two gateways, merged answers equal to one collector's, a gateway down) is
tests/test_cluster_gateways.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from tests.support import free_port
from tracecar.collector.settings import CollectorSettings

TOKEN = "federation-token-0123456789"


def test_merged_reads_need_the_callers_own_token_and_cover_both_gateways(start_collector: Any, kit: Any) -> None:
    ports = [free_port(), free_port()]
    peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    gateways = [start_collector(port=p, role="gateway", token=TOKEN, gateway_peers=peers) for p in ports]
    held: list[list[str]] = [[], []]
    for i, gw in enumerate(gateways):
        for step in range(3):
            spans = kit.trajectory(step=step + 10 * i, experiment=f"exp{i}")
            assert kit.post(gw.url, spans, token=TOKEN).status_code == 200
            held[i].append(spans[-1]["trace_id"])
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def page(url: str, **params: Any) -> httpx.Response:
        return httpx.get(url + "/v1/trajectories", params={"limit": 100, **params}, headers=auth, timeout=30)

    kit.wait_for(lambda: all(page(g.url, scope="local").json()["total"] == 3 for g in gateways), timeout=30)
    for gw in gateways:
        assert httpx.get(gw.url + "/v1/trajectories", timeout=30).status_code == 401  # merged: refused as one gateway would
        assert httpx.get(gw.url + "/v1/trajectories", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
        assert httpx.get(f"{gw.url}/v1/trajectories/{held[1][0]}", timeout=30).status_code == 401
        merged = page(gw.url).json()
        assert merged["total"] == 6 and not merged["partial"]
        assert sorted(t["trace_id"] for t in merged["trajectories"]) == sorted(held[0] + held[1])
        assert [t["step"] for t in page(gw.url, sort="step", order="asc").json()["trajectories"]] == [0, 1, 2, 10, 11, 12]
        for i in (0, 1):
            one = httpx.get(f"{gw.url}/v1/trajectories/{held[i][1]}", headers=auth, timeout=30)
            assert one.status_code == 200 and one.json()["trace_id"] == held[i][1]
        steps = httpx.get(gw.url + "/v1/decisions", params={"experiment": "exp1", "step": 11}, headers=auth, timeout=30)
        assert steps.status_code == 200
        # the viewer's cookie (what a browser holds after logging in) is passed on like a bearer token
        login = httpx.get(gw.url + "/ui/", params={"token": TOKEN}, timeout=30, follow_redirects=False)
        cookie = login.cookies.get("tracecar_viewer")
        assert cookie, login.headers
        ui = httpx.get(gw.url + "/ui/api/trajectories", params={"limit": 100}, headers={"Cookie": f"tracecar_viewer={cookie}"},
                       timeout=30)
        assert ui.status_code == 200 and ui.json()["total"] == 6
        assert httpx.get(gw.url + "/ui/api/trajectories", timeout=30).status_code == 401
    own = [sorted(t["trace_id"] for t in page(g.url, scope="local").json()["trajectories"]) for g in gateways]
    assert own == [sorted(held[0]), sorted(held[1])]  # scope=local: each gateway's own store alone

    # a refused caller costs the other gateways nothing: the gateway itself refuses (and counts) before asking them
    before = kit.metrics(gateways[1].url, "tracecar_auth_failures_total")
    for path in ("/v1/trajectories", "/v1/export", "/ui/api/trajectories", f"/v1/trajectories/{held[1][0]}"):
        assert httpx.get(gateways[0].url + path, timeout=30).status_code == 401, path
    assert kit.metrics(gateways[1].url, "tracecar_auth_failures_total") == before

    # bad paging is refused by name, as one gateway refuses it
    for params, field in (({"limit": 5000}, "limit"), ({"offset": -1}, "offset"), ({"limit": "many"}, "limit")):
        r = httpx.get(gateways[0].url + "/v1/trajectories", params=params, headers=auth, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["field"] == field, (params, r.text)

    # the job's latest experiment (exp1's trajectories started last), not each gateway's own: the facets' first, and a
    # step asked without an experiment
    facets = httpx.get(gateways[0].url + "/ui/api/facets", headers=auth, timeout=30).json()
    assert [e["experiment"] for e in facets["experiments"]] == ["exp1", "exp0"]
    for path in ("/v1/groups", "/ui/api/groups"):
        groups = httpx.get(gateways[0].url + path, params={"step": 11}, headers=auth, timeout=30).json()
        assert [g["sample_index"] for g in groups["groups"]] == [0], (path, groups)
    for path in ("/v1/health", "/ui/api/health"):  # the viewer's step line too
        assert httpx.get(gateways[0].url + path, params={"step": 11}, headers=auth, timeout=30).json()["step"][
            "trajectories"] == 1, path
    # a cookie header holding other bytes than ASCII beside the viewer's is passed on as it came
    login = httpx.get(gateways[0].url + "/ui/", params={"token": TOKEN}, timeout=30, follow_redirects=False)
    odd = {"Cookie": ("other=caf\u00e9; tracecar_viewer=" + login.cookies["tracecar_viewer"]).encode("latin-1")}
    assert httpx.get(gateways[0].url + "/ui/api/trajectories", headers=odd, timeout=30).json()["total"] == 6

    # the export over both: every trajectory once, a limit over all of them, the file's name kept
    for path in ("/v1/export", "/ui/api/export"):
        whole = httpx.get(gateways[0].url + path, headers=auth, timeout=30)
        assert sorted(orjson.loads(line)["trace_id"] for line in whole.content.splitlines()) == sorted(held[0] + held[1])
        assert "attachment" in whole.headers["content-disposition"]
        cut = httpx.get(gateways[0].url + path, params={"limit": 4}, headers=auth, timeout=30).content
        assert len(cut.splitlines()) == 4 and cut.endswith(b"\n") and cut == b"".join(whole.content.splitlines(True)[:4])
    # a list that leaves the asking gateway out (or names one twice) is said and counted, not silently merged
    assert kit.metrics(gateways[0].url, "tracecar_gateway_peer_failures_total", gateway="self", reason="list") == 0
    stray = start_collector(role="gateway", token=TOKEN, gateway_peers=peers)  # lists the two, not itself
    assert page(stray.url).json()["total"] == 6
    assert kit.metrics(stray.url, "tracecar_gateway_peer_failures_total", gateway="self", reason="list") >= 1
    # Parquet (the viewer's download link): one file written from every gateway's records
    pq = pytest.importorskip("pyarrow.parquet")
    import io

    r = httpx.get(gateways[0].url + "/ui/api/export", params={"format": "parquet"}, headers=auth, timeout=60)
    assert r.status_code == 200 and "parquet" in r.headers["content-disposition"], r.text[:300]
    table = pq.read_table(io.BytesIO(r.content))
    assert sorted(table.column("trace_id").to_pylist()) == sorted(held[0] + held[1])


@pytest.mark.parametrize("settings, says", [
    ({"role": "node", "gateway_peers": "http://127.0.0.1:1"}, "TRACECAR_ROLE=gateway"),
    ({"role": "gateway", "gateway_peers": "http://user:pw@127.0.0.1:1"}, "user or password"),
    ({"role": "gateway", "gateway_peers": "127.0.0.1:9470"}, "not an http(s)://HOST:PORT URL"),
    ({"role": "gateway", "gateway_peers": "http://gw-a:9470,http://GW-A:9470/"}, "twice"),
])
def test_a_wrong_peer_list_is_refused_at_start_by_name(tmp_path: Any, settings: dict[str, Any], says: str) -> None:
    from tracecar.collector.service.config_check import _format_validation_error

    with pytest.raises(ValidationError) as caught:
        CollectorSettings(data_dir=tmp_path, **settings)
    line = _format_validation_error(caught.value, "settings")  # the one line the collector exits with
    assert says in line and "pw@" not in line and "\n" not in line
