"""Arguments of the wrong kind or out of range: a ``ValueError``/``TypeError`` naming the
argument, raised before anything the user owns moved (``.grad``, a clipper's history, a
logger's window), never a NaN update or an error from deep inside torch."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradbalance import (
    RunningStats,
    TaskGradBuffer,
    balanced_backward,
    capture_state,
    functional,
    load_checkpoint,
    log_stats,
    restore_state,
    save_checkpoint,
    stats_to_dict,
    task_gradients,
)
from gradbalance.balancers import (
    DBMTL,
    MGDA,
    PCD,
    ExcessMTL,
    FairGrad,
    GradVac,
    MoCo,
    MoDo,
    PCGrad,
    SDMGrad,
    Sum,
    UPGrad,
)
from gradbalance.clip import (
    AGC,
    AutoClip,
    GhostNorms,
    TaskAutoClip,
    TaskClip,
    TaskValueClip,
    per_sample_grad_norms,
    per_sample_grad_norms_of_model,
)
from gradbalance.functional import fairgrad_weights, moco_step
from gradbalance.weighting import DWA, last_layer_parameters


def _grads(*modules: nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


@pytest.mark.parametrize(("given", "error", "text"), [
    ({"clip": "f"}, TypeError, "Invalid clip"),
    ({"clip": 3}, TypeError, "Invalid clip"),
    ({"active": "x"}, TypeError, "active must be a bool tensor"),
    ({"active": torch.tensor([False, False])}, ValueError, "active is all False"),
    ({"scaler": "s"}, TypeError, "Invalid scaler"),
    ({"clip": lambda g: (_ for _ in ()).throw(RuntimeError("the clipper failed"))},
     RuntimeError, "the clipper failed"),
])
def test_balanced_backward_that_raises_moves_no_grad(given: dict[str, Any], error: type,
                                                     text: str) -> None:
    """The heads' ``.grad`` were written by the backward before ``apply_`` checked ``clip``
    and ``active``; the step is now dropped first."""
    torch.manual_seed(0)
    trunk = nn.Linear(4, 3)
    heads = nn.ModuleList([nn.Linear(3, 1) for _ in range(2)])
    heads[0].weight.grad = torch.ones_like(heads[0].weight)  # a gradient already there
    before = _grads(trunk, heads)
    feats = trunk(torch.randn(8, 4))
    losses = torch.stack([h(feats).pow(2).mean() for h in heads])
    with pytest.raises(error, match=text):
        balanced_backward(losses, PCGrad(), shared_params=trunk.parameters(),
                          head_params=heads.parameters(), **given)
    after = _grads(trunk, heads)
    assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(before, after))


@pytest.mark.parametrize("clipper", [TaskClip(1.0), TaskValueClip(0.5), TaskAutoClip()],
                         ids=["TaskClip", "TaskValueClip", "TaskAutoClip"])
@pytest.mark.parametrize("kind", ["expanded", "requires_grad"])
def test_row_clippers_refuse_a_matrix_they_cannot_scale_in_place(clipper: Any,
                                                                 kind: str) -> None:
    clipper = copy.deepcopy(clipper)
    clipper(torch.randn(2, 5))
    state = copy.deepcopy(clipper.state_dict()) if hasattr(clipper, "state_dict") else None
    bad = (torch.randn(2, 1).expand(2, 5) if kind == "expanded"
           else torch.randn(2, 5, requires_grad=True))
    with pytest.raises(ValueError, match=r"matrix (is an expanded view|requires grad)"):
        clipper(bad)
    if state is not None:
        assert repr(clipper.state_dict()) == repr(state)


@pytest.mark.parametrize("norms", [torch.empty(0), torch.tensor([[1.0, 3.0]])],
                         ids=["empty", "2-D"])
def test_task_auto_clip_refuses_norms_of_the_wrong_shape_before_recording(
        norms: torch.Tensor) -> None:
    clip = TaskAutoClip()
    with pytest.raises(ValueError, match="norms must be a non-empty 1-D tensor"):
        clip.coefficients(norms)
    assert clip.state_dict()["history"] is None and clip.state_dict()["count"] == 0


def test_running_stats_converts_every_value_before_adding_any() -> None:
    running = RunningStats(window=10)
    running.update({"a": 1.0})
    before = copy.deepcopy(running.state_dict())
    with pytest.raises(ValueError, match=r"Invalid scalars\['b'\]: 'garbage'"):
        running.update({"a": 2.0, "b": "garbage"})
    with pytest.raises(ValueError, match="Invalid scalars: a NoneType"):
        running.update(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"state_dict\['values'\] must map tags"):
        running.load_state_dict({"values": "x", "window": 10})
    with pytest.raises(ValueError, match=r"state_dict\['values'\] holds a value"):
        running.load_state_dict({"values": {"a": ["x"]}, "window": 10})
    assert running.state_dict() == before


@pytest.mark.parametrize(("build", "name"), [
    (lambda v: FairGrad(alpha=v), "alpha"), (lambda v: ExcessMTL(robust_step_size=v),
                                             "robust_step_size"),
    (lambda v: SDMGrad(lr=v), "lr"), (lambda v: SDMGrad(lambda_=v), "lambda_"),
    (lambda v: MoCo(gamma=v), "gamma"), (lambda v: MoCo(rho=v), "rho"),
    (lambda v: MoDo(gamma=v), "gamma"), (lambda v: PCD(eps=v), "eps"),
    (lambda v: DBMTL(beta_sigma=v), "beta_sigma"), (lambda v: GradVac(max_step=v), "max_step"),
])
def test_an_infinite_hyperparameter_is_refused(build: Any, name: str) -> None:
    """``FairGrad(alpha=inf)`` gave NaN updates, ``SDMGrad(lr=inf)`` an index error."""
    with pytest.raises(ValueError, match=rf"Invalid {name}: inf \(expected a finite number"):
        build(math.inf)


@pytest.mark.parametrize(("call", "text"), [
    (lambda: DBMTL(log_losses="no"), "Invalid log_losses: 'no'"),  # type: ignore[arg-type]
    (lambda: GradVac(beta=True), "Invalid beta: True"),
    (lambda: TaskClip(1.0, error_if_nonfinite="no"), "Invalid error_if_nonfinite"),
    (lambda: AutoClip(error_if_nonfinite="no"), "Invalid error_if_nonfinite"),
    (lambda: AGC(error_if_nonfinite="no"), "Invalid error_if_nonfinite"),
    (lambda: capture_state(rng="no"), "Invalid rng: 'no'"),
    (lambda: restore_state(capture_state(), strict="no"), "Invalid strict: 'no'"),
])
def test_a_flag_or_number_of_the_wrong_type_is_refused(call: Any, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        call()


def test_a_weighting_refuses_a_found_inf_that_is_not_a_flag() -> None:
    """``found_inf="no"`` was taken as true: the step skipped."""
    dwa = DWA(2)
    dwa(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="Invalid found_inf: 'no'"):
        dwa.update(found_inf="no")  # type: ignore[arg-type]
    assert dwa.pending_tensors()  # the observation is kept: the call can be repeated
    assert dwa.update(found_inf=False)


@pytest.mark.parametrize(("given", "text"), [
    ({"step": "abc"}, "Invalid step: 'abc'"), ({"step": math.nan}, "Invalid step: nan"),
    ({"extra": [1]}, "Invalid extra: a list"), ({"rng": "no"}, "Invalid rng"),
])
def test_save_checkpoint_refuses_bad_metadata_and_writes_nothing(
        tmp_path: Path, given: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1), **given)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="Invalid f: a NoneType"):
        save_checkpoint(None, model=nn.Linear(2, 1))  # type: ignore[arg-type]
    save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1))
    with pytest.raises(ValueError, match="Invalid strict: 'no'"):
        load_checkpoint(tmp_path / "c.pt", strict="no", model=nn.Linear(2, 1))


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, torch.ones(2)])
def test_a_loss_scale_that_is_not_one_positive_number_is_refused(scale: Any) -> None:
    """``scale=0`` gave NaN norms."""
    w = nn.Parameter(torch.ones(2))
    x = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    with pytest.raises(ValueError, match="Invalid scale"):
        per_sample_grad_norms(x @ w, [w], scale=scale)
    layer = nn.Linear(2, 1)
    ghost = GhostNorms(layer)
    out = layer(x)[:, 0]
    with pytest.raises(ValueError, match="Invalid scale"):
        ghost.norms(out, scale=scale)


@pytest.mark.parametrize(("call", "error", "text"), [
    (lambda: UPGrad().compute_weights(None), ValueError, "Invalid gramian: a NoneType"),
    (lambda: UPGrad().compute_weights(torch.eye(2), rounding="abc"), ValueError,
     "Invalid rounding: 'abc'"),
    (lambda: UPGrad().compute_weights(torch.eye(2), rounding=1e308), ValueError,
     "Invalid rounding"),
    (lambda: MGDA().combine(torch.randn(2, 3), losses={"a": 1}), ValueError,
     "Invalid losses: a dict"),
    (lambda: MGDA().combine(torch.randn(2, 3, device="meta")), ValueError, "meta device"),
    (lambda: AutoClip()("weights"), ValueError, "Invalid parameters: a str"),
    (lambda: AGC()([1, 2]), ValueError, r"parameters\[0\] is a int"),
    # a module where its parameters belong (a Sequential iterates its layers, not tensors)
    (lambda: TaskGradBuffer(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                            torch.nn.Linear(2, 1).parameters()), ValueError,
     r"Invalid shared_params: a Sequential module \(expected its parameters: "
     r"shared_params=module.parameters\(\)\)"),
    (lambda: TaskGradBuffer(torch.nn.Linear(2, 2).parameters(), torch.nn.Linear(2, 1)),
     ValueError, r"Invalid head_params: a Linear module"),
    (lambda: AutoClip()(torch.nn.Linear(2, 2)), ValueError, "Invalid parameters: a Linear module"),
    (lambda: last_layer_parameters(None), TypeError, "Invalid module: a NoneType"),
    (lambda: per_sample_grad_norms_of_model(None, lambda out, y: out, torch.ones(2, 2),
                                            torch.ones(2)),
     TypeError, "Invalid model: a NoneType"),
    (lambda: fairgrad_weights(torch.eye(2)[None]), ValueError, r"gramian must be \[K, K\]"),
])
def test_public_entry_points_name_the_bad_argument(call: Any, error: type, text: str) -> None:
    """Each raised ``AttributeError``, ``IndexError`` or a torch error from inside, or hung
    (``fairgrad_weights`` on a 3-D Gramian)."""
    with pytest.raises(error, match=text):
        call()


def test_moco_step_takes_float32_weights() -> None:
    """The Gramian is float64 whatever the rows' dtype: float32 weights raised a dtype
    mismatch. The step is ``Π_Δ(λ − γ(YYᵀ + ρI)λ)`` on the tracked rows ``Y = h``."""
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    _, lam = moco_step(torch.zeros(2, 2), torch.tensor([0.5, 0.5]), h, beta_t=1.0,
                       gamma_t=0.5, rho=0.0)
    assert lam.dtype == torch.float32
    assert torch.allclose(lam, torch.tensor([0.875, 0.125]))  # Π_Δ((0.25, −0.5)), by hand


def test_logging_and_gradients_name_the_bad_argument() -> None:
    w = torch.ones(2, requires_grad=True)
    buf = TaskGradBuffer([w])
    buf.backward([w.sum(), 2 * w.sum()])
    stats = buf.apply_(Sum())
    with pytest.raises(ValueError, match="Invalid weights: a dict"):
        stats_to_dict(stats, weights={"a": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid pre_clip: 'abc'"):
        stats_to_dict(stats, pre_clip="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid step: 'x'"):
        log_stats(RunningStats(), stats, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid retain_graph: 'yes'"):
        task_gradients([w.sum()], [w], retain_graph="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid process_group: 'LOCAL'"):
        TaskGradBuffer([w], process_group="LOCAL")


_KERNELS = ["alignedmtl_weights", "cagrad_weights", "config_weights", "dualproj_weights",
            "fairgrad_weights", "imtlg_weights", "krum_weights", "mean_weights",
            "mgda_weights", "nashmtl_weights", "sum_weights", "upgrad_weights"]


@pytest.mark.parametrize("name", _KERNELS)
@pytest.mark.parametrize(("gramian", "text"), [
    (torch.tensor(1.0), r"gramian must be \[K, K\], got shape \(\)"),
    (torch.eye(2)[None], r"gramian must be \[K, K\], got shape \(1, 2, 2\)"),
    (torch.empty(0, 0), "gramian has no tasks"),
    ("G", "Invalid gramian: a str"),
], ids=["0-d", "3-D", "empty", "str"])
def test_the_functional_kernels_check_their_gramian(name: str, gramian: Any,
                                                    text: str) -> None:
    """They raised IndexError or ZeroDivisionError, or hung (FairGrad on a 3-D Gramian)."""
    with pytest.raises(ValueError, match=text):
        getattr(functional, name)(gramian)


@pytest.mark.parametrize(("call", "text"), [
    (lambda: functional.krum_weights(torch.eye(4), n_selected=0), "Invalid n_selected: 0"),
    (lambda: functional.fairgrad_weights(torch.eye(2), alpha=-1.0), "Invalid alpha: -1.0"),
    (lambda: functional.cagrad_weights(torch.eye(2), rescale=None), "Invalid rescale: None"),
])
def test_the_functional_kernels_check_their_numbers(call: Any, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        call()


_ONE = torch.ones(3)
_WEIGHTING_KERNELS: list[tuple[Any, str]] = [
    (lambda v: functional.dwa_weights(v, _ONE), "previous"),
    (lambda v: functional.dwa_weights(_ONE, v), "before_previous"),
    (lambda v: functional.gls_weights(v), "losses"),
    (lambda v: functional.scale_invariant_weights(v), "losses"),
    (lambda v: functional.famo_weights(_ONE, v, _ONE), "logits"),
    (lambda v: functional.famo_weights(_ONE, _ONE, v), "min_losses"),
    (lambda v: functional.stch_weights(_ONE, v, 1.0, _ONE), "nadir"),
    (lambda v: functional.stch_weights(_ONE, _ONE, 1.0, v), "preference"),
]


@pytest.mark.parametrize(("call", "name"), _WEIGHTING_KERNELS,
                         ids=[f"{i}-{n}" for i, (_, n) in enumerate(_WEIGHTING_KERNELS)])
@pytest.mark.parametrize(("value", "text"), [
    (torch.tensor(1.0), r"Invalid {}: shape \(\)"),
    (torch.ones(2, 3), r"Invalid {}: shape \(2, 3\)"),
    ("L", "Invalid {}: a str"),
    (torch.ones(2), "{} has 2 entries but .* has 3|.* has 3 entries but {} has 2"),
], ids=["0-d", "2-D", "str", "length"])
def test_the_weighting_kernels_check_their_vectors(call: Any, name: str, value: Any,
                                                   text: str) -> None:
    """``dwa_weights`` and ``gls_weights`` on a 0-d tensor raised IndexError, the others
    broadcast a 0-d tensor or failed inside torch on vectors of different lengths."""
    if name == "losses" and text.startswith("{} has"):
        value = torch.ones(0)  # a first vector sets K: an empty one instead
        text = r"Invalid {}: shape \(0,\)"
    with pytest.raises(ValueError, match=text.format(name, name)):
        call(value)


@pytest.mark.parametrize(("call", "text"), [
    (lambda: functional.dwa_weights(_ONE, _ONE, temperature=0.0), "Invalid temperature: 0.0"),
    (lambda: functional.stch_weights(_ONE, _ONE, -1.0, _ONE), "Invalid mu: -1.0"),
    (lambda: functional.gls_weights(_ONE, eps=math.nan), "Invalid eps: nan"),
])
def test_the_weighting_kernels_check_their_numbers(call: Any, text: str) -> None:
    """A zero temperature gave NaN weights."""
    with pytest.raises(ValueError, match=text):
        call()
