"""The claim register: every checkable claim of the two tutorials, one row each.

A row names the text (``balancing``: "Gradient Balancing Inside the Training Loop";
``clipping``: "Gradient clipping"), its section, the quoted words, the quantity measured and
the setup (the text's own parameters where it states them, the stated choice where it does
not). A measured row names its figure and a phrase (``key``) that picks exactly one of that
figure's claims, whose verdict it takes; a row the figures do not measure gives the reason
instead, and a row whose words state no quantity beyond other rows' (a summary) names those
rows (``by``) and is counted apart, as *measured by another row*. The measured claims no row
picks are the library's own checks (controls, checks of the batched runs against the
library, sensitivity readings, rows beyond the texts), reported in a table of their own
(`docs/figures.md`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradbalance_lab.figures._common import Claim

__all__ = ["BY_KIND", "KINDS", "REGISTER", "Row", "library_checks", "register_lines", "resolve",
           "summary", "tally", "unexpected_unmet"]


@dataclass(frozen=True)
class Row:
    """One claim of a text: where it is, its words, what is measured and how, and either the
    figure and ``key`` (a phrase of exactly one of its claims) or the ``reason`` it is not
    measured; ``measurable`` False when the words state no outcome a run could check (a
    description, advice, history, a theorem); ``by`` the ``(figure, key)`` of the rows that
    measure it when its words state no quantity beyond theirs (a summary of other rows): it
    then takes no verdict of its own and is counted apart; ``unmet`` where the text's number is
    known not to be reproduced (why, in docs/figures.md): the row is still measured and
    reported, but does not fail the run (:func:`unexpected_unmet`)."""

    text: str
    section: str
    quote: str
    quantity: str
    setup: str
    figure: str = ""
    key: str = ""
    reason: str = ""
    measurable: bool = True
    by: tuple[tuple[str, str], ...] = ()
    unmet: str = ""


def _b(section: str, quote: str, quantity: str, setup: str, figure: str = "", key: str = "",
       reason: str = "", measurable: bool = True, by: tuple[tuple[str, str], ...] = (),
       unmet: str = "") -> Row:
    return Row("balancing", section, quote, quantity, setup, figure, key, reason, measurable,
               by, unmet)


def _c(section: str, quote: str, quantity: str, setup: str, figure: str = "", key: str = "",
       reason: str = "", measurable: bool = True) -> Row:
    return Row("clipping", section, quote, quantity, setup, figure, key, reason, measurable)


_TEXT = "the text's own"
_BOWLS = "two-bowl example (docs/figures.md §7.2)"
_NET = "small trunk + 3 heads (task_grads settings)"
_RULES = "TaskGradBuffer + Sum, 2 linear tasks on R³, 3 steps, lr 0.1"

REGISTER: tuple[Row, ...] = (
    # -- the balancing text ---------------------------------------------------------------
    _b("§1", "A balancer acts once per training step, on that step's batch",
       "—", "—", measurable=False,
       reason="a description of where the balancer sits, no outcome to measure"),
    _b("§1", "Loss-weighting methods ... change the task losses before the backward pass; "
       "gradient methods ... replace the summed gradient after it", "—", "—",
       measurable=False,
       reason="a description; its consequence is §4's row (gradient methods can turn the step)"),
    _b("§1", "A balancer can do exactly what it promises and the step still come out "
       "unbalanced", "—", "—",
       measurable=False, reason="the section's thesis; measured piece by piece in §5–§12"),
    _b("§3", "Each loss is a batch mean ..., so gradients do not grow with batch size",
       "slope of log ‖g‖ against log n", f"{_NET}, n = 8 … 2048, 5 seeds",
       "task_grads", "each loss is a batch mean"),
    _b("§3", "One torch.autograd.grad call per task ... returns its gradient without touching "
       ".grad", ".grad bitwise unchanged; rows vs per-task gradients", _NET,
       "task_grads", "one torch.autograd.grad call"),
    _b("§3", "retain_graph=True keeps the graph for the next task",
       "second task's grad without / with it", _NET, "task_grads", "retain_graph=True"),
    _b("§3", "Every step costs K backward passes and K copies of the shared gradient",
       "passes through the trunk; shape of G", f"{_NET}, K = 3", "task_grads",
       "every step costs K backward"),
    _b("§3", "Writing into the shared .grad leaves each head its own plain gradient",
       "heads' .grad vs ∂(ΣL)/∂head", f"{_NET}, PCGrad", "task_grads",
       "leaves each head its own plain gradient"),
    _b("§3", "the PCGrad paper's rule and how LibMTL ... writes back PCGrad and GradVac",
       "—", "—", "task_grads", "PCGrad paper's rule"),
    _b("§3", "Backpropagating weighted losses scales the heads' gradients too",
       "head gradient / plain", f"{_NET}, w = 0.5, 2, 3", "task_grads",
       "backpropagating weighted losses"),
    _b("§3", "vector_to_parameters would overwrite the weights, not their gradients",
       "weights vs the vector; .grad unchanged", _NET, "task_grads", "vector_to_parameters"),
    _b("§4", "Loss weights w ... change a task gradient's length, never its direction",
       "row length ratio and cosine", f"{_NET}, w = 0.5, 2, 3", "task_grads",
       "loss weights change a task gradient's length"),
    _b("§4", "gradient methods act after and can turn it", "angle of PCGrad's step to the sum",
       _NET, "task_grads", "gradient methods act after the backward passes"),
    _b("§5", "the sum's gradient is n times longer for n elements",
       "‖g_sum‖ / ‖g_mean‖", "MSELoss, n = 8, 32, 128, 512", "loss_scale",
       "the sum reduction's gradient is n times"),
    _b("§5", "A loss's scale ... changes the gradient's length, never its direction",
       "cosine of g_sum and g_mean", "MSELoss, n = 8 … 512", "loss_scale",
       "... in the same direction"),
    _b("§5", "length is what balancers compare", "—", "—",
       measurable=False, reason="a description of the balancers; its consequence is the next rows"),
    _b("§5", "Loss-weighting methods undo a constant scale once their weights adapt",
       "weight × scale ratio", "Uncertainty Weighting, task 1's loss × 10, 500 Adam steps",
       "loss_scale", "loss-weighting methods undo a constant scale"),
    _b("§5", "Gradient methods feel it directly", "turn of the combined direction",
       "PCGrad, GradVac, CAGrad, MGDA; task 1's loss × 10", "loss_scale",
       "gradient methods feel a loss scale directly"),
    _b("§6", "Plain SGD ... steps against the gradient times the learning rate",
       "weights vs θ − lr·g by hand", _RULES, "optim_rules", "plain SGD steps against"),
    _b("§6", "Adam keeps two running averages for each coordinate of the gradient",
       "exp_avg, exp_avg_sq and weights vs the rule by hand", f"{_RULES}, Adam",
       "optim_rules", "Adam keeps two running averages"),
    _b("§6", "The ten-step average smooths noise but lags",
       "lag after a step change; std of exp_avg / std of the gradient",
       "Adam's exp_avg, β₁ = 0.9; 20,000 Gaussian gradients, 5 seeds", "optim_rules",
       "the ten-step average (β₁ = 0.9) smooths"),
    _b("§6", "after a 90 degree turn the momentum takes 7 steps to turn 45 degrees",
       "steps until the step is 45° from the old direction", "heavy ball, β = 0.9 "
       "(stated choice: unit gradients, e₁ then e₂)", "momentum", "β₁ = 0.9 takes 7 steps"),
    _b("§6", "Adam's step can turn in 1, onto a coordinate whose gradient had been small",
       "steps until 45°", "Adam at PyTorch's defaults", "momentum",
       "Adam's step can turn 45° in 1 step"),
    _b("§6.1", "At β₁ = 0 the momentum keeps only this step", "memory; first step's angle",
       "β₁ = 0", "momentum", "at β₁ = 0 the momentum keeps only"),
    _b("§6.1", "at 0.5 it spans about 2 steps, at 0.9 about 10 and at 0.99 about 100",
       "memory Σβⁿ", "β = 0.5, 0.9, 0.99", "momentum", "the memory spans about 2"),
    _b("§7", "The per-coordinate division cancels some of the balancer's changes",
       "Adam's step with Mean / with Sum (SGD the control)",
       f"{_BOWLS}, noise σ = 1, lr 0.01, 300 steps", "optim_rules",
       "the per-coordinate division cancels some"),
    _b("§7", "... delays others", "head step ratio after a sudden ×4",
       "Adam, a task weight ×4 at once", "adam_absorb", "a sudden change is not absorbed"),
    _b("§7", "... and tilts every step", "share of steps tilted > 1° from PCGrad's direction",
       f"{_BOWLS}, lr 0.01", "adam_tilt", "tilts every step"),
    _b("§7.1", "Adam's step turns with it", "angle of the step before / after",
       "gradients (3, 1) and (−1, 2) summed, task 1 ×3, Adam defaults", "adam_turn",
       "Adam's step turns with the new mix"),
    _b("§7.1", "then turns back as each coordinate's scale catches up", "angle at the end",
       "as above", "adam_turn", "then turns back"),
    _b("§7.2", "PCGrad balances them; SGD ... run at learning rate 0.01 for 20,000 steps",
       "distance of the end point to the Pareto set", f"{_BOWLS}, start (5, 5)",
       "adam_tilt", "PCGrad + SGD"),
    _b("§7.2", "... and Adam run at learning rate 0.01 for 20,000 steps",
       "distance of the end point to the Pareto set", f"{_BOWLS}, start (5, 5)",
       "adam_tilt", "PCGrad + Adam"),
    _b("§7.2", "Tilt of Adam's step", "median angle of the step to PCGrad's direction",
       f"{_BOWLS}, lr 0.01", "adam_tilt", "Adam tilts the step away"),
    _b("§7.2", "Tilt of Adam's step (the figure's end points)", "distance between end points",
       f"{_BOWLS}, lr 0.01", "adam_tilt", "lands elsewhere on the Pareto set"),
    _b("§8", "PCGrad's and MGDA's guarantees cover the direction they hand over, for one "
       "batch; momentum and the per-coordinate scale change the step after", "—", "—",
       reason="a summary of §8.1 (momentum) and §7 (the per-coordinate scale); no quantity "
       "beyond theirs", by=(("pcgrad_momentum", "carries the past into every step"),
                            ("adam_tilt", "tilts every step"))),
    _b("§8.1", "Momentum ... carries the past into every step",
       "steps uphill for a task: handed-over direction vs momentum step",
       f"{_BOWLS}, heavy ball", "pcgrad_momentum", "carries the past into every step"),
    _b("§8.1", "PCGrad with heavy-ball momentum reaches either the optimum or a point where "
       "the two gradients point exactly opposite", "end state of 8 starts",
       f"{_BOWLS}, exact gradients", "pcgrad_momentum", "reaches the optimum or a point"),
    _b("§8.2", "the step size over the last 1000 of 6000 steps as a share of the first",
       "share, two readings of 'the first'", f"{_TEXT}: 5 runs, lr 0.02; {_BOWLS}",
       "mgda_noise", "step size over the last"),
    _b("§8.2", "MGDA's combined gradient stops shrinking ... instead of going to zero",
       "last window / the one before", "as above", "mgda_noise", "it stops shrinking"),
    _b("§8.2", "once it reaches the size of the batch-to-batch noise",
       "plateau / lr·E‖ξ‖", "as above", "mgda_noise", "once it reaches the size",
       unmet="the plateau is 0.45 of lr·E‖ξ‖ at the text's settings (docs/figures.md, §8.2)"),
    _b("§8.2", "Watch the per-task losses to decide when to stop, not a gradient size",
       "—", "—", measurable=False, reason="advice for the reader's runs, no outcome stated"),
    _b("§9.1", "The GradNorm paper renormalizes after every step", "largest |Σw − K|",
       "GradNorm, K = 3, 200 steps", "gradnorm", "with the rescale after every step"),
    _b("§9.1", "without it the weights' sum drifts", "largest |Σw − K|", "as above",
       "gradnorm", "without it the weights' sum drifts"),
    _b("§9.1", "... and acts as a learning-rate change", "replay at lr·Σw/K vs the free run",
       "network on SGD", "gradnorm", "acts as a learning-rate change"),
    _b("§9.1", "Adam at 0.025 against 2×10⁻⁵ for the network, about 1250 times larger",
       "ratio of the learning rates and of the first steps", _TEXT, "gradnorm",
       "the weights' optimizer"),
    _b("§9.1", "L_grad trains only w; the last two lines rescale w ... inside no_grad, so the "
       "rescale is not trained", "θ.grad; w a leaf; next gradient in w vs closed forms",
       "the text's fragment on K = 3; the library's GradNorm update", "gradnorm",
       "in the fragment L_grad trains only w"),
    _b("§9.2", "inside opt.step(), after the balancer wrote the gradient, so the balancer "
       "never sees it", "balanced .grad across wd and optimizers", "wd 0.01, 0.1, 1",
       "weight_decay", "decay acts inside opt.step()"),
    _b("§9.2", "a larger wd shrinks them faster (AdamW)", "shrink per step / lr",
       "wd 0.01, 0.1, 1", "weight_decay", "holds for AdamW"),
    _b("§9.2", "a larger wd shrinks them faster (Adam)", "shrink per step / lr",
       "256 weights with noise-only task gradients, 200 steps", "weight_decay",
       "shrinks them faster: Adam"),
    _b("§9.2", "Adam adds wd times the weights to the gradient before m and v",
       "m, v and weights vs the coupled rule by hand; vs the decoupled reading",
       f"{_RULES}, Adam, wd 0.5", "optim_rules", "Adam adds wd times the weights"),
    _b("§9.2", "AdamW shrinks the weights directly, by the learning rate times wd",
       "per-step factor vs 1 − lr·wd", "wd 0.01, 0.1, 1", "weight_decay",
       "AdamW shrinks the weights directly"),
    _b("§9.2", "An L2 penalty written into a task's loss does pass through the balancer",
       "task row of G and .grad", "PCGrad, two conflicting tasks", "weight_decay",
       "an L2 penalty written"),
    _b("§9.2", "its value at σ = 1, which is 0.5 for regression and 1 for classification",
       "weights at σ = 1", "Uncertainty Weighting", "weight_decay",
       "Uncertainty Weighting's weights at σ = 1"),
    _b("§9.2", "Decay on Uncertainty Weighting's log σ pulls each task's weight toward its "
       "value at σ = 1", "learned weights by wd", "wd 0, 0.1, 1, 10", "weight_decay",
       "decay on log σ pulls"),
    _b("§9.3", "The Uncertainty Weighting paper ... saw all three uncertainties fall and "
       "lowered the learning rate on a schedule", "—", "—",
       measurable=False,
       reason="a report of the paper's experiment (three street-scene tasks), not rerun"),
    _b("§9.3", "Uncertainty and the effective learning rate (SGD)", "head step ratio",
       "σ halving over the run, SGD", "adam_absorb", "under SGD a task weight"),
    _b("§9.3", "Under Adam, the per-coordinate scale on a task's head largely absorbs a slow "
       "weight change", "head step ratio vs weight ratio", "as above, Adam", "adam_absorb",
       "under Adam the per-coordinate scale"),
    _b("§10", "A smaller τ clips more steps and shortens them more; a very large τ never "
       "clips", "share clipped, mean factor", "one logged run, τ at its percentiles",
       "clipping", "a smaller τ clips more steps"),
    _b("§10", "PyTorch has no default; it is set per model",
       "the limit's default in the signature; a call without it",
       "clip_grad_norm_, clip_grad_value_, TaskClip", "clipping",
       "PyTorch has no default limit"),
    _b("§10", "only the first scales the whole gradient by one factor",
       "combined update of clipped rows", "rows [30, 40] and [−0.4, 0.3]", "clipping",
       "only the global clip scales"),
    _b("§10", "per task, before the combine", "combined update", "parallel rows, τ = 1",
       "clipping", "per-task clipping caps each row"),
    _b("§10", "per value: direction turns", "clipped vector and its turn", "[30, 40], cv = 5",
       "clipping", "per-value clip at 5"),
    _b("§11", "to stop small gradients rounding to zero, it multiplies every loss by one "
       "scale s", "share of zero entries with and without s", "float16 on the CPU",
       "fp16_underflow", "to stop small gradients rounding"),
    _b("§11", "Every task carries the same s, so no balancer's direction changes",
       "angle with and without s", "24 balancers", "mixed_precision",
       "every task carries the same s"),
    _b("§11", "When a scaled gradient overflows, the scaler skips the step",
       "skipped flag, weights", "GradScaler('cpu'), injected overflow", "amp_cpu",
       "the scaler skips the step"),
    _b("§11", "a balancer with its own state ... should update it only on steps not skipped",
       "state before / after a skipped step", "24 balancers", "mixed_precision",
       "a skipped step leaves balancer state"),
    _b("§11", "Any size compared with a fixed number ... is first divided by s",
       "scaled sizes / s vs true", "s = 65536", "mixed_precision",
       "true gradient sizes are the scaled sizes"),
    _b("§11", "unscale_ does that for .grad", "pre-clip norm after unscale_ vs true",
       "GradScaler('cpu')", "amp_cpu", "GradScaler('cpu') is enabled"),
    _b("§11", "scaler = torch.amp.GradScaler() (the snippet)", "is_enabled() on a CPU-only "
       "machine", "torch's default device", "amp_cpu", "(the text's snippet)"),
    _b("§12", "about 7 degrees apart for PCGrad", "median angle between the two orders",
       f"{_TEXT}: 4 micro-batches, noise ≈ gradient; {_BOWLS}", "microbatch",
       "about 7° apart"),
    _b("§12", "... and 19 for MGDA", "median angle between the two orders", "as above",
       "microbatch", "about 19° apart",
       unmet="21.5–22.3° over seeds at the text's settings (docs/figures.md, §12)"),
    _b("§12", "Balancing is not linear", "B(A + C) vs B(A) + B(C), by hand",
       "PCGrad, MGDA; Mean the control; 2 × 2 matrices", "microbatch",
       "balancing is not linear"),
    _b("§12", "Averaging first and balancing once gives the balancer the same gradients a "
       "full batch would", "G and the step vs one batch", "4 micro-batches of 16",
       "microbatch", "averaging first and balancing once"),
    _b("§13", "logs its parts every step", "tags logged", "a short run with a GradScaler",
       "logging", "per task the raw loss"),
    _b("§13", "whether the step was skipped", "amp_skipped at the injected overflow",
       "overflow injected", "logging", "amp_skipped marks"),
    _b("§13", "cosine similarity ... 1 when they agree, 0 at a right angle, negative when "
       "opposed", "logged value vs the value by hand", "two task gradients that agree, "
       "meet at a right angle, oppose", "logging", "1 when they agree"),
    _b("§13", "The weighted total loss hides all of this", "—", "—",
       measurable=False, reason="a motivation, no outcome stated"),
    _b("§13", "Compare each raw loss with that task trained alone, and log how much each "
       "number varies", "—", "—", "logging", "compare each raw loss"),
    # -- the clipping text ----------------------------------------------------------------
    _c("intro", "turning the occasional explosive step into a survivable one — same "
       "direction, sane size", "loss unclipped vs clipped at lr × 10",
       "MLP regression, lr 0.01 → 0.1, τ = the healthy run's p95", "clip_explode",
       "(0.01 → 0.1)"),
    _c("Why it exists", "the loss suddenly reads NaN ... Clipping ... makes the giant "
       "survivable", "loss unclipped vs clipped", "lr 0.03 → 0.3 (second base rate)",
       "clip_explode", "(0.03 → 0.3)"),
    _c("Why it exists", "a deep network multiplying blame layer after layer until it "
       "snowballs", "slope of log ‖∂L/∂xₜ‖ per layer vs its closed form",
       "T-layer linear net, width 64, Gaussian layers of gain 1.5 (1 beside), 5 seeds",
       "clip_depth", "a deep network multiplying blame"),
    _c("Why it exists", "Clipping does not fix the cause of the giant gradient", "—", "—",
       measurable=False, reason="a framing, no outcome to measure"),
    _c("How it works", "gradient size 3, limit 10 -> untouched", "returned norm, .grad",
       _TEXT, "clip_basics", "gradient size 3"),
    _c("How it works", "gradient size 250, limit 10 -> every gradient scaled down by 25x",
       "per-entry ratio", _TEXT, "clip_basics", "gradient size 250"),
    _c("How it works", "direction kept, size now exactly 10", "size and turn", _TEXT,
       "clip_basics", "direction kept, size now exactly 10"),
    _c("A real example", "Clipping was the workhorse fix ... standard practice in the "
       "recipes behind today's chat models", "—", "—",
       measurable=False, reason="history of practice, not a measurable outcome"),
    _c("Setup", "Outputs verified with torch 2.5.1, CPU", "the snippets' outputs under torch "
       "2.5.1", "—", reason="torch 2.5.1 is below the library's floor (2.6, docs/install.md); "
       "the outputs the text prints are measured with the installed torch in the rows below"),
    _c("Watching a clip happen", "returned: 50.0", "returned norm", _TEXT, "clipping",
       "returns 50"),
    _c("Watching a clip happen", "tensor([0.6000, 0.8000]) norm = 0.9999999403953552",
       "clipped vector and its norm", _TEXT, "clipping", "leaves [0.6, 0.8]"),
    _c("The walkthrough", "healthy training shows it wandering within a band; trouble "
       "shows spikes", "largest norm / p95 after warm-up", "lr 0.01 vs 0.1", "clip_explode",
       "wanders within a band"),
    _c("The walkthrough", "the log tells you when they started, which batch, and whether "
       "your limit is doing anything at all", "—", "—",
       measurable=False, reason="advice on reading the log, no outcome stated"),
    _c("The walkthrough", "With gradient accumulation, clip once per update on the finished "
       "pile", "pile vs full batch", "20 updates of 4 micro-batches", "clip_accumulation",
       "clip once per update on the finished pile"),
    _c("The walkthrough", "never per micro-batch", "angle and length vs once per update",
       "as above", "clip_accumulation", "never per micro-batch"),
    _c("The walkthrough", "[30, 40] became [5, 5] — the direction changed", "vector, turn",
       _TEXT, "clipping", "per-value clip at 5"),
    _c("The walkthrough", "Norm clipping is the default choice in modern recipes ...; value "
       "clipping survives in some reinforcement-learning code", "—", "—",
       measurable=False, reason="a survey of practice, not a measurable outcome"),
    _c("Choosing the limit", "Common starting points: 1.0 (transformer training), 0.5–5.0 "
       "elsewhere", "—", "—", measurable=False, reason="folklore the text itself sets aside"),
    _c("Choosing the limit", "set the limit around the 90th–95th percentile of healthy "
       "values", "share clipped on a fresh run", "200 logged steps", "clip_threshold",
       "90th–95th percentile"),
    _c("Choosing the limit", "a limit that clips constantly is quietly shrinking your "
       "effective learning rate", "mean factor at τ = p10", "as above", "clip_threshold",
       "clips constantly"),
    _c("Common mistakes", "Clipping before backward ... there is nothing to clip",
       "returned norm, loss", "lr 0.3", "clip_explode", "clipping before backward"),
    _c("Common mistakes", "after step the damage is applied", "loss vs the unclipped run",
       "lr 0.3", "clip_explode", "clipping after step"),
    _c("Common mistakes", "scaling NaN gives NaN — clipping cannot resurrect it",
       "NaN entries after clip", "a NaN loss", "clip_nonfinite", "if your loss is already NaN"),
    _c("Common mistakes", "clip_grad_norm_ touches .grad only", "weights bitwise unchanged",
       "small MLP", "clip_api", "touches .grad only"),
    _c("Common mistakes", "Norms permanently above the limit mean every update is "
       "rescaled — training slows", "loss after 200 steps at p10 vs p95", "same batches",
       "clip_threshold", "limit brutally low"),
    _c("Common mistakes", "The logged pre-clip norm tells you when this is happening", "—",
       "—", measurable=False,
       reason="advice on reading the log; the band row above measures the log itself"),
    _c("Common mistakes", "With GradScaler, gradients are scaled up", "norm before unscale_",
       "GradScaler('cpu')", "clip_amp", "gradients are scaled up"),
    _c("Common mistakes", "scaler.unscale_(optimizer) first, then clip, then scaler.step",
       "pre-clip norm and update length", "as above", "clip_amp", "clip them un-scaled"),
    _c("Common mistakes", "Clipping scaled gradients applies a meaningless threshold",
       "update length ratio", "as above", "clip_amp", "meaningless threshold"),
    _c("Try it yourself", "Find your 95th percentile and compare it with the limit you had "
       "guessed", "—", "—", measurable=False,
       reason="an exercise; the guessed limit is the reader's"),
    _c("Try it yourself", "multiply your learning rate by 10 and watch what the seismograph "
       "does — explosions on demand", "largest pre-clip norm / healthy p95; finite losses",
       "the clipped runs at lr 0.01 → 0.1 and 0.03 → 0.3", "clip_explode",
       "the seismograph at lr × 10"),
    _c("Definitions", "ε a small constant against division by zero", "ε; zero gradient "
       "clipped", "clip_grad_norm_, clip_task_norms_", "clip_basics", "§Definitions: ε"),
    _c("Definitions", "its global L2 norm (computed across all parameters jointly — the default "
       "in clip_grad_norm_)", "returned norm vs the concatenated and per-tensor norms; "
       "the factor per tensor", "10 tensors", "clip_api",
       "computed across all parameters jointly"),
    _c("Definitions", "Direction is preserved exactly; magnitude is capped at c",
       "direction and ‖u‖ over 51 limits", "one gradient, c from 1e-6 to 10⁴",
       "clip_small_tau", "clipping interpolates"),
    _c("Definitions", "Cost: ... O(P) in parameter count, negligible against the backward "
       "pass", "—", "—", measurable=False,
       reason="a timing claim; the figures keep no wall-clock checks: "
              "benchmarks/clip_cost.py times it (clip_grad_norm_ 2–8 % of the forward and "
              "backward from P ≈ 0.3M on, 0.4 ns per parameter at 8.5M; below, a fixed "
              "~0.1 ms)"),
    _c("Definitions", "clip_grad_norm_ also accepts norm_type (any p-norm, including inf)",
       "inf-norm vs max |gᵢ|", "one gradient", "clip_api", "accepts norm_type"),
    _c("Definitions", "foreach=True fused implementations in torch 2.x",
       "foreach vs loop, bitwise", "10 tensors", "clip_api", "foreach=True"),
    _c("Why gradients explode", "If the spectral radii of the J_t sit above 1, the product "
       "grows exponentially in T; below 1, it vanishes",
       "slope of log ‖∂L/∂h₀‖ against T vs log ρ",
       "linear recurrence, n = 16, ρ = 1.1 and 0.9, T = 10 … 400, 5 seeds", "clip_depth",
       "spectral radii above 1"),
    _c("Why gradients explode", "clipped GD provably beats any fixed-step GD "
       "(Zhang et al. 2020)", "—", "—",
       measurable=False, reason="a theorem under (L₀, L₁)-smoothness; no run reproduces a proof"),
    _c("Relatives and variants", "thresholds tracked from gradient-norm history (AutoClip)",
       "threshold vs the percentile so far", "200 steps, p = 10", "clip_autoclip",
       "adaptive clipping"),
    _c("Relatives and variants", "AGC ... clips per-unit by the ratio ‖g‖/‖w‖",
       "largest ratio after AGC", "λ = 0.25", "clip_agc", "clips per-unit"),
    _c("Relatives and variants", "removing the global scale sensitivity",
       "layer × 64: AGC's clipped gradient", "as above", "clip_agc",
       "removing the global scale sensitivity"),
    _c("Relatives and variants", "each sample's gradient clipped individually before "
       "aggregation", "PerSampleClip vs a per-sample loop", "B = 16, C = 5", "clip_per_sample",
       "each sample's gradient clipped"),
    _c("Relatives and variants", "the clip bounds sensitivity for the privacy accountant",
       "movement of the sum under one outlier", "as above", "clip_per_sample",
       "bounds sensitivity"),
    _c("Relatives and variants", "normalised SGD and signSGD are the c → 0 limit family",
       "‖u/c − g/‖g‖‖ as c → 0", "one gradient", "clip_small_tau", "c → 0 limit family"),
    _c("Relatives and variants", "(signSGD)", "u/c vs sign(g)", "per-value clip",
       "clip_small_tau", "signSGD is the same limit"),
    _c("Relatives and variants", "clip after gradient synchronisation, so all replicas clip "
       "the same global norm", "pre-clip norm on each rank", "2 gloo ranks × 16 samples",
       "clip_ddp", "clip after gradient synchronisation"),
)


def _picked(row: Row, claims: list[Claim]) -> list[Claim]:
    return [c for c in claims if row.key in c.text]


def unexpected_unmet(entries: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """``(unexpected, known)``: the measured claims not met, as ``figure: text``, apart from
    those a register row marks ``unmet`` (the text's number known not to be reproduced)."""
    known_keys = [(row.figure, row.key) for row in REGISTER if row.unmet]
    unexpected: list[str] = []
    known: list[str] = []
    for entry in entries:
        for claim in entry["claims"]:
            if claim.met is not False:
                continue
            label = f"{entry['name']}: {claim.text}"
            hit = any(entry["name"] == fig and key in claim.text for fig, key in known_keys)
            (known if hit else unexpected).append(label)
    return unexpected, known


def resolve(entries: list[dict[str, Any]]) -> list[tuple[Row, str, Claim | None]]:
    """Each register row with its verdict (``met``, ``not met``, ``not measurable: …``,
    ``shown`` or ``not measured: …``) and the measured claim it takes it from.

    A row whose figure did not run (or is not in ``entries``) is ``not run``. Raises when a
    row's key picks no claim or several of its figure's (the register is out of date)."""
    by_name = {e["name"]: e for e in entries}
    out: list[tuple[Row, str, Claim | None]] = []
    for row in REGISTER:
        if row.by:
            out.append((row, f"{BY_ROWS} {_row_numbers(row.by)}: {row.reason}", None))
            continue
        if not row.figure:
            kind = "not measured" if row.measurable else "not measurable"
            out.append((row, f"{kind}: {row.reason}", None))
            continue
        entry = by_name.get(row.figure)
        if entry is None or entry["missing"]:
            out.append((row, "not run", None))
            continue
        picked = _picked(row, entry["claims"])
        if len(picked) != 1:
            raise ValueError(f"register row {row.section} {row.quote[:40]!r}: key {row.key!r} "
                             f"picks {len(picked)} claims of {row.figure!r}; expected one")
        claim = picked[0]
        out.append((row, _verdict(claim), claim))
    return out


BY_ROWS = "measured by rows"


def _row_numbers(by: tuple[tuple[str, str], ...]) -> str:
    """The register's numbers (1-based) of the rows ``by`` names; raises when one is not a
    measured row of the register."""
    numbers = []
    for figure, key in by:
        found = [i for i, r in enumerate(REGISTER, 1) if r.figure == figure and r.key == key]
        if len(found) != 1:
            raise ValueError(f"register: no measured row ({figure!r}, {key!r}) to refer to")
        numbers.append(str(found[0]))
    return ", ".join(numbers)


def _verdict(claim: Claim) -> str:
    if claim.met is None and claim.reason:
        return f"not measurable: {claim.reason}"
    return {True: "met", False: "not met", None: "shown"}[claim.met]


def library_checks(entries: list[dict[str, Any]]) -> list[tuple[str, Claim]]:
    """The measured claims no register row picks: ``(figure, claim)`` in run order."""
    keys: dict[str, list[str]] = {}
    for row in REGISTER:
        if row.figure:
            keys.setdefault(row.figure, []).append(row.key)
    return [(e["name"], c) for e in entries for c in e["claims"]
            if not any(k in c.text for k in keys.get(e["name"], []))]


BY_KIND = "measured by another row"
KINDS = ("met", "not met", "not measurable", "shown", BY_KIND, "not measured", "not run")


def tally(resolved: list[tuple[Row, str, Claim | None]]) -> dict[str, int]:
    """Register rows per verdict kind: met, not met, not measurable, shown, measured by
    another row, not measured, not run (the seven add up to the register's length)."""
    counts = dict.fromkeys(KINDS, 0)
    for _, verdict, _ in resolved:
        kind = BY_KIND if verdict.startswith(BY_ROWS) else verdict.split(":")[0]
        counts[kind] += 1
    return counts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary(entries: list[dict[str, Any]]) -> str:
    """One line: the register's rows by verdict (they add up to its length)."""
    counts = tally(resolve(entries))
    parts = [f"{kind} {n}" for kind, n in counts.items()
             if n or kind in ("met", "not met", "not measured")]
    return (f"Claim register: {len(REGISTER)} claims of the two texts: "
            f"{'; '.join(parts)}; library checks: {len(library_checks(entries))}.")


def register_lines(entries: list[dict[str, Any]]) -> list[str]:
    """The register and the library checks as two markdown tables."""
    resolved = resolve(entries)
    lines = ["## Claim register", "", summary(entries), "",
             "| # | text | section | claim (quoted) | quantity | setup | figure | measured "
             "| verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for i, (row, verdict, claim) in enumerate(resolved, 1):
        measured = claim.measured if claim is not None else "—"
        lines.append(f"| {i} | {row.text} | {row.section} | {_cell(row.quote)} | "
                     f"{_cell(row.quantity)} | {_cell(row.setup)} | "
                     f"{row.figure or '—'} | {_cell(measured)} | {_cell(verdict)} |")
    checks = library_checks(entries)
    lines += ["", "## Library checks", "",
              "Rows that are not claims of the texts: checks of the batched runs against the "
              "library, controls, sensitivity readings and rows beyond the texts. They are not "
              "counted in the register.", "",
              "| figure | check | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {_cell(c.text)} | {_cell(_verdict(c))} |" for name, c in checks]
    return [*lines, ""]
