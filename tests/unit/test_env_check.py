"""The client's list of known TRACECAR_* names covers every collector setting and everything the
package reads, so a worker sharing the collector's environment is never warned about those."""

from __future__ import annotations

from tracecar.client.env_check import known_names, unknown_env_warnings
from tracecar.collector.service.config_check import _names_in_package_source, collector_env_names


def test_known_names_cover_the_collector_settings_and_the_package() -> None:
    prefixed = {n for n in collector_env_names() if n.startswith("TRACECAR_")}
    assert prefixed - known_names() == set()
    assert _names_in_package_source() - known_names() == set()


def test_each_unknown_name_is_one_line_with_the_closest_known_one() -> None:
    env = {"TRACECAR_URL": "x", "TRACECAR_ULR": "x", "TRACECAR_MAX_TRAJECTORY_PER_STEP": "1", "TRACECAR_ZZZZZZZZZZZZZZZ": "1",
           "TRACECAR_TOKEN2TEXT": "true", "OTHER": "1"}
    assert unknown_env_warnings(env) == [
        "TRACECAR_MAX_TRAJECTORY_PER_STEP is not a tracecar setting and is ignored (did you mean 'TRACECAR_MAX_TRAJECTORIES_PER_STEP'?)",
        "TRACECAR_ULR is not a tracecar setting and is ignored (did you mean 'TRACECAR_URL'?)",
        "TRACECAR_ZZZZZZZZZZZZZZZ is not a tracecar setting and is ignored",
    ]
    assert unknown_env_warnings({"TRACECAR_URL": "x", "TRACECAR_TOKEN": "t"}) == []
