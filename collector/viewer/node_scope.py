"""What a node collector's own views say about their scope (the cluster tier, docs/cluster.md).

A node that forwards to a gateway sees only the rollouts its own workers ran: a GRPO group whose
rollouts were spread over several nodes is partial here (its stats, advantages and all-equal flag
computed on part of the group). The groups answer says so, names the gateway that has every group
whole, and lists per group the rollout numbers missing below its highest one (rollouts that ran
elsewhere; rollouts above the highest one seen here cannot be told apart from none).
"""

from __future__ import annotations

from typing import Any


def node_scope(settings: Any) -> dict[str, Any] | None:
    """The scope block of a node with a gateway, None for a gateway or a single collector."""
    if getattr(settings, "role", "node") != "node" or not getattr(settings, "gateway_url", None):
        return None
    return {"role": "node", "node": settings.effective_node_name, "gateway": settings.gateway_url,
            "note": "this node's rollouts only: a group whose rollouts ran on other nodes is partial here; "
                    "the gateway has every group whole"}


def mark_partial_groups(groups: list[dict[str, Any]]) -> int:
    """Adds ``rollouts_missing`` (rollout numbers below the highest seen, absent here) to each group; the
    number of groups with any."""
    partial = 0
    for group in groups:
        seen = {r.get("rollout_n") for r in group.get("rollouts", []) if type(r.get("rollout_n")) is int}
        missing = sorted(set(range(max(seen) + 1)) - seen) if seen else []
        group["rollouts_missing"] = missing
        partial += bool(missing)
    return partial
