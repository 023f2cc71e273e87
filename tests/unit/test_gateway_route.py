"""Rendezvous routing of a node's spans over several gateways (collector/exporters/gateway_route.py)."""

from __future__ import annotations

from collections import Counter

from tracecar.collector.exporters.gateway_route import GatewayRouter, exporter_name, gateway_identity, owner, route_key

GATEWAYS = [f"http://10.0.0.{i}:4318" for i in range(1, 5)]
KEYS = [route_key(f"exp{e}", v, s) for e in range(5) for v in (False, True) for s in range(-1, 60)]


def test_adding_a_gateway_moves_only_the_keys_it_wins_and_about_its_share() -> None:
    before = {k: GATEWAYS[owner(k, GATEWAYS)] for k in KEYS}
    grown = [*GATEWAYS, "http://10.0.0.9:4318"]
    after = {k: grown[owner(k, grown)] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == grown[-1] for k in moved)  # a key moves to the new gateway or stays
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5 of them
    removed = GATEWAYS[1:]
    shrunk = {k: removed[owner(k, removed)] for k in KEYS}
    assert all(shrunk[k] == before[k] for k in KEYS if before[k] != GATEWAYS[0])  # only the removed one's keys move
    assert min(Counter(before.values()).values()) > len(KEYS) / len(GATEWAYS) / 2  # balanced enough


def test_the_order_and_spelling_of_the_list_do_not_change_owners() -> None:
    shuffled = [GATEWAYS[2], GATEWAYS[0], GATEWAYS[3], GATEWAYS[1]]
    spelled = [g.upper().replace("HTTP", "http") + "/" for g in shuffled]
    for key in KEYS:
        want = GATEWAYS[owner(key, GATEWAYS)]
        assert shuffled[owner(key, shuffled)] == want
        assert gateway_identity(spelled[owner(key, [gateway_identity(g) for g in spelled])]) == gateway_identity(want)
    assert exporter_name("HTTP://GW-1.example:4318/") == "gateway@gw-1.example:4318"


def test_a_step_stays_whole_and_spans_without_a_step_follow_their_trajectory() -> None:
    looked_up: list[list[str]] = []

    def lookup(trace_ids: list[str]) -> dict[str, str]:  # what the node's spool holds: t-old's step
        looked_up.append(trace_ids)
        return {"t-old": route_key("exp", False, 7)} if "t-old" in trace_ids else {}

    router = GatewayRouter(GATEWAYS, lookup)

    def span(trace: str, kind: str = "op", **attrs: object) -> dict[str, object]:
        return {"span_id": f"{trace}-{kind}-{len(attrs)}", "trace_id": trace, "kind": kind, "attributes": attrs}

    step3 = {"experiment_name": "exp", "validate": False, "step": 3}
    spans = [span("t1", **step3), span("t2", **step3), span("t1", "annotation", reward=1.0),
             span("t-old", "annotation", reward=0.5), span("t-none", "annotation", reward=0.0), span("t-none", "op")]
    got = router.owners(spans)
    assert got[0] == got[1] == got[2] == owner(route_key("exp", False, 3), router.gateways)  # a step, its annotation
    assert got[3] == owner(route_key("exp", False, 7), router.gateways)  # read from the spool
    assert got[4] == got[5] == owner("trace:t-none", router.gateways)  # no step anywhere: by its trace id, whole
    assert looked_up == [["t-none", "t-old"]]  # t1 was known from its own spans in the batch
    assert route_key("exp", None, 3) == route_key("exp", False, 3) and route_key("exp", True, "3") is None


def test_names_and_urls_a_node_refuses_or_folds() -> None:
    from tracecar.collector.service.roles import gateway_url_problem

    assert exporter_name("http://gw") == exporter_name("http://GW:80/") == "gateway@gw:80"  # one gateway, one cursor
    assert gateway_identity("http://gw") == gateway_identity("http://gw:80")
    assert "user or password" in (gateway_url_problem("http://user:secret@gw:1") or "")


def test_a_node_learns_budgets_once_every_gateway_answered_the_same() -> None:
    from tracecar.collector.service.roles import BudgetsAgreement

    learned: list[object] = []
    agreement = BudgetsAgreement(["gateway@a:1", "gateway@b:1"], learned.append)
    agreement.heard("gateway@a:1", {"k": 1})
    assert learned == []  # one answer is not an agreement
    agreement.heard("gateway@b:1", {"k": 2})
    assert learned == [] and agreement.disagree
    agreement.heard("gateway@b:1", {"k": 1})
    assert learned == [{"k": 1}] and not agreement.disagree
