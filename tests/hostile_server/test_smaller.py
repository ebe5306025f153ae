"""Issue 40's smaller defects, each reproduced first: the export of an `ffa` LoRA run (its frozen A
matrices are not federated tensors), non-finite values in error feedback, and where secret-mode noise
comes from (a cryptographically secure generator, fedsilo.privacy.noise)."""
import math

import numpy as np
import opacus.optimizers.optimizer as opacus_optimizer
import opacus.optimizers.optimizer_fast_gradient_clipping as opacus_fast
import pytest
import torch

from fedsilo.cli import main
from fedsilo.client.private import PrivateSGD
from fedsilo.client.settings import DPSettings
from fedsilo.core.compression import CompressionSettings, Int8Settings, TopkSettings
from fedsilo.core.transforms import UPLOAD_TRANSFORMS, SiloRefused, TransformContext
from fedsilo.privacy.accountant import Budget
from fedsilo.privacy.noise import SecretNormal
from fedsilo.privacy.silo_dp import SiloDP, SiloRelease
from fedsilo.runs.runner import run_experiment
from tests.hostile_server.driver import ScriptedServer, toy_raw
from tests.test_lora import _scores_match, lora_config
from tests.test_plugins import toy_config


def test_an_ffa_run_exports_adapters_that_load_in_peft_and_score_as_the_run(tmp_path, capsys):
    """peft raised NoMatchingPeftModuleError: the export took its target modules from the federated
    tensors, and under ffa these hold no lora_A (A is frozen at its seeded start)."""
    run_experiment(lora_config("ffa"), tmp_path / "run", show_progress=False)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    assert "adapters:" in capsys.readouterr().out
    ours, theirs, plain = _scores_match(tmp_path / "run", tmp_path / "adapter")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    assert float((ours - plain).abs().max()) > 1e-4  # the adapters change the scores: the check can fail


# ---- non-finite values and error feedback ----------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "fp16", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_update_is_refused_before_coding_and_the_residual_stays_finite(codec, bad):
    options = {"int8": Int8Settings(), "fp16": CompressionSettings(), "topk": TopkSettings(fraction=0.5)}[codec]
    transform = UPLOAD_TRANSFORMS.get(codec)
    reference = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(5)}
    state: dict = {}
    good = {"a.weight": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "b.bias": torch.ones(5) / 3}
    transform.encode(good, TransformContext(1, "alpha", reference, state=state), options)
    kept = {k: v.clone() for k, v in state.items()}
    poisoned = {**good, "b.bias": good["b.bias"].clone()}
    poisoned["b.bias"][2] = bad
    with pytest.raises(SiloRefused, match=r"'b\.bias'.*(NaN|Inf)"):
        transform.encode(poisoned, TransformContext(2, "alpha", reference, state=state), options)
    assert state.keys() == kept.keys() and all(torch.equal(state[k], kept[k]) for k in kept)  # untouched
    wire, _ = transform.encode(good, TransformContext(3, "alpha", reference, state=state), options)
    assert all(bool(torch.isfinite(t.float()).all()) for t in wire.values())
    assert all(bool(torch.isfinite(t).all()) for t in state.values())


def test_an_update_that_overflows_with_its_residual_is_refused_too():
    """Finite Δ and finite residual whose sum is Inf in float32: refused, never stored."""
    transform = UPLOAD_TRANSFORMS.get("int8")
    state = {"w": torch.full((3,), 3e38)}
    with pytest.raises(SiloRefused, match="'w'"):
        transform.encode({"w": torch.full((3,), 3e38)}, TransformContext(1, "alpha", {"w": torch.zeros(3)},
                                                                          state=state), Int8Settings())
    assert torch.equal(state["w"], torch.full((3,), 3e38))


def test_one_nan_round_no_longer_poisons_every_later_round_of_the_silo(tmp_path):
    """A server sends one NaN; today the silo's int8 error feedback kept it, and every later round's
    update carried NaN scales (so the server rejected the silo for good)."""
    server = ScriptedServer(toy_raw(exchange={"upload_transforms": [{"name": "int8"}]}), "alpha", tmp_path)
    honest = server.global_params()
    poisoned = dict(honest)
    name = sorted(poisoned)[0]
    poisoned[name] = poisoned[name].clone()
    poisoned[name].view(-1)[0] = float("nan")
    update, refused = server.train(1, poisoned)
    assert update is None and "NaN" in refused[0] and "'" in refused[0], refused  # names the tensor
    for round_idx in (2, 3):
        update, refused = server.train(round_idx, honest)
        assert refused is None
        assert all(bool(torch.isfinite(t.float()).all()) for t in update.tensors.values()), round_idx


# ---- where secret noise comes from ----------------------------------------------------------------

def test_secret_noise_is_standard_normal_over_a_million_draws():
    n = 1_000_000
    z = SecretNormal().standard(n)
    assert z.shape == (n,) and z.dtype == torch.float64
    z = z.numpy()
    assert np.isfinite(z).all()
    assert abs(z.mean()) < 5 / math.sqrt(n)                       # 5 standard errors
    assert abs(z.std() - 1) < 5 / math.sqrt(2 * n)                # the sample std's standard error: 1/√(2n)
    tail = float(np.mean(np.abs(z) > 1.959964))
    assert abs(tail - 0.05) < 5 * math.sqrt(0.05 * 0.95 / n)      # the shape, not only two moments
    half = n // 2                                                  # Box–Muller's cos and sin halves: independent
    assert abs(np.corrcoef(z[:half], z[half:])[0, 1]) < 5 / math.sqrt(half)
    scaled = SecretNormal().normal(2.5, (1000, 300))
    assert scaled.shape == (1000, 300) and scaled.dtype == torch.float64
    assert abs(float(scaled.std()) - 2.5) < 2.5 * 5 / math.sqrt(2 * scaled.numel())
    source = SecretNormal()
    assert not torch.equal(source.standard(7), source.standard(7))          # two draws differ
    assert not torch.equal(SecretNormal().standard(7), SecretNormal().standard(7))  # two keys differ
    assert SecretNormal().standard(2 * 2**19 + 3).isfinite().all()          # more than one keystream read, odd


def _refuse(*args, **kwargs):
    raise AssertionError("secret noise drawn from torch's generator")


def _refuse_opacus_draws(monkeypatch):
    """Opacus's noise (torch draws from the generator it is given) raises from now on."""
    for module in (opacus_optimizer, opacus_fast):
        monkeypatch.setattr(module, "_generate_noise", _refuse)


def _refuse_torch_draws(monkeypatch):
    """torch's Gaussian draws (and Opacus's noise, made of them) raise from now on."""
    for name in ("normal", "randn", "randn_like"):
        monkeypatch.setattr(torch, name, _refuse)
    monkeypatch.setattr(torch.Tensor, "normal_", _refuse)
    _refuse_opacus_draws(monkeypatch)


def test_silo_level_secret_noise_does_not_come_from_torchs_generator(monkeypatch):
    dp = SiloDP(central=True, clip=1.0, noise_multiplier=1.0, budget=Budget(1.0, 1.0, 1e-5))
    release = SiloRelease(clip=10.0, std=0.5, seeded=False)
    seeded = SiloRelease(clip=10.0, std=0.5, seeded=True)
    _refuse_torch_draws(monkeypatch)
    out, _ = dp.privatise({"w": torch.zeros(2000)}, {"a": 1.0}, {"a": 1.0, "b": 1.0}, 1)
    assert 0.4 < float(out["w"].std()) < 0.6  # σ·C·w_max / W = 0.5
    sent = release({"w": torch.ones(2000)}, {"w": torch.zeros(2000)}, run_seed=0)
    assert 0.4 < float((sent["w"] - 1).std()) < 0.6
    with pytest.raises(AssertionError, match="torch's generator"):  # seeded noise stays torch's (reproducible)
        seeded({"w": torch.ones(20)}, {"w": torch.zeros(20)}, run_seed=0)


@pytest.mark.parametrize("clipping", ["loop", "auto"])
def test_dp_sgd_secret_noise_does_not_come_from_torchs_generator(tmp_path, monkeypatch, clipping):
    _refuse_opacus_draws(monkeypatch)  # a model's init draws from torch: only the noise is refused here
    dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "clipping": clipping}
    run_experiment(toy_config(client={"dp": dp}, federation={"rounds": 1}), tmp_path / "secret", show_progress=False)
    with pytest.raises(AssertionError, match="torch's generator"):  # seeded: Opacus's draws, as always
        run_experiment(toy_config(client={"dp": {**dp, "noise": "seeded"}}, federation={"rounds": 1}),
                       tmp_path / "seeded", show_progress=False)


@pytest.mark.parametrize("rows", [1, 2])
def test_dp_sgd_secret_noise_has_standard_deviation_sigma_times_c_over_the_expected_batch(rows):
    """The secret source replaces Opacus's draws at the same scale: an empty Poisson sample's step is
    N(0, σ²C²) per coordinate / expected batch, as with the seeded generator (tests/test_privacy_dp.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 200))
    params = [p for p in model.parameters() if p.requires_grad]
    sigma, c, batch = 2.0, 0.5, 8
    dp = PrivateSGD(model, torch.optim.SGD(params, lr=0.1), Budget(sigma, 0.1, 1e-5),
                    DPSettings(noise_multiplier=sigma, max_grad_norm=c), rows, batch, SecretNormal())
    try:
        dp.empty()
        dp.optimizer.pre_step()
        noise = torch.cat([p.grad.flatten() for p in params]).double() * batch
    finally:
        dp.close()
    n = noise.numel()
    assert all(p.grad.dtype == torch.float32 for p in params)  # drawn in float64, rounded to the gradient's
    assert abs(noise.std().item() - sigma * c) < 5 * sigma * c / math.sqrt(2 * n)
    assert abs(noise.mean().item()) < 5 * sigma * c / math.sqrt(n)
