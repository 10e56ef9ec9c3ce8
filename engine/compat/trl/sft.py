"""``SFTTrainer`` / ``SFTConfig``: TRL's, trained through the Trainer door.

TRL's ``compute_loss`` divides the micro-batch's summed token losses by its own tokens (or by
transformers' ``num_items_in_batch``) and adds the routers' term divided by the accumulation steps;
neither is the engine's to read. While training, this ``SFTTrainer`` returns the same objective as
``(sum, count)``: the summed negative log-likelihood of the labelled tokens (TRL's fused head;
``loss_type`` ``nll``, its alias ``chunked_nll``, or ``dft``) plus λ times the model's load-balancing
term, and the labelled tokens; the engine divides by the window's tokens over every rank and makes the
term the global batch's (a Mixtral's ``load_balancing_loss_func``, which TRL's fused head calls).
Evaluation is TRL's.
The entropy and token accuracy TRL logs are this rank's, without its per-micro-batch gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import trl

from engine.compat.transformers.arguments import TrainingArguments
from engine.compat.transformers.trainer import EngineModel, Trainer


@dataclass
class SFTConfig(trl.SFTConfig, TrainingArguments):
    """TRL's ``SFTConfig`` with the door's ``microstep`` field; ``deepspeed`` is read by Microstep."""


class SFTTrainer(trl.SFTTrainer, Trainer):
    """TRL's ``SFTTrainer`` (same signature), its optimizer steps Microstep windows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not isinstance(model, EngineModel):  # evaluation and prediction: TRL's own
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = {**inputs, "use_cache": False}
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        outputs = model(**inputs, fused_lm_head=True)
        per_token = -outputs.log_probs  # zero where the label is -100
        if self.args.loss_type == "dft":
            per_token = per_token * outputs.log_probs.exp().detach()
        total = per_token.sum()
        if self.aux_loss_enabled:
            total = total + self.router_aux_loss_coef * outputs.aux_loss
        if torch.is_grad_enabled():  # the training forward, not the engine's counting one
            self._record_metrics(outputs, inputs)
        return total, outputs.label_mask.sum()

    def _record_metrics(self, outputs, inputs) -> None:
        """TRL's training metrics on this rank's micro-batch."""
        metrics = self._metrics["train"]
        labelled = outputs.label_mask.sum()
        if labelled > 0:
            metrics["entropy"].append((outputs.entropy.detach().sum() / labelled).item())
            metrics["mean_token_accuracy"].append((outputs.is_top1.sum() / labelled).item())
        mask = inputs.get("attention_mask")
        self._total_train_tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        metrics["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            metrics["aux_loss"].append(outputs.aux_loss.detach().item())
