"""The pure L-BFGS / OWL-QN state machine of ``hybrid_iter.ml`` (no Spark, no Ray),
stepped one ``tell`` at a time, against closed forms, scipy and scikit-learn; and the
GLM statistics merge against numpy on the whole data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybrid_iter.ml._glm import FitSpec, Problem, merge_stats, multinomial_gradient, partition_stats
from hybrid_iter.ml._optim import LBFGS


def _run(opt, fun):
    while not opt.done:
        opt.tell(*fun(opt.point))
    return opt


def _logistic(X, y, l2):
    def fun(w):
        z = X @ w
        p = 1 / (1 + np.exp(-z))
        return float(np.mean(np.logaddexp(0, z) - y * z) + 0.5 * l2 * w @ w), X.T @ (p - y) / len(
            y
        ) + l2 * w

    return fun


def test_lbfgs_minimises_an_ill_conditioned_quadratic_exactly():
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((30, 30)))
    A = Q @ np.diag(np.logspace(0, 4, 30)) @ Q.T  # condition number 1e4
    c = rng.standard_normal(30)
    opt = _run(
        LBFGS(np.zeros(30), tol=1e-15, max_iter=500), lambda x: (0.5 * x @ A @ x - c @ x, A @ x - c)
    )
    xs = np.linalg.solve(A, c)
    best = 0.5 * xs @ A @ xs - c @ xs
    assert opt.objective - best <= 1e-10 * abs(best)
    np.testing.assert_allclose(opt.x, xs, rtol=1e-4, atol=1e-6)
    assert opt.history == sorted(opt.history, reverse=True)
    assert opt.evaluations >= opt.iterations + 1


def test_lbfgs_equals_scipy_on_logistic_loss():
    so = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(1)
    X = rng.standard_normal((800, 6))
    y = (rng.random(800) < 1 / (1 + np.exp(-X @ rng.standard_normal(6)))).astype(float)
    fun = _logistic(X, y, 0.01)
    opt = _run(LBFGS(np.zeros(6), tol=1e-14, max_iter=200), fun)
    ref = so.minimize(
        fun, np.zeros(6), jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-16}
    )
    np.testing.assert_allclose(opt.x, ref.x, rtol=1e-6, atol=1e-9)
    assert opt.objective <= ref.fun + 1e-15


def test_owlqn_equals_the_lasso_and_zeros_coefficients_exactly():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((400, 12))
    y = X[:, :3] @ np.array([2.0, -1.0, 0.5]) + 0.1 * rng.standard_normal(400)
    lam = 0.1

    def fun(w):
        r = X @ w - y
        return 0.5 * r @ r / len(y), X.T @ r / len(y)

    opt = _run(LBFGS(np.zeros(12), l1=lam, tol=1e-15, max_iter=500), fun)
    assert (opt.x[3:] == 0.0).all() and (opt.x[:3] != 0).all()
    # the lasso's optimality conditions: |grad_j| <= lam at zeros, = -lam sign(w_j) elsewhere
    _, g = fun(opt.x)
    nz = opt.x != 0
    np.testing.assert_allclose(g[nz], -lam * np.sign(opt.x[nz]), atol=1e-7)
    assert (np.abs(g[~nz]) <= lam + 1e-9).all()
    sk = pytest.importorskip("sklearn.linear_model")
    ref = sk.Lasso(alpha=lam, fit_intercept=False, tol=1e-12, max_iter=100_000).fit(X, y).coef_
    np.testing.assert_allclose(opt.x, ref, atol=1e-7)


def test_fixed_coordinates_stay_and_max_iter_is_not_convergence():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((300, 5))
    y = (rng.random(300) < 0.5).astype(float)
    fixed = np.array([False, True, False, False, True])
    x0 = np.array([0.0, 0.7, 0.0, 0.0, -0.2])
    opt = _run(LBFGS(x0, fixed=fixed, max_iter=2, tol=0.0), _logistic(X, y, 0.0))
    assert opt.done and not opt.converged and "max_iter" in opt.reason
    assert opt.iterations == 2 and len(opt.history) == 3
    assert opt.x[1] == 0.7 and opt.x[4] == -0.2
    with pytest.raises(RuntimeError, match="after the minimisation finished"):
        opt.tell(0.0, np.zeros(5))


def test_a_non_finite_trial_backs_off_instead_of_failing():
    # log(x) is undefined left of 0: the first trials overshoot into NaN
    def fun(x):
        v = x[0]
        if v <= 0:
            return math.nan, np.array([math.nan])
        return v - math.log(v), np.array([1 - 1 / v])

    opt = _run(LBFGS(np.array([20.0]), tol=1e-14, max_iter=100), fun)
    assert opt.x[0] == pytest.approx(1.0, rel=1e-6)


def test_statistics_merge_equals_numpy_and_the_start_gradient_equals_a_pass():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((900, 3)) * [1e-3, 1.0, 1e4] + [5.0, -3.0, 2e6]
    y = rng.integers(0, 3, 900).astype(float)
    w = rng.uniform(0.5, 2.0, 900)
    parts = [
        partition_stats(X[s], y[s], w[s], family="multinomial", gram=False)
        for s in (slice(0, 200), slice(200, 650), slice(650, 900))
    ]
    st = merge_stats(parts)
    mean = w @ X / w.sum()
    np.testing.assert_allclose(st["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(st["m2"], w @ (X - mean) ** 2, rtol=1e-9)
    spec = FitSpec(
        family="multinomial",
        solver="l-bfgs",
        reg=0.0,
        elastic_net=0.0,
        standardization=True,
        fit_intercept=True,
        max_iter=10,
        tol=1e-6,
        label="y",
    )
    problem = Problem(spec, st)
    theta, loss, grad = problem.start()
    B, b = problem.to_original(theta)
    packed = multinomial_gradient(X, y, B, b, w)
    G, gb, full_loss = problem.split(packed)
    assert loss == pytest.approx(full_loss, rel=1e-12)
    np.testing.assert_allclose(grad, np.concatenate([G.ravel(), gb]), rtol=1e-6, atol=1e-12)


def test_the_fits_combiners_merge_in_a_tree_as_the_flat_merge_does():
    """GLMCombiner / SGDCombiner (the estimators' feedback_combine): statistics merged
    pairwise, left to right as the tree folds them, equal the flat merge; partitions
    without rows are skipped; gradients add up, the epoch start is the earliest."""
    from coordinator._tree import fold
    from hybrid_iter.ml._glm import GLMCombiner
    from hybrid_iter.ml._sgd import SGDCombiner

    rng = np.random.default_rng(5)
    X = rng.standard_normal((700, 4)) * [1e-3, 1.0, 1e3, 1e5] + [3.0, -2.0, 1e4, 5e6]
    y = X @ [2.0, -1.0, 1e-3, 1e-6] + rng.standard_normal(700)
    cuts = [slice(0, 0), slice(0, 150), slice(150, 151), slice(151, 151), slice(151, 700)]
    for family, gram in (("gaussian", True), ("binomial", False)):
        label = y if family == "gaussian" else (y > y.mean()).astype(float)
        parts = [partition_stats(X[s], label[s], None, family=family, gram=gram) for s in cuts]
        flat = merge_stats(parts)
        tree = merge_stats([fold(parts, GLMCombiner())])
        assert tree.keys() == flat.keys() and tree["n"] == flat["n"] == 700
        for key in flat:
            np.testing.assert_allclose(
                tree[key], flat[key], rtol=1e-9, atol=1e-9 * abs(np.max(np.abs(flat[key])))
            )
    empty = partition_stats(X[:0], y[:0], None, family="gaussian", gram=False)
    with pytest.raises(Exception, match="no rows"):
        merge_stats([fold([empty, empty], GLMCombiner())])
    a, b = np.array([1.0, 2.0, 3.0, 50.0]), np.array([0.5, 0.5, 1.0, 40.0])
    np.testing.assert_array_equal(SGDCombiner().merge(a, b), [1.5, 2.5, 4.0, 40.0])
    np.testing.assert_array_equal(GLMCombiner().merge(a, b), a + b)
