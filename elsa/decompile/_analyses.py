"""The field's analyses of a stack beside the fits: Fu et al.'s similarity
map and Ahn et al.'s weight structure."""

from __future__ import annotations

import numpy as np

from elsa import nn, ridge, training
from elsa.attention import Array, ElsaParams

def similarity(layers_predict, reference, tasks: ridge.Task, *,
               target: Array | None = None) -> tuple[np.ndarray, np.ndarray]:
  r"""Fu et al. (2023)'s layer x iteration map: cosine similarity of residuals.

  .. math::
    S_{lt} = \cos\big(f_l - y^\star,\; g_t - y^\star\big),

  ``f_l`` the model's predictions after layer ``l``, ``g_t`` the reference
  algorithm's after iteration ``t``, each flattened over tasks and queries,
  ``y*`` the target (default the reference's last iterate: its converged
  answer, so that the map compares how far each still has to go).

  Args:
    layers_predict: ``task -> [S, B, Q]`` (or the array itself).
    reference: ``task -> [T + 1, B, Q]`` (e.g. :meth:`Fit.predict`,
      :func:`elsa.training.gd_step_predictions`), or the array.
    tasks: the tasks.
    target: ``[B, Q]``.

  Returns:
    ``(map [S, T + 1], argmax [S])``: the best-matching iteration per layer.
  """
  f = np.asarray(layers_predict(tasks) if callable(layers_predict)
                 else layers_predict, np.float64)
  g = np.asarray(reference(tasks) if callable(reference) else reference,
                 np.float64)
  if f.ndim != 3 or g.ndim != 3 or f.shape[1:] != g.shape[1:]:
    raise ValueError(f"decompile.similarity: expected [S, B, Q] and [T + 1, B, "
                     f"Q] predictions, got {f.shape} and {g.shape}.")
  y = g[-1] if target is None else np.asarray(target, np.float64)
  a = (f - y).reshape(f.shape[0], -1)
  b = (g - y).reshape(g.shape[0], -1)
  norm = lambda v: np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-300)
  cos = (a / norm(a)) @ (b / norm(b)).T
  return cos, np.argmax(cos, axis=1)


def weight_structure(model: nn.ElsaStack | ElsaParams, spec: training.TaskSpec
                     ) -> list[list[dict]]:
  r"""Ahn et al. (2023)'s structure of trained LSA blocks, per layer and component.

  An LSA component computes ``h_i -> h_i W_3 W_1^T \sum_j h_j^T h_j W_2``:
  the query-key product ``W_KQ = W_3 W_1^T`` ``[n, n]`` and the value
  projection ``W_PV = W_2`` ``[n, n]``. On both token layouts the inputs sit
  in columns ``0..d-1``; the prediction is written in column ``out`` (``y``
  for the concatenated tokens, ``p`` for the natural ones). GD has
  ``W_KQ[x, x] = c I`` and ``W_PV`` reading ``y`` only; a preconditioner makes
  ``W_KQ[x, x]`` a general matrix; GD++ adds ``W_PV[x, x] = -gamma I``.

  Returns, per layer and component: ``kq_scale`` (``c = tr / d`` of the
  ``x, x`` block), ``kq_identity_distance`` (``||K - c I||_F / ||K||_F``),
  ``pv_xx_scale``, ``pv_xx_identity_distance`` (the same for the ``x, x``
  block of ``W_PV``), ``pv_y_to_out`` (``W_PV[y, out]``) and
  ``pv_x_to_out_norm`` (``||W_PV[x, out]||``, 0 for GD).

  Raises:
    ValueError: the stack has biases (ELSA: bias paths the blocks do not
      show, so the blocks alone are not identifiable) or the wrong shape.
  """
  fn = "decompile.weight_structure"
  if isinstance(model, nn.ElsaStack):
    if model.use_bias:
      raise ValueError(f"{fn}: the stack has biases (ELSA); W_KQ and W_PV "
                       "identify an LSA layer only.")
    params = model.to_params()
  else:
    params = model
    if any(np.any(np.asarray(b) != 0) for b in (params.b1, params.b2,
                                                params.b3)):
      raise ValueError(f"{fn}: the parameters have nonzero biases (ELSA); "
                       "W_KQ and W_PV identify an LSA layer only.")
  form = spec.model_tokens()
  if params.w1.ndim != 4 or params.n != form.n:
    raise ValueError(f"{fn}: expected leaves [L, C, n, k] with n = {form.n}, "
                     f"got w1 {params.w1.shape}.")
  d = spec.d
  out = d if spec.tokens == "concatenated" else form.n - 1  # y, or p
  eye = np.eye(d)

  def scaled_identity(block):
    c = np.trace(block) / d
    size = np.linalg.norm(block)
    return float(c), float(np.linalg.norm(block - c * eye) / size
                           if size > 0 else 0.0)

  layers = []
  w1, w2, w3 = (np.asarray(a, np.float64) for a in (params.w1, params.w2,
                                                    params.w3))
  for l in range(w1.shape[0]):
    comps = []
    for c in range(w1.shape[1]):
      kq = w3[l, c] @ w1[l, c].T
      pv = w2[l, c]
      kq_c, kq_dist = scaled_identity(kq[:d, :d])
      pv_c, pv_dist = scaled_identity(pv[:d, :d])
      comps.append({"kq_scale": kq_c, "kq_identity_distance": kq_dist,
                    "pv_xx_scale": pv_c, "pv_xx_identity_distance": pv_dist,
                    "pv_y_to_out": float(pv[d, out]),
                    "pv_x_to_out_norm": float(np.linalg.norm(pv[:d, out]))})
    layers.append(comps)
  return layers
