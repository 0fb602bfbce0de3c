"""The Hugging Face ``BalancedTrainer`` trains like the plain gradbalance loop on the same
batches, accumulates like one larger batch, resumes bit for bit, and runs on two processes
(DDP over gloo, started by ``torchrun``) like one process on the global batch.

Run as a script (``torchrun --nproc_per_node 2 test_transformers.py OUT``), it is the worker of
the two-process test.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers
from transformers import PretrainedConfig, PreTrainedModel, TrainingArguments

from gradbalance import TaskAutoClip, TaskGradBuffer
from gradbalance.balancers import DBMTL, MGDA, GradVac, PCGrad
from gradbalance.checkpoint import CheckpointError
from gradbalance.integrations.transformers import STATE_FILE, BalancedTrainer
from gradbalance.weighting import GradNorm, UncertaintyWeighting

pytestmark = pytest.mark.filterwarnings("ignore")
transformers.logging.set_verbosity_error()

K, N, BATCH, MAX_NORM = 3, 32, 4, 1.0


class TinyConfig(PretrainedConfig):
    model_type = "gradbalance-tiny"

    def __init__(self, inputs: int = 8, width: int = 16, num_tasks: int = K,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inputs, self.width, self.num_tasks = inputs, width, num_tasks


class TinyMultiTask(PreTrainedModel):
    """A trunk and K regression heads; forward returns ``{"losses": [K]}`` and records the
    batches it trained on (``seen``)."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.trunk = nn.Sequential(nn.Linear(config.inputs, config.width), nn.ReLU(),
                                   nn.Linear(config.width, config.width), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(config.width, 1) for _ in range(config.num_tasks))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:  # keep torch's initialisation
        pass

    def get_input_embeddings(self) -> None:  # no embedding (accelerate's FSDP2 asks)
        return None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.detach().clone(), y.detach().clone()))
        feats = self.trunk(x)
        return {"losses": torch.stack([nn.functional.mse_loss(h(feats).squeeze(-1), y[:, k])
                                       for k, h in enumerate(self.heads)])}


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = N) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = torch.randn(n, K, generator=gen) * torch.tensor([1.0, 3.0, 0.3])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def _model(seed: int = 0) -> TinyMultiTask:
    torch.manual_seed(seed)
    return TinyMultiTask(TinyConfig())


def _parts(method: str, model: TinyMultiTask, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    if method == "gradvac":
        return {"balancer": GradVac(K, beta=0.5, generator=gen),
                "clip": TaskAutoClip(percentile=50, history_size=4)}
    if method == "dbmtl":  # a [K, P] state: each rank's columns on a sharded trunk
        return {"balancer": DBMTL(K, beta=0.5),
                "clip": TaskAutoClip(percentile=50, history_size=4)}
    return {"balancer": PCGrad(K, generator=gen),
            "weighting": GradNorm(K, model.trunk, alpha=1.5, lr=0.05)}


def _optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def _trainer(out: Path, method: str = "gradvac", *, seed: int = 0, accumulate: int = 2,
             batch: int = BATCH, epochs: int = 2, task_names: list[str] | None = None,
             own_optimizer: bool = False, **args: Any) -> BalancedTrainer:
    """``own_optimizer``: the Trainer builds the optimizer of :func:`_optimizers` from its
    arguments (under FSDP it refuses ``optimizers=``)."""
    model = _model(seed)
    options = {"save_strategy": "no", "logging_steps": 1, **args}
    if own_optimizer:  # SGD, momentum 0.9, a constant learning rate of 0.05: _optimizers'
        options.update(optim="sgd", optim_args="momentum=0.9", learning_rate=0.05,
                       lr_scheduler_type="constant", weight_decay=0.0)
    return BalancedTrainer(
        model=model,
        args=TrainingArguments(str(out), per_device_train_batch_size=batch,
                               gradient_accumulation_steps=accumulate, num_train_epochs=epochs,
                               max_grad_norm=MAX_NORM, use_cpu=True, report_to=[],
                               disable_tqdm=True, seed=42, **options),
        train_dataset=Data(), optimizers=(None, None) if own_optimizer else _optimizers(model),
        shared_params=lambda m: m.trunk.parameters(),
        head_params=lambda m: m.heads.parameters(), task_names=task_names,
        **_parts(method, model, seed),
    )


def _plain(method: str, batches: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int
           ) -> tuple[TinyMultiTask, list[dict[str, float]]]:
    """The plain gradbalance loop on the given micro-batches: what the Trainer must match."""
    model = _model()
    parts = _parts(method, model)
    weighting = parts.get("weighting")
    opt, _ = _optimizers(model)
    buf = TaskGradBuffer(list(model.trunk.parameters()), list(model.heads.parameters()))
    logs = []
    for start in range(0, len(batches), accumulate):
        for x, y in batches[start:start + accumulate]:
            losses = model(x, y)["losses"]
            if weighting is not None:  # one of the step's micro-batches: its share
                buf.backward(weighting(losses, micro_batches=accumulate))
            else:
                buf.backward(losses / accumulate)
        stats = buf.apply_(parts["balancer"], clip=parts.get("clip"))
        if weighting is not None:
            weighting.update(found_inf=stats.found_inf)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        logs.append({f"balance/loss/task{k}": float(stats.losses[k]) for k in range(K)})
    return model, logs


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


class Backend(transformers.TrainerCallback):
    """Receives the logs as every ``report_to`` backend does (``on_log``)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
               ) -> None:
        self.logs.append(dict(logs or {}))


@pytest.mark.parametrize("method", ["gradvac", "gradnorm"])
def test_trainer_matches_the_plain_loop(tmp_path: Path, method: str) -> None:
    trainer = _trainer(tmp_path, method)
    backend = Backend()
    trainer.add_callback(backend)
    trainer.train()
    batches = trainer.model.seen
    assert len(batches) == 2 * N // BATCH and trainer.state.global_step == N // BATCH
    model, logs = _plain(method, batches, accumulate=2)
    start = _params(_model())
    assert all(not torch.equal(p, start[n]) for n, p in _params(model).items())
    _assert_equal(_params(trainer.model), _params(model))  # bit for bit
    trained = [log for log in trainer.state.log_history if "loss" in log]
    assert len(trained) == len(logs)
    reported = [log for log in backend.logs if "loss" in log]
    assert [{k: v for k, v in log.items() if k != "step"} for log in trained] == reported
    assert {f"balance/w/task{k}" for k in range(K)} <= set(reported[0])
    for got, expected in zip(trained, logs):
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-6)
        assert got["loss"] == pytest.approx(sum(expected.values()), rel=1e-5)


def test_two_micro_batches_equal_one_batch_of_both(tmp_path: Path) -> None:
    two = _trainer(tmp_path / "two", accumulate=2, batch=BATCH)
    two.train()
    one = _trainer(tmp_path / "one", accumulate=1, batch=2 * BATCH)
    one.train()
    seen_two, seen_one = two.model.seen, one.model.seen
    for i, (x, _) in enumerate(seen_one):  # the same samples in every step
        assert torch.equal(x, torch.cat([seen_two[2 * i][0], seen_two[2 * i + 1][0]]))
    for name, p in _params(two.model).items():
        torch.testing.assert_close(p, _params(one.model)[name], rtol=1e-5, atol=1e-6)


class _Steps(transformers.TrainerCallback):
    """Each optimizer step's statistics (``trainer.last_stats``)."""

    def __init__(self, trainer: BalancedTrainer) -> None:
        self.trainer = trainer
        self.stats: list[Any] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stats.append(self.trainer.last_stats)


def test_logged_means_count_only_the_steps_that_computed_them(tmp_path: Path) -> None:
    """With ``update_every=2`` every other step reuses the weights and computes no norms: a
    log over two steps holds the one computed value, not half of it."""
    model = _model()
    trainer = BalancedTrainer(
        model=model, args=TrainingArguments(str(tmp_path), per_device_train_batch_size=BATCH,
                                            num_train_epochs=1, use_cpu=True, report_to=[],
                                            disable_tqdm=True, save_strategy="no",
                                            logging_steps=2),
        train_dataset=Data(), optimizers=_optimizers(model), balancer=MGDA(K),
        shared_params=lambda m: m.trunk.parameters(),
        head_params=lambda m: m.heads.parameters(), buffer_options={"update_every": 2})
    steps = _Steps(trainer)
    trainer.add_callback(steps)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == len(steps.stats) // 2
    for i, log in enumerate(logged):
        pair = steps.stats[2 * i: 2 * i + 2]
        assert [s.weights_reused for s in pair] == [False, True]
        assert log["balance/update_norm"] == pytest.approx(float(pair[0].update_norm), rel=1e-9)
        assert log["balance/size/task1"] == pytest.approx(float(pair[0].task_norms[1]),
                                                          rel=1e-9)


def test_a_learnable_weighting_is_cleared_between_steps(tmp_path: Path) -> None:
    """Uncertainty weighting's log-variances in the optimizer, as the docstring says: the
    Trainer zeroes only the model's gradients, the balanced step the weighting's; the run
    equals the plain loop's (there the optimizer's ``zero_grad`` clears both)."""
    runs = []
    for trainer_run in (True, False):
        model = _model()
        weighting = UncertaintyWeighting(K)
        params = [*model.parameters(), *weighting.parameters()]
        opt = torch.optim.SGD(params, lr=0.05)
        heads = lambda m, w=weighting: [*m.heads.parameters(), *w.parameters()]  # noqa: E731
        if trainer_run:
            trainer = BalancedTrainer(
                model=model, args=TrainingArguments(
                    str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=1,
                    use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no",
                    max_grad_norm=0.0),
                train_dataset=Data(), optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda step: 1.0)), balancer=MGDA(K), weighting=weighting,
                shared_params=lambda m: m.trunk.parameters(), head_params=heads)
            trainer.train()
            batches = trainer.model.seen
        else:
            buf = TaskGradBuffer(list(model.trunk.parameters()), heads(model))
            for x, y in batches:
                buf.backward(weighting(model(x, y)["losses"]))
                stats = buf.apply_(MGDA(K))
                weighting.update(found_inf=stats.found_inf)
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_model_init_restarts_the_balanced_parts(tmp_path: Path) -> None:
    """Each ``train()`` with ``model_init`` (a hyperparameter-search trial) builds the buffer
    on the new model and restarts the balancer and the clipper from their given state: the
    second run equals the first, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    trainer = BalancedTrainer(
        model_init=lambda: _model(), args=TrainingArguments(
            str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=1, use_cpu=True,
            report_to=[], disable_tqdm=True, save_strategy="no", seed=42),
        train_dataset=Data(), balancer=GradVac(K, beta=0.5, generator=gen),
        clip=TaskAutoClip(percentile=50, history_size=4),
        shared_params=lambda m: m.trunk.parameters(),
        head_params=lambda m: m.heads.parameters())
    trainer.train()
    first, model = _params(trainer.model), trainer.model
    trainer.train()
    assert trainer.model is not model
    _assert_equal(_params(trainer.model), first)


def test_a_step_a_raise_left_unfinished_is_dropped_by_the_next_train(tmp_path: Path) -> None:
    """A micro-batch that raises mid-step ends ``train()``; the Trainer zeroes the model's
    gradients when ``train()`` starts again, so the balanced step drops the unfinished step's
    task gradients and the weighting's observation: the run equals one that never failed."""
    reference = _trainer(tmp_path / "ref", "gradnorm", epochs=1)
    reference.train()
    trainer = _trainer(tmp_path / "failed", "gradnorm", epochs=1)
    own = trainer.compute_task_losses
    calls = []

    def second_raises(model: nn.Module, inputs: dict[str, Any]) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the second micro-batch of the first step
            raise RuntimeError("out of memory (injected)")
        return own(model, inputs)

    trainer.compute_task_losses = second_raises  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert trainer.balanced.buffer.in_step  # the first micro-batch's gradients are held
    trainer.compute_task_losses = own  # type: ignore[method-assign]
    trainer.train()
    _assert_equal(_params(trainer.model), _params(reference.model))


def _state(trainer: BalancedTrainer) -> dict[str, Any]:
    return {"params": _params(trainer.model), "balanced": trainer.balanced.state_dict()}


@pytest.mark.parametrize(("method", "bf16"), [("gradvac", False), ("gradnorm", False),
                                              ("gradvac", True)])
def test_resume_is_bit_identical(tmp_path: Path, method: str, bf16: bool) -> None:
    from support.loop_state import assert_same_state

    args = {"save_strategy": "steps", "save_steps": 3, "bf16": bf16}
    straight = _trainer(tmp_path, method, **args)
    straight.train()
    checkpoint = tmp_path / "checkpoint-3"  # mid-epoch: 4 steps per epoch
    assert (checkpoint / STATE_FILE).is_file()

    resumed = _trainer(tmp_path / "resumed", method, seed=99, **args)  # other weights
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == straight.state.global_step == 8
    assert_same_state(_state(resumed), _state(straight))
    logged = [log for log in straight.state.log_history if "loss" in log]
    assert len(logged) == 8
    # the first three come from the checkpoint's trainer_state.json, the others were logged
    assert [log for log in resumed.state.log_history if "loss" in log] == logged
    start = _params(_model())
    assert all(not torch.equal(p, start[n]) for n, p in _params(straight.model).items())


def test_evaluation_loss_is_the_sum_of_the_task_losses(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, epochs=1, label_names=["y"], per_device_eval_batch_size=8)
    metrics = trainer.evaluate(Data())
    model = trainer.model.eval()
    data = Data()
    with torch.no_grad():
        expected = [model(data.x[i:i + 8], data.y[i:i + 8])["losses"].sum()
                    for i in range(0, N, 8)]
    assert metrics["eval_loss"] == pytest.approx(float(torch.stack(expected).mean()), rel=1e-6)


def test_per_task_evaluation_losses_and_named_tags(tmp_path: Path) -> None:
    names = ["a", "b", "c"]
    trainer = _trainer(tmp_path, epochs=1, label_names=["y"], per_device_eval_batch_size=8,
                       task_names=names)
    trainer.train()
    assert {f"balance/loss/{n}" for n in names} <= set(trainer.state.log_history[0])
    metrics = trainer.evaluate(Data())
    model = trainer.model.eval()
    data = Data()
    with torch.no_grad():  # batches of 8: the mean over the samples is the mean of the batches
        per_batch = torch.stack([model(data.x[i:i + 8], data.y[i:i + 8])["losses"]
                                 for i in range(0, N, 8)]).double()
    for k, name in enumerate(names):
        assert metrics[f"eval_loss_{name}"] == pytest.approx(float(per_batch[:, k].mean()),
                                                             rel=1e-6)
    assert metrics["eval_loss"] == pytest.approx(sum(metrics[f"eval_loss_{n}"] for n in names),
                                                 rel=1e-5)
    predicted = trainer.predict(Data())
    assert predicted.metrics["test_loss_b"] == pytest.approx(metrics["eval_loss_b"], rel=1e-6)
    # the loss vector is not returned as if it were the model's predictions
    assert predicted.predictions is None or np.size(predicted.predictions) != K * (N // 8)


def test_samples_repeated_by_the_loader_are_named(tmp_path: Path,
                                                  recwarn: pytest.WarningsRecorder) -> None:
    # under data parallelism accelerate repeats the first samples to even out the processes'
    # last batches: the per-task means counted them silently; one process, a loader that
    # repeats two samples, stands for it
    trainer = _trainer(tmp_path, epochs=1, label_names=["y"], per_device_eval_batch_size=8)
    data = Data()
    order = [*range(len(data)), 0, 1]
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=order,
                                         collate_fn=trainer.data_collator)
    trainer.get_eval_dataloader = lambda *args, **kwargs: loader  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="count 2 samples twice"):
        trainer.evaluate(data)
    recwarn.clear()
    trainer.get_eval_dataloader = lambda *args, **kwargs: torch.utils.data.DataLoader(  # type: ignore[method-assign]
        data, batch_size=8, collate_fn=trainer.data_collator)
    trainer.evaluate(data)
    assert not [w for w in recwarn if "samples twice" in str(w.message)]


def test_fp16_on_cpu_is_turned_off_by_accelerate(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, epochs=1, fp16=True)
    assert trainer.accelerator.scaler is None  # accelerate: no float16 autocast on CPU
    trainer.train()
    model, _ = _plain("gradvac", trainer.model.seen, accumulate=2)
    _assert_equal(_params(trainer.model), _params(model))


def test_a_checkpoint_without_the_state_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, epochs=1, save_strategy="steps", save_steps=2)
    trainer.train()
    (tmp_path / "checkpoint-2" / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"has no {STATE_FILE}"):
        _trainer(tmp_path / "b", epochs=1).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_clear_errors(tmp_path: Path) -> None:
    model = _model()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             per_device_train_batch_size=BATCH)
    one_head = BalancedTrainer(model=model, args=args, train_dataset=Data(),
                               balancer=PCGrad(K), shared_params=model.trunk.parameters(),
                               head_params=model.heads[0].parameters())
    with pytest.raises(ValueError, match=r"in neither shared_params nor head_params: "
                                         r".*'heads\.1\.weight'") as raised:
        one_head.train()
    # the core's check, word for word: a plain buffer over the same model and losses
    core = TaskGradBuffer(list(model.trunk.parameters()), list(model.heads[0].parameters()),
                          modules=model)
    batch = {"x": Data().x[:BATCH], "y": Data().y[:BATCH]}
    with pytest.raises(ValueError) as plain:
        core.backward(model(**batch)["losses"])
    assert str(raised.value) == str(plain.value)
    assert all(p.grad is None for p in model.parameters())  # refused before anything moved

    class NoLosses(TinyMultiTask):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": super().forward(x, y)["losses"].sum()}

    torch.manual_seed(0)
    odd = NoLosses(TinyConfig())
    trainer = BalancedTrainer(model=odd, args=args, train_dataset=Data(), balancer=PCGrad(K),
                              shared_params=odd.trunk.parameters())  # heads: the rest
    with pytest.raises(ValueError, match=r"under 'losses'.*keys \['loss'\]"):
        trainer.train()


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"task_names": ["a", "b"]}, TypeError, r"Invalid buffer_options: 'task_names'"),
    ({"num_tasks": K}, TypeError, r"'num_tasks'.*the balancer's"),
    ({"mode": "gramain"}, ValueError, r"Invalid buffer_options: mode='gramain'"),
    ({"other_params": "drop"}, ValueError, r"other_params must be"),
    (["mode"], TypeError, r"Invalid buffer_options: a list"),
    # the per-sample route crashed at the first batch (an AttributeError inside the helper)
    ({"batch_dim": 0}, ValueError, r"Invalid buffer_options: batch_dim=0: the per-sample"),
])
def test_buffer_options_are_checked_when_the_trainer_is_built(
        tmp_path: Path, options: Any, error: type[Exception], match: str) -> None:
    # the buffer is built at the first step: a wrong option named now, not mid-training
    model = _model()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             per_device_train_batch_size=BATCH)
    with pytest.raises(error, match=match):
        BalancedTrainer(model=model, args=args, train_dataset=Data(), balancer=PCGrad(),
                        shared_params=model.trunk.parameters(), buffer_options=options)


def test_task_names_are_checked_when_the_trainer_is_built(tmp_path: Path) -> None:
    # K unknown (PCGrad()): the names' form is checked now, their count at the first step
    model = _model()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             per_device_train_batch_size=BATCH)
    for names, match in ((["depth", "depth"], "distinct"), (["a/b", "c"], "without '/'"),
                         ("depth", "the string")):
        with pytest.raises((TypeError, ValueError), match=rf"Invalid task_names.*{match}"):
            BalancedTrainer(model=model, args=args, train_dataset=Data(), balancer=PCGrad(),
                            shared_params=model.trunk.parameters(), task_names=names)


def test_import_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "gradbalance.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install gradbalance\[transformers\]"):
        importlib.import_module("gradbalance.integrations.transformers")


# -- two processes under torchrun -----------------------------------------------------------


def _worker(out: str) -> None:
    """One rank of the two-process run: train, then save what this rank saw and ended with."""
    trainer = _trainer(Path(out), "gradnorm", save_strategy="steps", save_steps=4,
                       ddp_backend="gloo")
    trainer.train()
    rank = trainer.args.process_index
    torch.save({"seen": trainer.model.seen, "state": _state(trainer),
                "logs": trainer.state.log_history}, Path(out) / f"rank{rank}.pt")


def test_two_processes_match_one_on_the_global_batch(tmp_path: Path) -> None:
    from support.ddp import torchrun_two
    from support.loop_state import assert_same_state

    ranks = torchrun_two(__file__, tmp_path)
    assert_same_state(ranks[1]["state"], ranks[0]["state"])  # the ranks agree bit for bit
    assert (tmp_path / "checkpoint-4" / STATE_FILE).is_file()
    # each step's global batch: rank 0's micro-batch i with rank 1's
    batches = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]))
               for a, b in zip(ranks[0]["seen"], ranks[1]["seen"])]
    assert len(batches) == N // BATCH  # the ranks split the data
    model, logs = _plain("gradnorm", batches, accumulate=2)
    for name, p in _params(model).items():
        torch.testing.assert_close(ranks[0]["state"]["params"][name], p, rtol=1e-5, atol=1e-6)
    trained = [log for log in ranks[0]["logs"] if "loss" in log]
    for got, expected in zip(trained, logs):
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-5)
    json.dumps(trained)  # plain numbers, for every report_to backend


if __name__ == "__main__":
    _worker(sys.argv[1])
