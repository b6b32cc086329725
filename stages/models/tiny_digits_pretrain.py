"""Pretrain tiny-digits: the two digit classifiers and the text-to-image generator.

Reproduces the weights shipped in ``stages/models/weights/tiny-digits`` with::

    solrl pretrain-tiny-digits --steps 170 --out stages/models/weights/tiny-digits

(deterministic on one machine, torch version and thread count, which the report records with the CPU; under a
minute on 2 cores). The generator is trained with the rectified-flow objective
(Liu et al. 2022; Esser et al. 2024, eq. 1 and the logit-normal timestep
density of section 3.1): ``x_t = (1 - t) x0 + t eps``, loss
``||v_theta(x_t, t) - (eps - x0)||^2``, ``t = sigmoid(n), n ~ N(0, 1)``.
The step count sets how much room RL has: 170 steps (the shipped weights) leave the held-out
alignment well below the classifier's ceiling (DESIGN 5).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from solrl.stages.models import tiny_digits as td
from solrl.stages.sampling.samplers import derive_seed, initial_noise, sample_ode

TEMPLATES = ("a handwritten digit {}", "the digit {}", "a hand drawn {}", "number {}", "{}")


def _shift(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random +-1 pixel translation (augmentation), per batch."""
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=g))
    return torch.roll(x, shifts=(dy, dx), dims=(-2, -1))


def train_classifier(model: torch.nn.Module, seed: int, epochs: int = 20) -> tuple[torch.nn.Module, float]:
    """Train a digit classifier on the training split; returns it (eval mode) and held-out accuracy."""
    x_tr, y_tr, x_te, y_te = (torch.from_numpy(a) for a in td.load_digits_16())
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(x_tr), generator=g)
        for i in range(0, len(order), 64):
            idx = order[i : i + 64]
            loss = F.cross_entropy(model(_shift(x_tr[idx], g)), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x_te).argmax(-1) == y_te).float().mean().item()
    return model, acc


def train_generator(steps: int, seed: int, batch_size: int = 128) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Rectified-flow pretraining of the tiny Sana transformer and the text encoder, jointly."""
    torch.manual_seed(seed)
    x_tr, y_tr, _, _ = td.load_digits_16()
    x_tr, y_tr = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    transformer, text = td.build_transformer(), td.TinyTextEncoder()
    params = [*transformer.parameters(), *text.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, len(x_tr), (batch_size,), generator=g)
        x0 = x_tr[idx]  # [B, 1, 16, 16]
        templates = torch.randint(0, len(TEMPLATES), (batch_size,), generator=g)
        prompts = [TEMPLATES[int(t)].format(td.DIGIT_WORDS[int(y)]) for t, y in zip(templates, y_tr[idx])]
        ids, mask = td.tokenize(prompts)
        t = torch.sigmoid(torch.randn(batch_size, generator=g))  # logit-normal, [B]
        eps = torch.randn(x0.shape, generator=g)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        v = transformer(
            hidden_states=xt,
            encoder_hidden_states=text(ids),
            timestep=t * 1000,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  generator step {step:4d}/{steps}  loss {loss.item():.4f}", flush=True)
    return transformer.eval(), text.eval()


@torch.no_grad()
def generator_alignment(
    transformer: torch.nn.Module,
    text: torch.nn.Module,
    classifier: torch.nn.Module,
    seeds_per_digit: int = 8,
    steps: int = 10,
    shift: float = 2.0,
) -> float:
    """Mean classifier p(prompted digit) over 'a handwritten digit <d>' x fixed seeds, Euler ODE."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    prompts = [f"a handwritten digit {w}" for w in td.DIGIT_WORDS for _ in range(seeds_per_digit)]
    seeds = [derive_seed(0, "eval", i) for i in range(len(prompts))]
    ids, mask = td.tokenize(prompts)
    emb = text(ids)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return transformer(
            hidden_states=x,
            encoder_hidden_states=emb,
            timestep=sigma * 1000,
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]

    x0 = sample_ode(velocity, initial_noise(seeds, (1, td.IMAGE_SIZE, td.IMAGE_SIZE)), sched.sigmas.float())
    images = td.latents_to_images(x0)
    probs = classifier(td.images_to_model_input(images)).softmax(-1)
    target = torch.tensor([td.prompt_digit(p) for p in prompts])
    return probs[torch.arange(len(prompts)), target].mean().item()


def _cpu_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else the machine type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def pretrain(out: Path, steps: int = 170, seed: int = 0) -> dict[str, float]:
    """Train and save everything tiny-digits needs into ``out``; returns the measured figures."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(seed)
    classifier, acc = train_classifier(td.DigitClassifier(), seed=seed)
    print(f"classifier (training reward): held-out accuracy {acc:.4f}", flush=True)
    torch.manual_seed(seed + 1)
    evaluator, eval_acc = train_classifier(td.DigitEvaluator(), seed=seed + 1)
    print(f"evaluator (independent):      held-out accuracy {eval_acc:.4f}", flush=True)
    transformer, text = train_generator(steps, seed)
    align = generator_alignment(transformer, text, classifier)
    align_eval = generator_alignment(transformer, text, evaluator)
    print(f"generator after {steps} steps: alignment {align:.4f} (classifier), {align_eval:.4f} (evaluator)")
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    save_file({k: v.contiguous() for k, v in text.state_dict().items()}, out / "text_encoder.safetensors")
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, out / "classifier.safetensors")
    save_file({k: v.contiguous() for k, v in evaluator.state_dict().items()}, out / "evaluator.safetensors")
    report = {
        "steps": steps,
        "seed": seed,
        "classifier_accuracy": acc,
        "evaluator_accuracy": eval_acc,
        "alignment_classifier": align,
        "alignment_evaluator": align_eval,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),  # a CPU GEMM's sums, hence the weights' last bits, depend on it
        "cpu": _cpu_name(),  # and on the CPU's kernels
        "seconds": round(time.time() - t0, 1),
    }
    (out / "pretrain_report.json").write_text(json.dumps(report, indent=2) + "\n")
    np.set_printoptions(precision=4)
    print(f"wrote {out} in {report['seconds']} s")
    return report
