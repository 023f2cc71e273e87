"""The client's list of known TRACECAR_* names covers every collector setting and everything the
package reads, so a worker sharing the collector's environment is never warned about those."""

from __future__ import annotations

from tracecar.client.env_check import known_names, unknown_env_warnings
from tracecar.collector.service.config_check import _names_in_package_source, collector_env_names


def test_known_names_cover_the_collector_settings_and_the_package() -> None:
    prefixed = {n for n in collector_env_names() if n.startswith("TRACECAR_")}
    assert prefixed - known_names() == set()
    known = known_names()  # a name the source only builds (TRACECAR_OTLP_HOLD_MAX_%s) is the prefix of known ones
    assert {n for n in _names_in_package_source() - known if not any(k.startswith(n + "_") for k in known)} == set()


def test_each_unknown_name_is_one_line_with_the_closest_known_one() -> None:
    env = {"TRACECAR_URL": "x", "TRACECAR_ULR": "x", "TRACECAR_MAX_TRAJECTORY_PER_STEP": "1", "TRACECAR_ZZZZZZZZZZZZZZZ": "1",
           "TRACECAR_TOKEN2TEXT": "true", "OTHER": "1"}
    assert unknown_env_warnings(env) == [
        "TRACECAR_MAX_TRAJECTORY_PER_STEP is not a tracecar setting and is ignored (did you mean 'TRACECAR_MAX_TRAJECTORIES_PER_STEP'?)",
        "TRACECAR_ULR is not a tracecar setting and is ignored (did you mean 'TRACECAR_URL'?)",
        "TRACECAR_ZZZZZZZZZZZZZZZ is not a tracecar setting and is ignored",
    ]
    assert unknown_env_warnings({"TRACECAR_URL": "x", "TRACECAR_TOKEN": "t"}) == []
