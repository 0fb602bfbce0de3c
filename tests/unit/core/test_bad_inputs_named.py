"""Bad inputs refused by name before anything moves: a complex loss, a balancer built for
another K at ``apply_``, a parameter given twice to a clipper, truthy stand-ins for flags,
complex or bool per-task vectors, non-integer GradVac groups, a ``modules`` that is not a
module. Each was accepted (silently misread) or failed after the step had moved."""

from __future__ import annotations

import pytest
import torch

import gradbalance as gb
from gradbalance import balancers as B
from gradbalance import weighting as W
from gradbalance.clip import AGC, AutoClip


def _model() -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.nn.ModuleList(torch.nn.Linear(3, 1) for _ in range(2))


def _losses(trunk: torch.nn.Module, heads: torch.nn.ModuleList) -> torch.Tensor:
    f = trunk(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
    return torch.stack([h(f).pow(2).mean() for h in heads])


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None
                                             and torch.equal(x, y)) for x, y in zip(a, b))


def test_a_complex_loss_is_refused_and_the_step_kept() -> None:
    trunk, heads = _model()
    params = [*trunk.parameters(), *heads.parameters()]
    buf = gb.TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    buf.backward(_losses(trunk, heads) / 2)
    before, state = _grads(params), buf.state_dict()
    with pytest.raises(ValueError, match=r"losses has dtype torch\.complex64"):
        buf.backward(_losses(trunk, heads).to(torch.complex64) / 2)
    assert _same(before, _grads(params)) and buf.state_dict() == state and buf.in_step
    buf.backward(_losses(trunk, heads) / 2)  # the retry goes on with micro-batch 1 kept
    assert buf.apply_(B.Sum()).num_backward == 2


def test_a_balancer_for_another_k_is_refused_at_apply_and_the_step_kept() -> None:
    trunk, heads = _model()
    params = [*trunk.parameters(), *heads.parameters()]
    buf = gb.TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    buf.backward(_losses(trunk, heads))
    before, state = _grads(params), buf.state_dict()
    with pytest.raises(ValueError, match=r"built with num_tasks=3 but the step has 2 task "):
        buf.apply_(B.UPGrad(num_tasks=3))
    assert _same(before, _grads(params)) and buf.state_dict() == state and buf.in_step
    buf.apply_(B.UPGrad())  # "fix the call and repeat it"
    assert all(p.grad is not None for p in trunk.parameters())


@pytest.mark.parametrize("make", [lambda: AutoClip(percentile=50), lambda: AGC()],
                         ids=["autoclip", "agc"])
def test_a_parameter_given_twice_to_a_clipper_is_refused(make) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    clip = make()
    with pytest.raises(ValueError, match=r"parameters\[1\] \(shape \(3,\)\) is parameters\[0\]"):
        clip([p, p])
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("flag", ["False", float("nan"), [1.0], 1])
def test_flags_take_only_true_or_false(flag: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid normalize_grads.*expected True or False"):
        B.MoCo(normalize_grads=flag)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid renormalize.*expected True or False"):
        W.GradNorm(2, torch.nn.Linear(2, 2), renormalize=flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [torch.tensor([1 + 5j, 1 + 0j]), torch.tensor([True, False]),
                                   "ab", [True, 2.0], [0.5, False], [torch.tensor(True), 2.0]],
                         ids=["complex", "bool", "str", "list-true", "list-false",
                              "list-bool-tensor"])
@pytest.mark.parametrize("make", [
    lambda v: B.Constant(v), lambda v: B.UPGrad(pref=v), lambda v: B.DualProj(pref=v),
    lambda v: B.SDMGrad(pref_vector=v), lambda v: B.CRMOGM(initial_weights=v),
    lambda v: B.GradDrop(leak=v), lambda v: W.FAMO(2, min_losses=v),
    lambda v: W.STCH(2, nadir=v), lambda v: W.STCH(2, preference=v),
], ids=["constant", "upgrad", "dualproj", "sdmgrad", "crmogm", "graddrop", "famo",
        "stch-nadir", "stch-pref"])
def test_per_task_vectors_take_only_real_numbers(make, value: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid \w+: .*expected"):
        make(value)


@pytest.mark.parametrize("device", [-1, "gpu", True, 2.0, [0]])
@pytest.mark.parametrize("make", [W.DWA, W.FAMO, W.UncertaintyWeighting, W.RLW, W.GLS])
def test_a_weighting_names_a_device_it_cannot_use(make, device: object) -> None:
    # a negative index or an unknown name gave torch's own message, without the argument
    with pytest.raises(ValueError, match=r"Invalid device: .*expected a device"):
        make(2, device=device)


def test_a_weighting_takes_the_cpu_by_name_index_free_device_and_default() -> None:
    for device in ("cpu", torch.device("cpu"), None):
        assert W.DWA(2, device=device).device == torch.device("cpu")


def test_a_list_of_floats_is_read_in_float64() -> None:
    # numbers go straight to float64 (not through float32): 0.1 stays 0.1
    assert float(B.Constant([0.1, 0.2])._weights[0]) == 0.1


@pytest.mark.parametrize("groups", [[1.9, 2.9], [True, True], 3, "abc", torch.tensor(4),
                                    torch.tensor([1.5, 2.0]), []])
def test_gradvac_groups_must_be_positive_integers(groups: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid groups: .*integers"):
        B.GradVac(num_tasks=2, groups=groups)  # type: ignore[arg-type]


def test_gradvac_groups_as_an_integer_tensor() -> None:
    assert B.GradVac(num_tasks=2, groups=torch.tensor([2, 3])).groups == [2, 3]


@pytest.mark.parametrize("modules", ["trunk", 3, [1, 2], {"a": torch.nn.Linear(2, 2)}])
def test_modules_of_another_type_are_refused_in_every_mode(modules: object) -> None:
    trunk, heads = _model()
    with pytest.raises(ValueError, match=r"Invalid modules: .*expected an nn\.Module"):
        gb.TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()),
                          modules=modules)  # type: ignore[arg-type]


KERNELS = ["alignedmtl_weights", "cagrad_weights", "config_weights", "dualproj_weights",
           "fairgrad_weights", "imtlg_weights", "mgda_weights", "nashmtl_weights",
           "pcd_weights", "sdmgrad_weights", "upgrad_weights"]


def _gram() -> torch.Tensor:
    rows = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return rows @ rows.T


EXTRA = {"pcd_weights": lambda: (torch.full((2,), 0.1, dtype=torch.float64),),
         "sdmgrad_weights": lambda: (torch.full((3,), 1 / 3, dtype=torch.float64),
                                     torch.full((3,), 1 / 3, dtype=torch.float64))}


@pytest.mark.parametrize("name", KERNELS)
def test_functional_kernels_refuse_a_gramian_that_is_not_one(name: str) -> None:
    from gradbalance import functional
    base = getattr(functional, name)
    extra = EXTRA.get(name, lambda: ())()

    def kernel(gram: torch.Tensor) -> object:
        return base(gram, *extra)
    nan = _gram()
    nan[1, 1] = float("nan")
    with pytest.raises(ValueError, match="gramian holds inf or NaN"):
        kernel(nan)
    with pytest.raises(ValueError, match="gramian has negative diagonal entries"):
        kernel(-_gram())
    held = _gram().requires_grad_(True)  # read as its values: no graph in the answer
    out = kernel(held)
    first = out[0] if isinstance(out, tuple) else out
    assert not first.requires_grad


def test_row_norms_and_cosine_matrix_name_a_wrong_shape() -> None:
    from gradbalance.functional import cosine_matrix, row_norms
    with pytest.raises(ValueError, match=r"matrix must be \[K, P\]"):
        row_norms(torch.ones(3))
    with pytest.raises(ValueError, match=r"gram must be a \[K, K\] Gramian"):
        cosine_matrix(torch.ones(3))


def test_logging_helpers_name_their_bad_arguments(tmp_path) -> None:
    trunk, heads = _model()
    stats = gb.balanced_backward(_losses(trunk, heads), B.UPGrad(),
                                 shared_params=trunk.parameters(),
                                 head_params=heads.parameters())
    with pytest.raises(ValueError, match="Invalid amp_skipped: 'no'"):
        gb.stats_to_dict(stats, amp_skipped="no")  # type: ignore[arg-type]
    assert gb.stats_to_dict(stats, amp_skipped=torch.tensor(True))["amp_skipped"] == 1.0
    with pytest.raises(ValueError, match=r"Invalid pre_clip: a tensor of shape \(2,\)"):
        gb.stats_to_dict(stats, pre_clip=torch.ones(2))
    with pytest.raises(ValueError, match="Invalid stats: a dict"):
        gb.stats_to_dict({"losses": torch.ones(2)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is a directory"):
        gb.CSVLogger(tmp_path)


@pytest.mark.parametrize("build", [
    lambda: B.PCD(tau=None), lambda: B.CAGrad(c=torch.tensor([0.1, 0.2])),
    lambda: B.MGDA(normalization=__import__("numpy").array(["l2", "l2"])),
    lambda: W.UncertaintyWeighting(10**30), lambda: W.DWA(10**30),
    lambda: B.UPGrad(num_tasks=10**30),
], ids=["pcd-tau-none", "cagrad-c-tensor", "mgda-numpy-choice", "uncertainty-huge-k",
        "dwa-huge-k", "upgrad-huge-k"])
def test_constructor_arguments_of_the_wrong_kind_are_named(build) -> None:
    with pytest.raises(ValueError, match=r"Invalid (tau|c|normalization|num_tasks): "):
        build()
