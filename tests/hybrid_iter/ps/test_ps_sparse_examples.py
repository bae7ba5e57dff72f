"""The parameter-server examples, run small on the shared session: a hashed-feature
logistic regression trained by FTRL on real flights beats the base rate on held-out
flights, and a factorization machine learns user-item interactions that a linear model
on the same ids cannot."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
from paths import EXAMPLES


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # grad_fn pickles by value from here
    spec.loader.exec_module(module)
    return module


def test_hashed_logistic_regression_with_ftrl_beats_the_base_rate(session):
    ex = load("ps_hashed_logistic_regression")
    out = ex.main(session, rows=30_000, epochs=3)
    try:
        _, test = ex.hashed_flights(session.spark, 30_000)
        y = np.array([r.label for r in test.select("label").collect()])
        base = float(-np.mean(y * np.log(y.mean()) + (1 - y) * np.log(1 - y.mean())))
        last = out.eval[-1]
        assert last["rows"] == len(y)
        assert last["log_loss"] < base - 0.003, (last, base)
        assert last["auc"] > 0.65, last
        # l1: ids whose evidence never outweighed it are exactly 0
        keys = np.array(
            sorted({int(k) for r in test.limit(200).collect() for k in r.ids}), dtype=np.int64
        )
        w = out.lookup("w", keys)[:, 0]
        assert (w == 0).any() and (w != 0).any()
    finally:
        out.close()


def test_a_factorization_machine_learns_interactions_a_linear_model_cannot(session):
    fm = load("ps_factorization_machine")
    lr = load("ps_hashed_logistic_regression")
    df, test = fm.interactions(session.spark, 40_000)
    out = fm.main(session, df, test, k=4, epochs=6)
    try:
        assert out.eval[-1]["auc"] > 0.85, out.eval
        assert out.params["v"].num_keys == out.params["w"].num_keys <= 400
    finally:
        out.close()
    from hybrid_iter import ps

    linear = ps.train(
        df,
        lr.grad_fn,
        {"bias": np.zeros(1), "w": ps.Table()},
        keys={"w": "ids"},
        optimizer=ps.Adagrad(0.2),
        epochs=6,
        batch_size=1024,
        eval_df=test,
        predict_fn=lr.predict_fn,
    )
    try:
        assert linear.eval[-1]["auc"] < 0.6, linear.eval
    finally:
        linear.close()
