"""elsa.tasks side by side with the field's definitions (Garg et al. 2022,
github.com/dtsip/in-context-learning, src/models.py): every baseline of a
family of theirs against its definition written out here in numpy or
scikit-learn, on fixed prompts, in float64.

What each reference of theirs computes, from their code: ``NNModel(3)``
the mean label of the 3 nearest examples; ``LeastSquaresModel``
``torch.linalg.lstsq`` (the minimum-norm solution, ``pinv``);
``AveragingModel`` ``w = mean_i y_i x_i``; ``LassoModel(alpha)``
scikit-learn's ``Lasso(alpha, fit_intercept=False)``; ``DecisionTreeModel``
scikit-learn's tree at ``max_depth`` 4 and ``None``; ``XGBoostModel``
``XGBRegressor()`` (here scikit-learn's histogram boosting at XGBoost's
defaults); ``GDModel`` a ``d -> 100 -> 1`` ReLU network per prompt, torch's
default initialisation, Adam at ``lr = 5e-3`` for 100 steps on batches of
at most 100 examples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.linear_model import Lasso
from sklearn.tree import DecisionTreeRegressor

from elsa import tasks

B, N, D, Q = 4, 12, 4, 3  # few prompts: scikit-learn fits one at a time


def _task(name, **sizes):
  sizes = {"batch": B, "n_train": N, "d": D, "n_query": Q, **sizes}
  return tasks.FAMILIES[name].sample(jax.random.key(11), dtype=jnp.float64,
                                     **sizes)


def _arrays(task):
  return tuple(np.asarray(a, np.float64) for a in (task.x, task.y,
                                                    task.x_query))


def _uniform_knn(x, y, xq, k=3):
  dist = np.linalg.norm(xq[:, :, None, :] - x[:, None, :, :], axis=-1)
  nearest = np.argsort(dist, axis=-1)[..., :k]
  return np.take_along_axis(y[:, None, :], nearest, axis=-1).mean(-1)


def _pinv(x, y, xq):
  return np.einsum("bqd,bd->bq", xq, np.einsum("bdn,bn->bd",
                                                np.linalg.pinv(x), y))


def _averaging(x, y, xq):
  return np.einsum("bqd,bd->bq", xq, (x * y[..., None]).mean(1))


def _per_prompt(model, x, y, xq):
  return np.stack([model().fit(x[b], y[b]).predict(xq[b])
                   for b in range(len(x))])


def _check(task, got: dict, want: dict, rtol):
  """Predictions and mean squared errors, name by name."""
  y_q = np.asarray(task.y_query)
  for name, value in want.items():
    pred = np.asarray(got[name](task))
    np.testing.assert_allclose(pred, value, rtol=rtol, atol=rtol,
                               err_msg=name)
    np.testing.assert_allclose(np.mean((pred - y_q) ** 2),
                               np.mean((value - y_q) ** 2), rtol=rtol,
                               atol=rtol * np.mean(y_q ** 2), err_msg=name)


@pytest.mark.parametrize("name", ["linear", "sparse_linear", "noisy_linear",
                                  "linear_classification", "relu_2nn",
                                  "decision_tree"])
def test_common_baselines_are_the_fields(name):
  task = _task(name)
  x, y, xq = _arrays(task)
  refs = tasks.FAMILIES[name].references
  _check(task, refs, {"knn": _uniform_knn(x, y, xq),
                      "least_squares": _pinv(x, y, xq),
                      "averaging": _averaging(x, y, xq)}, rtol=1e-9)
  # N < d: least squares is the minimum-norm fit (lstsq, pinv).
  small = _task(name, n_train=2)
  _check(small, refs, {"least_squares": _pinv(*_arrays(small))}, rtol=1e-9)


def test_classification_reports_accuracy_beside_squared_error():
  family = tasks.FAMILIES["linear_classification"]
  task = _task("linear_classification", batch=64, n_query=5)
  x, y, xq = _arrays(task)
  pred = np.asarray(family.references["knn"](task))
  want = (np.sign(_uniform_knn(x, y, xq)) == np.asarray(task.y_query)).mean(-1)
  np.testing.assert_allclose(tasks.accuracy(pred, task), want)
  assert 0.5 < want.mean() < 1  # better than chance, not perfect


def test_sparse_regression_lasso_at_the_five_alphas():
  family = tasks.FAMILIES["sparse_linear"]
  assert family.k == 3  # Garg et al.'s sparsity
  task = _task("sparse_linear", d=6)
  x, y, xq = _arrays(task)
  want = {}
  for alpha, label in ((1, "1"), (0.1, "0.1"), (0.01, "0.01"),
                       (0.001, "0.001"), (0.0001, "0.0001")):
    want[f"lasso_{label}"] = _per_prompt(lambda a=alpha: Lasso(
        alpha=a, fit_intercept=False, max_iter=100_000, tol=1e-10), x, y, xq)
  # The same minimiser to the coordinate descents' tolerance.
  _check(task, family.references, want, rtol=1e-6)


def test_trees_and_boosted_trees():
  family = tasks.FAMILIES["decision_tree"]
  task = _task("decision_tree", n_train=40, d=3)
  x, y, xq = _arrays(task)
  want = {
      "tree": _per_prompt(lambda: DecisionTreeRegressor(
          max_depth=4, random_state=0), x, y, xq),
      "tree_unbounded": _per_prompt(lambda: DecisionTreeRegressor(
          max_depth=None, random_state=0), x, y, xq),
      # XGBRegressor()'s defaults: 100 rounds, eta 0.3, depth 6, lambda 1,
      # min_child_weight 1, no early stopping.
      "boosted_trees": _per_prompt(lambda: HistGradientBoostingRegressor(
          max_iter=100, learning_rate=0.3, max_depth=6, max_leaf_nodes=None,
          min_samples_leaf=1, l2_regularization=1.0, early_stopping=False,
          random_state=0), x, y, xq)}
  _check(task, family.references, want, rtol=1e-9)
  # An unbounded tree interpolates its examples; the depth-4 one cannot.
  on_examples = task._replace(x_query=task.x)
  np.testing.assert_allclose(tasks.tree(on_examples, max_depth=None), y,
                             atol=1e-12)


def _torch_init(key, d, hidden):
  """torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn
  from the keys elsa.tasks.mlp_adam documents (w1, b1, w2, b2)."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  u = lambda k, shape, fan: np.asarray(jax.random.uniform(
      k, shape, jnp.float64, -fan ** -0.5, fan ** -0.5))
  return [u(k1, (d, hidden), d), u(k2, (hidden,), d),
          u(k3, (hidden,), hidden), u(k4, (), hidden)]


def _adam_net(x, y, xq, *, hidden, steps, lr, batch_size, seed):
  """The 2-layer network trained by Adam, in numpy, gradients by hand."""
  prompts, n, d = x.shape
  k_init, k_batch = jax.random.split(jax.random.key(seed))
  inits = jax.random.split(k_init, prompts)
  step_keys = jax.random.split(k_batch, steps)
  preds = []
  for b in range(prompts):
    params = _torch_init(inits[b], d, hidden)
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t in range(1, steps + 1):
      rows = np.arange(n)
      if n > batch_size:
        key = jax.random.split(step_keys[t - 1], prompts)[b]
        rows = np.asarray(jax.random.permutation(key, n))[:batch_size]
      xb, yb = x[b, rows], y[b, rows]
      w1, b1, w2, b2 = params
      z = xb @ w1 + b1
      a = np.maximum(z, 0)
      r = 2 * (a @ w2 + b2 - yb) / len(rows)
      dz = np.outer(r, w2) * (z > 0)
      grads = [xb.T @ dz, dz.sum(0), a.T @ r, r.sum()]
      for i, g in enumerate(grads):
        m[i] = 0.9 * m[i] + 0.1 * g
        v[i] = 0.999 * v[i] + 0.001 * g * g
        m_hat, v_hat = m[i] / (1 - 0.9 ** t), v[i] / (1 - 0.999 ** t)
        params[i] = params[i] - lr * m_hat / (np.sqrt(v_hat) + 1e-8)
    w1, b1, w2, b2 = params
    preds.append(np.maximum(xq[b] @ w1 + b1, 0) @ w2 + b2)
  return np.stack(preds)


@pytest.mark.parametrize("name,n_train,batch_size", [
    ("relu_2nn", 12, 100),       # Garg et al.'s setting: the whole prompt
    ("decision_tree", 7, 4),     # N > batch: a fresh subset every step
])
def test_gd_network_is_garg_et_als(name, n_train, batch_size):
  task = _task(name, n_train=n_train)
  x, y, xq = _arrays(task)
  if batch_size == 100:
    got = tasks.FAMILIES[name].references["mlp_adam"]
    hidden = tasks.FAMILIES[name].hidden  # the task's own width
  else:
    got = lambda t: tasks.mlp_adam(t, batch_size=batch_size)
    hidden = 100
  want = _adam_net(x, y, xq, hidden=hidden, steps=100, lr=5e-3,
                   batch_size=batch_size, seed=0)
  _check(task, {"mlp_adam": got}, {"mlp_adam": want}, rtol=1e-8)
  # Trained: it fits its own examples far better than it started.
  start = _adam_net(x, y, x, hidden=hidden, steps=0, lr=5e-3,
                    batch_size=batch_size, seed=0)
  fit = np.asarray(tasks.mlp_adam(task._replace(x_query=task.x),
                                  batch_size=batch_size, hidden=hidden))
  assert np.mean((fit - y) ** 2) < 0.5 * np.mean((start - y) ** 2)
