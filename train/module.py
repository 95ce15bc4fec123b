"""One LightningModule: frozen target + drafter + TTT objective + predicted acceptance."""
from __future__ import annotations

import math
import time

import lightning as L
import torch

from inference.walks.greedy import cap_answer_spans, predicted_histogram
from inference.walks.sampled import VERIFICATIONS, sampled_histogram, setting_key
from models.acceptance import Acceptance, HeldoutPrediction, Prediction, Promise
from models.methods import predictor_of
from models.target import Target
from train.config import EvalConfig, ObjectiveConfig, OptimConfig
from train.joint import keep_close_kl, lm_loss
from train.losses import acceptance_targets, confidence_bce, feature_smooth_l1, hard_ce, soft_kl, ttt_slices, ttt_step_weights


def lr_factor(step: int, warmup: int, total: int, floor: float, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine from 1 to `floor` over `total` steps or, when a time budget
    is used, over whichever of the steps or the time (time_fraction = share spent) runs out
    first."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class DrafterModule(L.LightningModule):
    def __init__(self, target: Target, drafter: torch.nn.Module, objective: ObjectiveConfig,
                 optim: OptimConfig, evaluation: EvalConfig, schedule_steps: int, eval_names: list[str] | None = None,
                 time_budget_s: float | None = None, description: dict | None = None,
                 stored_features_dtype: torch.dtype | None = None):
        super().__init__()
        self.joint = objective.joint  # Medusa-2 / joint MTP: the target trains too
        # trained from a feature store (data.features): batches carry the target's outputs, cast to
        # the dtype the target would give; the target is then no submodule, so Lightning never
        # puts it on the device: each validation (the held-out promise) moves it there and back
        self.stored_features_dtype = stored_features_dtype
        if stored_features_dtype is not None:
            self.__dict__["target"] = target.requires_grad_(False)
        else:
            self.target = target.requires_grad_(self.joint)
        if self.joint:  # its embedding and head stay: the drafters hold frozen copies of them
            target.model.get_input_embeddings().requires_grad_(False)
            target.model.get_output_embeddings().requires_grad_(False)
        if self.joint and objective.keep_weight > 0:
            import copy

            # the original target, frozen: what keep_close_kl holds the trained one to
            self.original = copy.deepcopy(target).requires_grad_(False)
        self.drafter = drafter
        self.objective, self.optim, self.evaluation = objective, optim, evaluation
        self.schedule_steps = schedule_steps  # LR schedule length
        self.time_budget_s = time_budget_s  # optim.schedule_by=time: trainer.max_time in seconds
        self._clock, self._seconds_before = None, 0.0  # training time before this process (resume)
        self.predictor = predictor_of(drafter)  # chain / heads unroll; block: DFlash's objective
        self.steps = drafter.train_steps(objective.ttt_steps)  # TTT length, or Medusa's head count
        self.step_weights = ttt_step_weights(self.steps, objective.ttt_decay)  # DFlash uses its own position weights
        self.predicted: Prediction | None = None
        self.shown: dict[str, torch.Tensor] = {}  # the last training step's loss and accuracy (the progress bar's)
        self.walk_seconds: dict[str, float] = {}  # the last validation's, by part (on_validation_epoch_start)
        self.eval_names = eval_names or ["heldout"]  # one validation loader per held-out set
        # then one loader per eval.sampled_answers set: the first set's promise at that T walks it
        self.sampled_text = [float(t) for t in sorted(evaluation.sampled_answers)]
        self._val_hist = None
        self._tree_hist = {}  # eval.trees' histograms, from each validation's start
        # eval.step_costs: the chains' verify widths, greedy and sampled, and the table they were
        # priced with (on_validation_epoch_start)
        self._adaptive = self._adaptive_sampled = self._step_costs = None
        # what every checkpoint says about itself (models/checkpoint.py): method, target, run config
        self.description = description

    # ----------------------------------------------------------------- checkpoint contents
    # A frozen target is rebuilt from its source, so checkpoints hold the drafter only (and the
    # target too in joint modes); the load is strict on exactly those keys.
    def state_dict(self, *args, **kwargs):
        state = {f"drafter.{k}": v for k, v in self.drafter.state_dict().items()}
        if self.joint:
            state.update({f"target.{k}": v for k, v in self.target.model.state_dict().items()})
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        joint = getattr(self, "joint", False)
        allowed = ("drafter.", "target.") if joint else ("drafter.",)
        foreign = [k for k in state_dict if not k.startswith(allowed)]
        if foreign:
            raise KeyError(f"checkpoint has keys outside the {'drafter and target' if joint else 'drafter'}: {foreign[:5]}")
        if joint:
            target_state = {k[len("target."):]: v for k, v in state_dict.items() if k.startswith("target.")}
            if not target_state:
                raise KeyError("a joint-mode checkpoint must hold the trained target (target.* keys)")
            self.target.model.load_state_dict(target_state, strict=True, assign=assign)
        return self.drafter.load_state_dict({k[len("drafter."):]: v for k, v in state_dict.items() if k.startswith("drafter.")},
                                            strict=True, assign=assign)

    def configure_model(self):
        # trainer.strategy=fsdp (train/fsdp.py) sets a device mesh: shard the drafter's modules
        # over it; the target stays whole. No mesh (ddp, one device): nothing to do.
        if self.device_mesh is not None:
            from train.fsdp import shard_drafter

            shard_drafter(self.drafter, self.device_mesh["data_parallel"])

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # no dropout-style behaviour in the target, even when it trains
        if hasattr(self, "original"):
            self.original.eval()
        return self

    # ----------------------------------------------------------------- shared computation
    def _target_pass(self, ids):
        with torch.set_grad_enabled(self.joint and self.training):
            out = self.target(ids)
        with torch.no_grad():
            teacher, greedy = self.target.head_outputs(out.last_hidden.detach(), self.drafter.draft_ids())
        if self.joint and self.training:
            # the heads' loss reaches the target through its features (that is what joint
            # training means); the target's own terms reuse this pass
            self._target_out = out
        return out, teacher, greedy

    def _stored_pass(self, batch):
        """What `_target_pass` gives, from a feature store's batch (data/features.py collate):
        TargetOutput with the stored fields [B,T,W], teacher probs [B,T,Vd], greedy [B,T]."""
        from data.features import stored_teacher
        from models.target import TargetOutput

        dtype = self.stored_features_dtype
        out = TargetOutput(aux=batch["aux"].to(dtype) if "aux" in batch else None,
                           last_hidden=batch["last_hidden"].to(dtype) if "last_hidden" in batch else None)
        teacher = stored_teacher(batch["teacher_ids"], batch["teacher_logprobs"], self.drafter.draft_ids().numel(), dtype)
        return out, teacher, batch["greedy"]

    def _joint_losses(self, ids, loss_mask) -> dict:
        """The target's own terms in joint modes (on the pass `_target_pass` kept with grad)."""
        out = self._target_out
        terms = {}
        if self.objective.lm_weight > 0:
            terms["lm"] = lm_loss(out.last_hidden, self.target.head_weight, ids, loss_mask)
        if self.objective.keep_weight > 0:
            with torch.no_grad():
                original = self.original(ids)
            terms["keep_kl"] = keep_close_kl(out.last_hidden, original.last_hidden, self.target.head_weight,
                                             self.original.head_weight, loss_mask)
        return terms

    def _block_objective(self, ids, loss_mask, out, teacher, greedy):
        """DFlash: random anchors inside answers, every block of a row in one forward; block
        position j (1-based) predicts x_{a+1+j}, teacher at a+j, weight exp(-(j-1)/gamma).
        A drafter with `block_outputs` (DSpark) gives its teacher-forced logits with confidence
        logits [R,m,B]: each position's BCE against its draft's acceptance (train.losses.
        acceptance_targets, config.confidence_target), times config.confidence_weight, joins
        that position's loss under the same position weight."""
        features = self.drafter.features(out)
        T = ids.shape[1]
        B = self.drafter.config.block_size
        students, teachers, masks, choices, confs = ([[] for _ in range(B - 1)] for _ in range(5))
        rows, picked = [], []
        for b in range(ids.shape[0]):
            candidates = torch.nonzero(loss_mask[b, 2:]).flatten()  # a with x_{a+2} (draft 1) answer text
            if candidates.numel() == 0:
                continue
            pick = torch.randperm(candidates.numel(), device=ids.device)[: self.objective.block_anchors]
            rows.append(b)
            picked.append(candidates[pick].sort().values)
        if rows:
            # every row's blocks in one forward: rows with fewer anchors repeat their last one,
            # and the repeats are left out of the loss
            m = max(a.numel() for a in picked)
            anchors = torch.stack([torch.cat([a, a[-1:].expand(m - a.numel())]) for a in picked])  # [R,m]
            real = torch.stack([torch.arange(m, device=ids.device) < a.numel() for a in picked])  # [R,m]
            r = torch.as_tensor(rows, device=ids.device)
            outputs = getattr(self.drafter, "block_outputs", None)
            logits, conf = outputs(ids[r], features[r], anchors) if outputs is not None else \
                (self.drafter.block_logits(ids[r], features[r], anchors), None)  # [R,m,B,Vd], [R,m,B] or None
            for j in range(1, B):
                label = anchors + 1 + j  # [R,m]
                valid = (label < T) & real
                label = label.clamp_max(T - 1)
                students[j - 1].append(logits[:, :, j].flatten(0, 1))
                teachers[j - 1].append(teacher[r[:, None], label - 1].flatten(0, 1))
                masks[j - 1].append((valid & loss_mask[r[:, None], label].bool()).flatten())
                choices[j - 1].append(greedy[r[:, None], label - 1].flatten())
                if conf is not None:
                    confs[j - 1].append(conf[:, :, j].flatten())
        draft_ids = self.drafter.draft_ids()
        losses, accs, total = [], [], 0.0
        for j, w in enumerate(self.drafter.position_weights()):
            if not students[j]:
                zero = sum(p.sum() * 0 for p in self.drafter.parameters() if p.requires_grad)
                losses.append(zero)
                accs.append(torch.zeros((), device=ids.device))
                continue
            student, mask = torch.cat(students[j]), torch.cat(masks[j])
            teacher_j = torch.cat(teachers[j])
            loss = soft_kl(student, teacher_j, mask)
            if confs[j]:
                cfg = self.drafter.config
                accepted = acceptance_targets(student.detach(), teacher_j, torch.cat(choices[j]), draft_ids,
                                              cfg.confidence_target)
                loss = loss + cfg.confidence_weight * confidence_bce(torch.cat(confs[j]), accepted, mask)
            losses.append(loss)
            total = total + w * loss
            with torch.no_grad():
                hit = (draft_ids[student.argmax(-1)] == torch.cat(choices[j])) & mask
                accs.append(hit.sum().float() / mask.sum().clamp_min(1))
        return total, losses, accs

    def _objective(self, ids, loss_mask, out, teacher, greedy):
        """Per-step token loss (+ feature regression where configured) and accuracy (draft
        argmax == target's full-vocab argmax), weighted decay**step. Step s at index t drafts
        x_{t+2+s}: its teacher and feature target sit at t+1+s, its label at t+2+s."""
        if self.predictor == "block":
            return self._block_objective(ids, loss_mask, out, teacher, greedy)
        obj = self.objective
        features = self.drafter.features(out)
        if obj.feature_weight > 0:
            logits_per_step, predicted = self.drafter.unroll(ids, features, self.steps, with_features=True)
            feature_targets = self.drafter.feature_targets(out)
        else:
            logits_per_step = self.drafter.unroll(ids, features, self.steps)
        T = loss_mask.shape[1]
        draft_ids = self.drafter.draft_ids()
        if obj.token_loss == "ce":
            to_draft = torch.full((self.drafter.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
            to_draft[draft_ids] = torch.arange(draft_ids.numel(), device=ids.device)
        losses, accs, total = [], [], 0.0
        for s, logits in enumerate(logits_per_step):
            d, t, y = ttt_slices(T, s)
            mask = loss_mask[:, y].bool()
            if obj.token_loss == "ce":
                loss = hard_ce(logits[:, d], to_draft[ids[:, y]], mask)
            else:
                loss = soft_kl(logits[:, d], teacher[:, t], mask)
            loss = obj.token_weight * loss
            if obj.feature_weight > 0:
                loss = loss + obj.feature_weight * feature_smooth_l1(predicted[s][:, d], feature_targets[:, t], mask)
            losses.append(loss)
            total = total + self.step_weights[s] * loss
            with torch.no_grad():
                hit = (draft_ids[logits[:, d].argmax(-1)] == greedy[:, t]) & mask
                accs.append(hit.sum().float() / mask.sum().clamp_min(1))
        return total, losses, accs

    def training_step(self, batch, batch_idx):
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        out, teacher, greedy = self._stored_pass(batch) if "teacher_ids" in batch else self._target_pass(ids)
        total, losses, accs = self._objective(ids, loss_mask, out, teacher, greedy)
        if self.joint:
            terms = self._joint_losses(ids, loss_mask)
            total = self.objective.joint_lambda * total + self.objective.lm_weight * terms.get("lm", 0.0) \
                + self.objective.keep_weight * terms.get("keep_kl", 0.0)
            for name, value in terms.items():
                self.log(f"train/target_{name}", value)
        # logged for the loggers only: Lightning turns every prog_bar value into a number after every
        # batch (a device read, a host sync on a GPU); the progress bar reads `shown` when it
        # refreshes instead (train/callbacks.py ProgressBar)
        self.log("train/loss", total)
        self.log("train/acc0", accs[0])
        self.shown = {"loss": total.detach(), "acc0": accs[0].detach()}
        for s, (l, a) in enumerate(zip(losses, accs)):
            self.log(f"train/loss_{s}", l)
            self.log(f"train/acc_{s}", a)
        return total

    # ----------------------------------------------------------------- held-out validation
    def on_validation_epoch_start(self):
        if self.stored_features_dtype is not None:
            self.target.to(self.device)  # (back to the CPU at the validation's end)
        # [sets, 2, k+1]: chains in first answers, then in follow-up turns (inference.walks.greedy)
        self._val_hist = torch.zeros(len(self.eval_names), 2, self.evaluation.k + 1, dtype=torch.long)
        # the sampled promises: per serving temperature T > 0 and verification, expected counts
        self._sampled_settings = [(float(t), v) for t in self.evaluation.temperatures if t > 0 for v in VERIFICATIONS]
        self._sampled_hist = {s: torch.zeros(len(self.eval_names), 2, self.evaluation.k + 1, dtype=torch.float64)
                              for s in self._sampled_settings}
        # eval.step_costs: every promise again with adaptive verification, each chain verifying the
        # width the runtime picks for it at batch 1 (inference.walks.greedy.chain_widths)
        self._adaptive = self._step_costs = None
        if self.evaluation.step_costs is not None:
            from inference.runtime.adaptive import StepCosts, step_ms_tensor
            from inference.walks.greedy import chain_widths

            costs = StepCosts.load(self.evaluation.step_costs)
            step_ms = step_ms_tensor(costs, 1, self.evaluation.k, self.device)
            # greedy chains take the best-rate width, sampled ones the causal rule (as the runtime)
            self._adaptive = chain_widths(step_ms)
            self._adaptive_sampled = chain_widths(step_ms, causal=True)
            self._step_costs = costs.to_dict()  # recorded with the promise: validate checks it is the one served
            for setting in [(0.0, "adaptive")] + [(t, f"adaptive-{v}") for t, v in self._sampled_settings]:
                self._sampled_hist[setting] = torch.zeros(len(self.eval_names), 2, self.evaluation.k + 1, dtype=torch.float64)
        # drawn chains are seeded by the step: a validation repeats exactly (resume, split runs)
        rank = self.trainer.global_rank if self._trainer is not None else 0
        self._sampling_generator = torch.Generator(device=self.device).manual_seed(7919 * int(self.global_step) + rank)
        # the tree promises (eval.trees): per tree [sets, 2, depth+1], as the chains' histogram
        from inference.walks.tree import canonical_tree

        self._tree_hist = {canonical_tree(t): torch.zeros(len(self.eval_names), 2, t[0] + 1, dtype=torch.long)
                           for t in self.evaluation.trees}
        # seconds each part of this walk took (predicted.json's walk_seconds): a final walk that
        # outlasts its training says where its time went
        self.walk_seconds = {"greedy": 0.0, "sampled": 0.0, "trees": 0.0}

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
        t0 = self._now()
        if dataloader_idx >= len(self.eval_names):  # answers sampled at T: the first set's promise at T only
            temperature = self.sampled_text[dataloader_idx - len(self.eval_names)]
            with torch.no_grad():
                out = self.target(ids)
            capped = cap_answer_spans(loss_mask, self.evaluation.max_new_tokens)
            for verification in VERIFICATIONS:
                for width, prefix in self._verify_widths():
                    self._sampled_hist[temperature, prefix + verification][0] += sampled_histogram(
                        self.target, self.drafter, ids, capped, lengths, self.evaluation.k,
                        self.evaluation.anchors_per_sequence, temperature, verification, self._sampling_generator,
                        features=self.drafter.features(out), last_hidden=out.last_hidden, per_turn=True,
                        verify_width=width)
            self.walk_seconds["sampled"] += self._now() - t0
            return
        out, teacher, greedy = self._target_pass(ids)
        total, losses, accs = self._objective(ids, loss_mask, out, teacher, greedy)
        # the promise's walks see each answer as served: cut at the serving budget (eval.max_new_tokens)
        loss_mask = cap_answer_spans(loss_mask, self.evaluation.max_new_tokens)
        # set j > 0 logs as `_set{j}`, as val/tau does (Lightning's own dataloader suffix would
        # rename set 0's keys whenever another loader, such as eval.sampled_answers', is added)
        suffix = "" if dataloader_idx == 0 else f"_set{dataloader_idx}"
        self.log(f"val/loss{suffix}", total, prog_bar=dataloader_idx == 0, batch_size=ids.shape[0], add_dataloader_idx=False)
        for s, (l, a) in enumerate(zip(losses, accs)):
            self.log(f"val/loss_{s}{suffix}", l, batch_size=ids.shape[0], add_dataloader_idx=False)
            self.log(f"val/acc_{s}{suffix}", a, batch_size=ids.shape[0], add_dataloader_idx=False)
        self._val_hist[dataloader_idx] += self.predicted_histogram(ids, loss_mask, lengths, self.drafter.features(out),
                                                                   greedy, per_turn=True)
        if self._adaptive is not None:
            self._sampled_hist[0.0, "adaptive"][dataloader_idx] += predicted_histogram(
                self.target, self.drafter, ids, loss_mask, lengths, self.evaluation.k, self.evaluation.anchors_per_sequence,
                features=self.drafter.features(out), greedy=greedy, per_turn=True, verify_width=self._adaptive).double()
        t1 = self._now()
        self.walk_seconds["greedy"] += t1 - t0
        for temperature, verification in self._sampled_settings:
            if temperature in self.sampled_text:
                # set 0 walks the answers sampled at T instead; the other sets have none, and a
                # walk of their greedy text at T promises what serving at T does not see
                continue
            for width, prefix in self._verify_widths():
                self._sampled_hist[temperature, prefix + verification][dataloader_idx] += sampled_histogram(
                    self.target, self.drafter, ids, loss_mask, lengths, self.evaluation.k,
                    self.evaluation.anchors_per_sequence, temperature, verification, self._sampling_generator,
                    features=self.drafter.features(out), last_hidden=out.last_hidden, per_turn=True, verify_width=width)
        t2 = self._now()
        self.walk_seconds["sampled"] += t2 - t1
        if self._tree_hist:
            from inference.walks.tree import predicted_tree_histograms

            found = predicted_tree_histograms(self.target, self.drafter, ids, loss_mask, lengths, list(self._tree_hist),
                                              self.evaluation.anchors_per_sequence, features=self.drafter.features(out),
                                              greedy=greedy, per_turn=True)
            for tree, h in found.items():
                self._tree_hist[tree][dataloader_idx] += h
            self.walk_seconds["trees"] += self._now() - t2

    def _verify_widths(self) -> list:
        """(verify_width, verification prefix) of each promise a sampled walk makes: fixed k, and
        adaptive verification's where eval.step_costs is set."""
        return [(None, "")] + ([(self._adaptive_sampled, "adaptive-")] if self._adaptive is not None else [])

    def predicted_histogram(self, ids, loss_mask, lengths, features, greedy, per_turn: bool = False) -> torch.Tensor:
        """Greedy k-chains drafted as the runtime drafts (inference.walks.greedy)."""
        return predicted_histogram(self.target, self.drafter, ids, loss_mask, lengths, self.evaluation.k,
                                   self.evaluation.anchors_per_sequence, features=features, greedy=greedy, per_turn=per_turn)

    def on_validation_epoch_end(self):
        if self.stored_features_dtype is not None:
            self.target.to("cpu")
        hist = self._reduced(self._val_hist)
        sampled = {setting: self._reduced(h) for setting, h in self._sampled_hist.items()}
        trees = {tree: self._reduced(h) for tree, h in self._tree_hist.items()}
        per_set = [self._heldout(hist[j], {s: h[j] for s, h in sampled.items()}, {t: h[j] for t, h in trees.items()})
                   for j in range(len(self.eval_names))]
        self.predicted = Prediction(per_set[0], dataset=self.eval_names[0], k=self.evaluation.k, step=int(self.global_step),
                                    also=dict(zip(self.eval_names[1:], per_set[1:])), step_costs=self._step_costs)
        for j, held in enumerate(per_set):
            suffix = "" if j == 0 else f"_set{j}"  # set j = eval.datasets[j]
            self.log(f"val/tau{suffix}", held.greedy.tau, prog_bar=j == 0, sync_dist=False)
            for i, a in enumerate(held.greedy.a, 1):
                self.log(f"val/a_{i}{suffix}", a, sync_dist=False)
            for promise in held.sampled:
                self.log(f"val/tau_{setting_key(promise.temperature, promise.verification)}{suffix}", promise.acceptance.tau,
                         sync_dist=False)
            for tree in held.trees:
                self.log(f"val/tau_tree_{'_'.join(map(str, tree.shape))}{suffix}", tree.acceptance.tau,
                         sync_dist=False)

    @staticmethod
    def _heldout(hist, sampled: dict, trees: dict) -> HeldoutPrediction:
        """One held-out set's prediction from its per-turn histograms [2, k+1] (first answers,
        follow-up turns): greedy chains, sampled ones per (T, verification), trees per shape."""
        # (a set not walked at T, beside answers sampled at T for the first set, has no promise there)
        promises = tuple(Promise(t, v, Acceptance.by_turn(h, with_error=True)) for (t, v), h in sampled.items() if h.sum() > 0)
        if not trees:
            return HeldoutPrediction(Acceptance.by_turn(hist), promises)
        from inference.walks.tree import tree_promises

        return HeldoutPrediction(Acceptance.by_turn(hist), promises, tree_promises(trees))

    def _reduced(self, hist: torch.Tensor) -> torch.Tensor:
        """A histogram summed over ranks, on the CPU."""
        hist = hist.to(self.device)
        if self.trainer.world_size > 1:
            hist = self.trainer.strategy.reduce(hist, reduce_op="sum")
        return hist.cpu()

    # ----------------------------------------------------------------- time-boxed schedule
    def time_fraction(self) -> float:
        """Share of trainer.max_time spent training so far (0 unless optim.schedule_by=time)."""
        if not self.time_budget_s or self._clock is None:
            return 0.0
        return (self._seconds_before + time.monotonic() - self._clock) / self.time_budget_s

    def on_train_start(self):
        self._clock = time.monotonic()

    def on_save_checkpoint(self, checkpoint):
        # every save (step, last, interrupted) goes through here; a module built without a
        # description (unit tests, profiling) writes checkpoints that export refuses, saying why
        if getattr(self, "description", None) is not None:
            from models.checkpoint import SECTION, section_for_save

            current = self.predicted if self.predicted and self.predicted.step == self.global_step else None
            checkpoint[SECTION] = section_for_save(self.description, self.drafter, current)
        if self._clock is not None:
            checkpoint["draftsmith_train_seconds"] = self._seconds_before + time.monotonic() - self._clock

    def on_load_checkpoint(self, checkpoint):
        self._seconds_before = float(checkpoint.get("draftsmith_train_seconds", 0.0))

    # ----------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        groups = [{"params": [p for p in self.drafter.parameters() if p.requires_grad], "lr": self.optim.lr}]
        if self.joint:  # the target moves at its own, smaller learning rate
            groups.append({"params": [p for p in self.target.parameters() if p.requires_grad], "lr": self.optim.target_lr})
        opt = torch.optim.AdamW(groups, lr=self.optim.lr, weight_decay=self.optim.weight_decay, betas=tuple(self.optim.betas))
        warmup, total, floor = self.optim.warmup_steps, max(self.schedule_steps, 1), self.optim.min_lr_ratio

        def schedule(step):
            return lr_factor(step, warmup, total, floor, self.time_fraction())

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
