"""Mixture-of-Students: staged knowledge distillation of an MoE teacher into a smaller student.

[Note: staged distillation]
DeepSpeed-MoE (Rajbhandari et al., 2022) distils a PR-MoE teacher into a shallower PR-MoE
student ("Mixture-of-Students"). Distilling for the whole run hurts the student late in
training, when it lacks the capacity to match the teacher and the KD term fights its own task
loss, so KD is stopped part-way (staged KD) and the student continues on its task loss alone.
The loss follows Megatron-DeepSpeed's ``--kd-alpha-ce/--kd-beta-ce/--kd-temp``:
``alpha * task + beta * T^2 * KL(softmax(teacher / T) || softmax(student / T))``, the KL averaged
over tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_moe.api import MoSConfig

__all__ = ["MixtureOfStudents", "kd_loss"]


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` over the last dim, averaged over all other positions.

    Example:
        >>> kd_loss(torch.zeros(2, 5), torch.zeros(2, 5)).item()
        0.0
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"kd_loss: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape"
        )
    vocab = student_logits.size(-1)
    student = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(student, teacher, reduction="batchmean", log_target=True)
    return kl * temperature**2


class MixtureOfStudents:
    """Distils a frozen teacher into a student until ``config.kd_stop_step``.

    The teacher is put in eval mode with gradients off; the student is trained by the caller.

    Args:
        teacher: the trained (MoE) teacher; its forward returns logits, or a tuple starting
            with them.
        config: loss weights, temperature and the step at which distillation stops.

    Example:
        >>> mos = MixtureOfStudents(teacher, MoSConfig(kd_beta_ce=1.0, kd_stop_step=1000))
        >>> logits, l_aux = student(tokens)
        >>> task = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        >>> loss = mos.loss(step, logits, task, mos.teacher_logits(tokens)) + 0.01 * l_aux
    """

    def __init__(self, teacher: nn.Module, config: MoSConfig | None = None) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.config = config or MoSConfig()

    def distilling(self, step: int) -> bool:
        """Whether step ``step`` still distils; see [Note: staged distillation]."""
        stop = self.config.kd_stop_step
        return stop is None or step < stop

    @torch.no_grad()
    def teacher_logits(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """The teacher's logits for ``inputs`` (no autograd graph)."""
        out = self.teacher(*inputs, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def loss(
        self,
        step: int,
        student_logits: torch.Tensor,
        task_loss: torch.Tensor,
        teacher_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The student's loss at ``step``: weighted task + KD loss, then the task loss alone.

        Args:
            step: the training step (0-based).
            student_logits: the student's logits.
            task_loss: the student's own loss (e.g. cross-entropy on labels).
            teacher_logits: the teacher's logits for the same inputs; needed while distilling.
        """
        if not self.distilling(step):
            return task_loss
        if teacher_logits is None:
            raise ValueError(
                f"step {step} distils (kd_stop_step={self.config.kd_stop_step}): pass the "
                "teacher's logits, e.g. mos.teacher_logits(inputs)"
            )
        kd = kd_loss(student_logits, teacher_logits, self.config.kd_temp)
        return self.config.kd_alpha_ce * task_loss + self.config.kd_beta_ce * kd
