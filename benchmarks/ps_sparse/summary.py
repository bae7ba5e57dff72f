"""What a run concludes: the table printed at the end, the ratios between contenders at
each D, and each target of the issue met, missed or not measured."""

from __future__ import annotations

from typing import Any

from _harness import ratio

from .record import dim_label


def fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'contender':<12} {'D':>5} {'ms/step':>8} {'ms/pass':>9} {'kB/step':>9} "
        f"{'to target s':>11} {'best logloss':>12} {'AUC':>6} {'CPU s':>7} {'work MB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        procs = r.get("cpu_and_memory") or {}
        peak = r.get("working_memory_mb")
        kb = r["bytes_per_step"] / 1e3 if r["bytes_per_step"] is not None else None
        print(
            f"{r['contender']:<12} {dim_label(r['dim']):>5} {fmt(r['ms_per_step'], '.2f'):>8} "
            f"{fmt(r['ms_per_pass'], '.0f'):>9} {fmt(kb, '.0f'):>9} "
            f"{fmt(r['time_to_target_s'], '.1f'):>11} {fmt(r['best_log_loss'], '.4f'):>12} "
            f"{fmt(r['best_auc'], '.3f'):>6} {fmt(procs.get('total_cpu_s'), '.1f'):>7} "
            f"{fmt(peak, '.0f'):>8}" + (f"  ERROR {r['error']}" if r.get("error") else "")
        )


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue: met, missed, or not measured (None), with the figures."""
    rows = report["results"]
    dims = report["config"]["dims"]

    def get(name: str, dim: Any) -> dict[str, Any] | None:
        return next((r for r in rows if r["contender"] == name and r["dim"] == dim), None)

    out: list[dict[str, Any]] = []
    for name in ("ps_sync", "ps_async"):
        if not any(get(name, d) for d in dims):
            continue
        got = {dim_label(d): (get(name, d) or {}).get("bytes_per_step") for d in dims}
        have = [v for v in got.values() if v is not None]
        out.append(
            {
                "target": f"{name}: at most 1 MB moved per step (1,024 rows per worker) at every D",
                "met": (max(have) <= 1e6) if len(have) == len(dims) else None,
                "values": got,
            }
        )
    sweep = report.get("sweep_ps_sync_by_dim")
    if sweep:
        ms = sweep["ms_per_step"]
        base = ms[dim_label(dims[0])]
        out.append(
            {
                "target": f"ps_sync: ms per step flat within +-25% of D = {dim_label(dims[0])} "
                "(the interleaved sweep's medians)",
                "met": all(0.75 * base <= v <= 1.25 * base for v in ms.values()),
                "values": ms,
            }
        )
    for name in ("ps_sync", "ps_async", "ps_sync_1shard"):
        for d in dims:
            ours, mllib, floor = get(name, d), get("mllib_lr", d), get("numpy", d)
            if ours is None:
                continue
            t = ours["time_to_target_s"]
            if mllib is not None:
                m = mllib["time_to_target_s"]
                out.append(
                    {
                        "target": f"{name} at D = {dim_label(d)}: time to target <= MLlib's",
                        "met": t is not None and (m is None or t <= m),
                        "values": {name: t, "mllib_lr": m, "ratio": ratio(t, m)},
                        "note": (
                            f"MLlib did not reach it (best {mllib['best_log_loss']}; "
                            f"{'; '.join(mllib['notes'][:1])})"
                            if m is None
                            else None
                        ),
                    }
                )
            if floor is not None and floor["time_to_target_s"] is not None:
                f = floor["time_to_target_s"]
                out.append(
                    {
                        "target": f"{name} at D = {dim_label(d)}: time to target <= 3x the numpy floor",
                        "met": t is not None and t <= 3 * f,
                        "values": {name: t, "numpy": f, "ratio": ratio(t, f)},
                    }
                )
    fm = next((r for r in rows if r["contender"] == "ps_fm"), None)
    if fm is not None:
        t = fm["time_to_target_s"]
        out.append(
            {
                "target": "ps_fm (k = 8) reaches the target in under 60 s",
                "met": t is not None and t < 60,
                "values": {"ps_fm": t, "best_log_loss": fm["best_log_loss"]},
            }
        )
    out.append(
        _equal(
            rows,
            "ps_sync",
            "max_abs_diff_vs_numpy",
            "ps_sync equals the numpy loop to 1e-12 (max abs difference, table + bias)",
        )
    )
    out.append(
        _equal(
            rows,
            "ps_dense",
            "max_abs_diff_vs_ps_sync",
            "ps_sync equals the dense path on the same model to 1e-12",
        )
    )
    return out


def _equal(rows: list[dict[str, Any]], contender: str, key: str, target: str) -> dict[str, Any]:
    """The check that ``contender``'s ``key`` (a max abs difference) is at most 1e-12 at
    every D it was measured at; None where it was measured at none."""
    diffs = {
        dim_label(r["dim"]): r.get(key)
        for r in rows
        if r["contender"] == contender and r.get(key) is not None
    }
    return {
        "target": target,
        "met": max(diffs.values()) <= 1e-12 if diffs else None,
        "values": diffs,
    }


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    rows = report["results"]
    out: dict[str, Any] = {}
    for d in report["config"]["dims"]:
        by = {r["contender"]: r for r in rows if r["dim"] == d}

        def t(name: str, by: dict[str, Any] = by) -> float | None:
            return (by.get(name) or {}).get("time_to_target_s")

        def ms(name: str, by: dict[str, Any] = by) -> float | None:
            return (by.get(name) or {}).get("ms_per_step")

        out[dim_label(d)] = {
            "time_to_target_ps_sync_over_mllib_lr": ratio(t("ps_sync"), t("mllib_lr")),
            "time_to_target_ps_sync_over_numpy": ratio(t("ps_sync"), t("numpy")),
            "time_to_target_ps_async_over_numpy": ratio(t("ps_async"), t("numpy")),
            "time_to_target_ps_sync_1shard_over_numpy": ratio(t("ps_sync_1shard"), t("numpy")),
            "time_to_target_ps_sync_over_sklearn_sgd": ratio(t("ps_sync"), t("sklearn_sgd")),
            "ms_per_step_ps_sync_over_numpy": ratio(ms("ps_sync"), ms("numpy")),
            "ms_per_step_ps_dense_over_ps_sync": ratio(ms("ps_dense"), ms("ps_sync")),
        }
    return out
