"""Where DP noise comes from. Secret noise (`noise = "secret"`: no one can remove it) must come from a
cryptographically secure generator: torch's Mersenne Twister, even seeded from os.urandom, is not one
(624 outputs give away its whole state, and with it every later draw, hence the noise).

`SecretNormal`: an AES-256-CTR keystream under a fresh os.urandom(32) key (the PRG of
fedsilo.privacy.secagg's `add_prg`, on `cryptography`), read as 64-bit words; each pair of words gives
two uniforms on 53 bits, u₁ ∈ (0, 1] and u₂ ∈ [0, 1), and Box–Muller in float64 turns them into two
independent N(0, 1) draws, √(−2 ln u₁)·(cos 2πu₂, sin 2πu₂). AES-CTR under a secret random key is
indistinguishable from random bytes (the PRF assumption AES is used under everywhere), so the draws
are as good as those of a true random source, and nothing of one draw tells anything of another.
Box–Muller is exact for exact uniforms; with 53-bit uniforms the tail is cut at √(−2 ln 2⁻⁵³) ≈ 8.57σ
(a probability of ~1e-17 per draw). The noise is drawn and added in float64 and the noised value then
rounded to the tensor's dtype (float32): the gaps between float64 draws, which floating-point attacks
on DP samplers read (Mironov 2012; Jin et al. 2022), are ~2⁻²⁹ of float32's own spacing.

`SeededNormal`: torch's generator from a seed, reproducible (`noise = "seeded"`, for tests and
comparisons; removable by whoever knows the seed), exactly the draws fedsilo always made.
"""
from __future__ import annotations

import math
import os

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_PAIRS = 1 << 19  # pairs of normals made per keystream read (8 MiB of keystream)
_ZEROS = bytes(16 * _PAIRS)
_LOW_53 = (1 << 53) - 1
_TWO_53 = 2.0 ** -53


class SecretNormal:
    """N(0, std²) draws from AES-256-CTR under a key from os.urandom(32), by Box–Muller in float64."""

    def __init__(self) -> None:
        self._stream = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
        self._buffer = bytearray(16 * _PAIRS + 16)  # update_into wants a block's slack

    def standard(self, n: int) -> torch.Tensor:
        """n independent N(0, 1) draws, a float64 tensor (torch's vectorised log, sqrt, cos and sin)."""
        out = torch.empty(n, dtype=torch.float64)
        for start in range(0, n, 2 * _PAIRS):
            m = min(2 * _PAIRS, n - start)
            pairs = (m + 1) // 2
            self._stream.update_into(_ZEROS[:16 * pairs], self._buffer)
            words = torch.frombuffer(self._buffer, dtype=torch.int64, count=2 * pairs)
            u = ((words >> 11) & _LOW_53).double().mul_(_TWO_53)  # the top 53 bits of each word, in [0, 1)
            radius = u[:pairs].add_(_TWO_53).log_().mul_(-2.0).sqrt_()  # u₁ ∈ (0, 1]: log never sees 0
            angle = u[pairs:].mul_(2.0 * math.pi)
            cos, sin = out[start:start + pairs], out[start + pairs:start + m]  # sin: one fewer for an odd m
            torch.cos(angle, out=cos)
            cos.mul_(radius)
            torch.sin(angle[:m - pairs], out=sin)
            sin.mul_(radius[:m - pairs])
        return out

    def normal(self, std: float, shape, device: torch.device | str | None = None) -> torch.Tensor:
        """A float64 tensor of `shape` of N(0, std²) draws (on `device`)."""
        shape = tuple(shape)
        draws = self.standard(math.prod(shape)).reshape(shape).mul_(std)
        return draws if device is None else draws.to(device)


class SeededNormal:
    """N(0, std²) draws from torch's generator seeded with `seed` (or from a generator given):
    reproducible, not secret."""

    def __init__(self, seed: int | torch.Generator, device: torch.device | str = "cpu") -> None:
        if isinstance(seed, torch.Generator):
            self.generator = seed
        else:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def normal(self, std: float, shape, device: torch.device | str | None = None) -> torch.Tensor:
        draws = torch.normal(0.0, std, tuple(shape), generator=self.generator, dtype=torch.float64)
        return draws if device is None else draws.to(device)


def noise_source(seed: int | None) -> SecretNormal | SeededNormal:
    """Secret noise for `seed = None`, else reproducible noise from `seed`."""
    return SecretNormal() if seed is None else SeededNormal(seed)
