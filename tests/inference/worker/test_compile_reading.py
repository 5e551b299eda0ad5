"""Compiled forwards as operators see them: the metrics and the dashboard's table, from step reports."""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from inference.engine.runner.model_runner import RunnerStats
from inference.worker import compile_reading, metrics


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_runner_stats_move_the_counters_by_what_changed_since_the_last_report():
    pair = ("metrics-test", 1)
    before = _sample("specops_engine_forwards_total", role="target", path="compiled")
    compiling = RunnerStats({"compiled": 0, "eager": 5}, 0.0, 0, 2, "", (), ("all", "last"))
    metrics.observe_runners(pair, {"target": compiling})
    assert _sample("specops_engine_compiled", role="target") == 0
    served = RunnerStats({"compiled": 7, "eager": 9}, 61.5, 0, 2, "", ("all", "last"), ())
    metrics.observe_runners(pair, {"target": served})
    metrics.observe_runners(pair, {"target": served})  # the same totals again: nothing moves
    assert _sample("specops_engine_forwards_total", role="target", path="compiled") - before == 7
    assert _sample("specops_engine_compiled", role="target") == 1
    # a restarted core counts from 0 again: its totals are the increase
    metrics.observe_runners(pair, {"target": RunnerStats({"compiled": 3, "eager": 0}, 0.0, 2, 0, "",
                                                         ("all", "last"), ())})
    assert _sample("specops_engine_forwards_total", role="target", path="compiled") - before == 10


@pytest.mark.django_db
def test_the_dashboard_shows_each_devices_models_compiled_compiling_or_eager_and_why(admin_client):
    compile_reading._last_publish = 0.0
    compile_reading.publish((11, 12), {
        "target": RunnerStats({"compiled": 40, "eager": 3}, 90.0, 0, 2, "", ("all", "last"), ()),
        "draft": RunnerStats({"compiled": 0, "eager": 43}, 0.0, 0, 0, "gpt2 is not a Llama-layout family", (), ()),
    })
    rows = {row["role"]: row for row in compile_reading.readings() if row["pair"] == "(11, 12)"}
    assert rows["target"]["state"] == "compiled" and rows["target"]["compiled_forwards"] == 40
    assert rows["draft"]["state"] == "eager" and "Llama-layout" in rows["draft"]["fallback"]
    page = admin_client.get("/admin/dashboard/?panels=1").content.decode()
    table = page[page.index('id="compiled-forwards"'):]
    table = table[:table.index("</table>")]
    assert "(11, 12)" in table and "compiled" in table and "gpt2 is not a Llama-layout family" in table
