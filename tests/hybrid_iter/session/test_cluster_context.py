"""The published cluster contexts (``hybrid_iter._cluster.context``): what a run reads to
find its Spark and Ray, and whose ``run_coming`` it tells before it starts actors."""

from __future__ import annotations

from hybrid_iter._cluster import context


def test_a_nested_session_that_stops_leaves_the_outer_sessions_context_current(monkeypatch):
    """A session nested in another over the same Spark and Ray has an equal context (the
    same fields); its stop must withdraw its own, or runs would announce themselves to a
    stopped session and the outer one's warm-up would start beside them."""
    monkeypatch.setattr(context, "_published", [])
    spark = object()
    heard: list[str] = []
    outer = context.ClusterContext(
        spark, "127.0.0.1:1", "local", run_coming=lambda: heard.append("outer")
    )
    inner = context.ClusterContext(
        spark, "127.0.0.1:1", "local", run_coming=lambda: heard.append("inner")
    )
    assert outer == inner  # the case that matters: equal, not the same
    context.publish(outer)
    context.publish(inner)
    context.announce_run(spark)
    context.withdraw(inner)
    assert context.current() is outer
    context.announce_run(spark)
    context.announce_run()
    assert heard == ["inner", "outer", "outer"]
    context.withdraw(inner)  # idempotent
    assert context.current() is outer
    context.withdraw(outer)
    assert context.current() is None
