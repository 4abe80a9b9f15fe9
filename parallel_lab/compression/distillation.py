"""Knowledge distillation: a small student trained on a large teacher's softened predictions.

Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network". The teacher's
probabilities over every token say more than the one correct label (which wrong answers are
nearly right); a temperature T > 1 softens them so that those small probabilities carry weight.
The student minimises

    alpha * T² * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

where T² keeps the soft term's gradient on the same scale as the hard term's when T changes
(section 2 of the paper).

Invariant: `distillation_loss` equals that formula computed by hand (test), and at alpha = 0 it is
plain cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.compression.task import Corpus, train_lm

__all__ = ["distill", "distillation_loss"]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 2.0, alpha: float = 0.5) -> torch.Tensor:  # fmt: skip
    """Hinton et al.'s loss on (N, V) logits and (N,) labels; the KL term is averaged over the N rows."""
    if temperature <= 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"temperature must be > 0 and alpha in [0, 1], got {temperature} and {alpha}")
    T = temperature
    log_p_student = F.log_softmax(student_logits / T, dim=-1)  # (N, V)
    log_p_teacher = F.log_softmax(teacher_logits / T, dim=-1)
    soft = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean") * T * T
    hard = F.cross_entropy(student_logits, targets)
    return alpha * soft + (1 - alpha) * hard


def distill(student: nn.Module, teacher: nn.Module, corpus: Corpus, steps: int = 300, temperature: float = 2.0,
            alpha: float = 0.5, **train_kw) -> list[float]:  # fmt: skip
    """Train `student` on the corpus with the teacher's logits as soft targets (the teacher is frozen)."""
    teacher.eval()

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = teacher(x).flatten(0, 1)  # (B*T, V)
        return distillation_loss(model(x).flatten(0, 1), t, y.flatten(), temperature, alpha)

    return train_lm(student, corpus, steps, loss_fn=loss_fn, **train_kw)
