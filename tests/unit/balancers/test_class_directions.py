"""UPGrad's projections on per-sample gradients of a classifier: several outlying directions.

The per-sample gradients of a ``C``-class cross-entropy at a linear head are ``bᵢ ⊗ hᵢ``
with ``bᵢ = softmax(zᵢ) − e_{yᵢ}``: the Gramian's cosine matrix has ``C − 1`` eigenvalues far
above a bulk that falls gradually (docs/per_sample.md; ``benchmarks/many_tasks.py --kinds
per_sample``). Every one of them is deflated from the conjugate gradients' preconditioner
(:func:`~._precond.deflated`, up to ``MAX_DEFLATED``) and taken into the projected start's
prox, checked against the eigenvalues from ``torch.linalg.eigvalsh``; the projections
against scipy's NNLS on the rows for eight or nine problems spread over the ``K``
(``support.cone_reference``: the update of each within cosine 0.999999 and 1e-6 of its
norm), and every problem's optimality conditions to the tight solves' residual
(``assert_kkt``).
"""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import _precond, _projected
from gradbalance.balancers._boxqp import certified_inverse
from gradbalance.balancers._solvers import project_dual_cone, trace_normalized
from support.balancers import classifier_rows, outlying
from support.cone_reference import assert_kkt, scipy_projection
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("k", "classes", "width", "seed"),
                         [(112, 6, 80, 3), (256, 10, 64, 4), (200, 8, 60, 5)])
def test_every_class_direction_is_deflated_and_taken_into_the_start(
        k: int, classes: int, width: int, seed: int) -> None:
    """The classes' ``C − 1`` outlying directions (five to nine here: more than the four the
    preconditioner deflated before; the spectrum's gap after them 3.1–4.2) are each
    deflated, and the projected start is planned on the rest: the bulk's estimated
    condition number within ``PROJECTED_MAX_KAPPA``."""
    q, _ = trace_normalized((g := classifier_rows(k, classes, width, seed)) @ g.T)
    expected = outlying(q)
    assert expected == classes - 1 > 4  # the classes' directions: more than four
    inverse = certified_inverse(q)
    assert inverse is not None
    pre = _precond.deflated(q, _precond.preconditioner_inverse(q, inverse))
    assert pre.v is not None and pre.v.shape[1] == expected
    assert _projected.plan(q, pre) is not None


@pytest.mark.parametrize(("k", "classes", "width", "seed"),
                         [(96, 10, 40, 0), (112, 6, 80, 3), (256, 10, 64, 4),
                          (200, 8, 60, 5)])
def test_projections_of_classifier_rows_are_scipys(k: int, classes: int, width: int,
                                                   seed: int) -> None:
    """UPGrad's ``K`` projections (the conjugate-gradient pivoting from the projected start,
    ``K ≥ CG_MIN_SIZE``): eight or nine spread over the ``K`` are scipy's, every one meets
    its optimality conditions."""
    g = classifier_rows(k, classes, width, seed)
    u = torch.eye(k, dtype=F64)
    gram = g @ g.T
    v = project_dual_cone(gram, u)
    for i in range(0, k, k // 8):  # scipy's BVLS takes seconds per problem at K = 256
        assert_same_update(v[i] @ g, scipy_projection(g, u[i]), g)
    assert_kkt(gram, u, v)
