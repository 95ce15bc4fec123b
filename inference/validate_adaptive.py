"""Validation with adaptive verification (`python -m inference.validate --adaptive-verification
COSTS.json`): serve with the step-cost table the promise was priced with, and hold the served
acceptance to the adaptive promise (train.promise / training with eval.step_costs=COSTS.json:
verification "adaptive" at T = 0, "adaptive-standard" / "adaptive-block" at T > 0 in predicted.json's
`sampled`).

What is compared. The promise walks each held-out chain alone and verifies the width the chain's
own confidences and the table's batch-1 row make fastest (inference.walks.greedy.chain_widths: the
best rate at T = 0, the causal rule at T > 0, as the runtime). The runtime chooses one width per
step for the whole batch, from the running rows' summed survivals and the table's row for that
batch size (inference.runtime.adaptive.choose_width): at batch 1 the two choices are the same
function of the same confidences, at batch B > 1 they are not (a row verifies the batch's width,
not its own). So this comparison serves one question at a time (--batch-size 1, the default with
the flag) and refuses a larger batch: its tau would be held to a promise made for another policy
(`inference.bench --adaptive-verification` measures adaptive speed at larger batches).

Refused, each in one line, before anything is served: a tree (a tree verifies its nodes, no width
is chosen), a drafter without a confidence head, an export whose promise holds no adaptive figure
at the served temperature and verification, a table other than the one the promise was priced
with, and -k other than the promise's (the widths are chosen among 1..k).
"""
from __future__ import annotations

from dataclasses import dataclass

from inference.runtime.adaptive import AdaptiveVerification, StepCosts, step_ms_tensor
from models.acceptance import Prediction

FLAG = "--adaptive-verification"


@dataclass(frozen=True)
class AdaptiveServing:
    """The setting validate serves and replays with: the table, at the served temperature."""

    costs: StepCosts
    temperature: float
    promise_table: str  # where the promise's table was read from ("the promise", a path) or "none"

    @property
    def runtime(self) -> AdaptiveVerification:
        return AdaptiveVerification(self.costs)

    def widths(self, k: int, device):
        """The replay's verify_width (confidence [m,k] → [m]): batch 1's choice, as served."""
        from inference.walks.greedy import chain_widths

        return chain_widths(step_ms_tensor(self.costs, 1, k, device), causal=self.temperature > 0)

    def record(self, records: list[dict]) -> dict:
        """report.json's `adaptive_verification`: the table served with, where the promise's came
        from, and the mean width the runtime chose (drafts verified per row step)."""
        verified = sum(r.get("verified_drafts", 0) for r in records)
        row_steps = sum(sum(r["histogram"]) for r in records)
        return {"step_costs": self.costs.to_dict(), "promise_table": self.promise_table,
                "width_rule": "causal: widen while one more draft raises the rate" if self.temperature > 0
                else "best rate", "choice": "per step at batch 1 = per chain, as the promise chooses",
                "verified_drafts_per_row_step": verified / row_steps if row_steps else 0.0}


def check_request(costs_path: str, tree, batch_size: int | None) -> StepCosts:
    """What the flag refuses before the export is read: a tree, a batch larger than 1, a bad table."""
    if tree is not None:
        raise ValueError(f"{FLAG}: a tree verifies all its nodes, no width is chosen; leave out --tree")
    if batch_size is not None and batch_size > 1:
        raise ValueError(f"{FLAG}: --batch-size {batch_size}: the adaptive promise is each chain's own width (batch 1); "
                         "at a larger batch the runtime verifies one width for all rows, from their summed survivals, "
                         "which that promise does not predict (serve with --batch-size 1; inference.bench measures "
                         "adaptive verification's speed at larger batches)")
    try:
        return StepCosts.load(costs_path)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {str(e).strip(chr(39))}") from None


def check_promise(costs: StepCosts, predicted: Prediction | None, provenance: dict, promise_eval: dict, k: int,
                  temperature: float, verification: str) -> AdaptiveServing:
    """The promise's side: an adaptive figure at this setting, priced with this very table, for this k.
    An export that promises nothing is held to the replay alone (no table to compare)."""
    try:
        costs.row(1, k)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e}") from None
    setting = "T = 0" if temperature == 0 else f"T = {temperature:g}, {verification} verification"
    if predicted is None:
        return AdaptiveServing(costs, temperature, "none")
    if predicted.promise_at(temperature, verification, adaptive=True) is None:
        raise ValueError(f"{FLAG}: the export promises nothing with adaptive verification at {setting}; make that "
                         f"promise with the same table: `python -m train.promise EXPORT eval.step_costs=COSTS.json`"
                         + (f" eval.temperatures=[{temperature:g}]" if temperature > 0 else ""))
    if predicted.k is not None and k != predicted.k:
        raise ValueError(f"{FLAG}: -k {k}: the adaptive promise chose widths among 1..{predicted.k} (leave -k out)")
    if predicted.step_costs is not None:
        promised, where = StepCosts.from_dict(predicted.step_costs), "the promise"
    else:  # a promise that records only the path of its table (eval.step_costs)
        path = promise_eval.get("step_costs")
        if not path:
            raise ValueError(f"{FLAG}: the export's adaptive promise does not say which step-cost table priced it; "
                             "make the promise again (`python -m train.promise EXPORT eval.step_costs=COSTS.json`)")
        try:
            promised, where = StepCosts.load(path), str(path)
        except ValueError as e:
            raise ValueError(f"{FLAG}: the export's adaptive promise was priced with {path}, which cannot be read "
                             f"({str(e).strip(chr(39))}); make the promise again with the table to serve with") from None
    if promised != costs:
        fields = [name for name in ("target", "device", "dtype", "verify_ms", "draft_ms", "context")
                  if getattr(promised, name) != getattr(costs, name)]
        raise ValueError(f"{FLAG}: this step-cost table differs from the one the promise was priced with "
                         f"({', '.join(fields)} differ; the promise's: {where}); serve with that table, or make the "
                         "promise again with this one")
    return AdaptiveServing(costs, temperature, where)


def check_drafter(drafter) -> None:
    """Adaptive verification reads a confidence head."""
    if getattr(drafter, "confidence_head", None) is None:
        raise ValueError(f"{FLAG}: the drafter has no confidence head, which adaptive verification reads "
                         "(a DSpark drafter trained with drafter.dspark.confidence_head=true)")


def diagnosis_line(serving: AdaptiveServing, record: dict, k: int) -> str:
    return (f"Adaptive verification: served one question at a time with the promise's step-cost table "
            f"({serving.promise_table}), so each step verified the width the promise chooses for that chain "
            f"(rule: {record['width_rule']}); the runtime verified {record['verified_drafts_per_row_step']:.2f} drafts per "
            f"row step of k = {k}. At a larger batch it would choose one width for all rows (not this promise).")
