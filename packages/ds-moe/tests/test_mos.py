"""Mixture-of-Students: the KD loss, its weights and temperature, and staged distillation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_moe
from ds_comm import ConfigError
from ds_moe import MixtureOfStudents, MoSConfig


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_loss_is_scaled_kl_per_token(temperature: float) -> None:
    student, teacher = _logits(0), _logits(1)
    p = F.softmax(teacher / temperature, dim=-1)
    q = F.softmax(student / temperature, dim=-1)
    kl_per_token = (p * (p.log() - q.log())).sum(-1)
    expected = temperature**2 * kl_per_token.mean()
    torch.testing.assert_close(ds_moe.kd_loss(student, teacher, temperature), expected)
    assert ds_moe.kd_loss(teacher, teacher, temperature).abs().item() < 1e-6


def test_loss_weights_task_and_kd_then_stops() -> None:
    teacher = nn.Linear(4, 7)
    config = MoSConfig(kd_alpha_ce=0.5, kd_beta_ce=2.0, kd_temp=1.5, kd_stop_step=10)
    mos = MixtureOfStudents(teacher, config)
    student, task = _logits(2), torch.tensor(3.0)
    teacher_logits = _logits(3)
    kd = ds_moe.kd_loss(student, teacher_logits, 1.5)
    torch.testing.assert_close(mos.loss(9, student, task, teacher_logits), 0.5 * task + 2.0 * kd)
    assert mos.distilling(9) and not mos.distilling(10)
    assert mos.loss(10, student, task) is task  # staged: the teacher is no longer needed


def test_teacher_is_frozen_and_gives_logits_without_graph() -> None:
    teacher = nn.Sequential(nn.Linear(4, 7), nn.Dropout(0.5))
    mos = MixtureOfStudents(teacher)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    x = torch.randn(3, 4)
    out = mos.teacher_logits(x)
    assert not out.requires_grad and torch.equal(out, mos.teacher_logits(x))  # no dropout


def test_student_learns_from_teacher_logits() -> None:
    torch.manual_seed(0)
    teacher, student = nn.Linear(4, 5), nn.Linear(4, 5)
    mos = MixtureOfStudents(teacher, MoSConfig(kd_alpha_ce=0.0))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.5)
    x = torch.randn(64, 4)
    losses = []
    for step in range(30):
        logits = student(x)
        loss = mos.loss(step, logits, torch.zeros(()), mos.teacher_logits(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_distilling_step_needs_teacher_logits() -> None:
    mos = MixtureOfStudents(nn.Linear(2, 2), MoSConfig(kd_stop_step=5))
    with pytest.raises(ValueError, match="step 4 distils"):
        mos.loss(4, _logits(0), torch.tensor(1.0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kd_temp": 0.0}, r"mos\.kd_temp = 0\.0: expected a finite number > 0"),
        ({"kd_beta_ce": -1.0}, r"mos\.kd_beta_ce = -1\.0: expected a finite number >= 0"),
        ({"kd_stop_step": -2}, r"mos\.kd_stop_step = -2: expected None"),
    ],
)
def test_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoSConfig(**kwargs)
