"""Compressed upload (fedsilo.core.compression): fp16, bf16, int8 blockwise absmax and top-k as upload
transforms, each within its documented error bound, at its documented byte cost, with error feedback
that sends later what a round dropped, and a decode that refuses a malformed wire by name."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from fedsilo.config import ConfigError
from fedsilo.core.compression import kept_entries  # the import registers fp16, bf16, int8, topk
from fedsilo.core.tensors import nbytes
from fedsilo.core.transforms import UPLOAD_TRANSFORMS, TransformContext, decode, encode, update_norm
from tests.test_plugins import toy_config

SHAPES = [(), (0,), (3, 0), (7,), (1000,), (3, 5, 17), (513,)]  # scalar, empty, lengths not a multiple of 256


def _chain(name, **options):
    return UPLOAD_TRANSFORMS.resolve_chain([{"name": name, **options}], "t")


def _ctx(reference, round_idx=1):
    return TransformContext(round=round_idx, client="c0", reference=reference)


def _pair(seed, dtype, zero_reference):
    """A reference and values = reference + Δ (Δ standard normal) over SHAPES."""
    g = torch.Generator().manual_seed(seed)
    reference, values = {}, {}
    for i, shape in enumerate(SHAPES):
        ref = torch.zeros(shape, dtype=dtype) if zero_reference else 3 * torch.randn(shape, generator=g, dtype=dtype)
        reference[f"t{i}"], values[f"t{i}"] = ref, ref + torch.randn(shape, generator=g, dtype=dtype)
    return reference, values


def _round_trip(name, dtype, zero_reference, **options):
    """(u, D, slack, wire) per tensor: u the update the codec saw, D what the server recovered (both flat
    float64), slack the float rounding of reference + D on the server."""
    reference, values = _pair(7, dtype, zero_reference)
    chain = _chain(name, error_feedback=False, **options)
    wire, (record,) = encode(chain, values, _ctx(reference))
    assert record["bytes"] == nbytes(wire) and record["raw_bytes"] == 4 * sum(v.numel() for v in values.values())
    back = decode(chain, wire, reference)
    assert set(back) == set(values)
    out = {}
    for k, v in values.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        if v.numel():  # a new tensor, not the reference's or the wire's storage
            assert back[k].data_ptr() not in {reference[k].data_ptr(), wire[k].data_ptr()}
        u = (v - reference[k]).double().flatten()
        d = (back[k].double() - reference[k].double()).flatten()
        out[k] = (u, d, _slack(reference[k], u), wire)
    return out


def _slack(reference, u):
    """The float rounding of reference + D in the reference's dtype, per element of flat u."""
    return torch.finfo(reference.dtype).eps * (reference.double().abs().flatten() + 2 * u.abs())


def _int8_bound(u, block_size):
    """max|u_block|/254 per element of flat u (plus 1e-6 of it: float32 scales and products)."""
    absmax = F.pad(u.abs(), (0, -u.numel() % block_size)).view(-1, block_size).amax(dim=1)
    return (absmax * (1 / 254 + 1e-6)).repeat_interleave(block_size)[:u.numel()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero_reference", [True, False])
@pytest.mark.parametrize("name, relative, absolute", [("fp16", 2**-11, 2**-25), ("bf16", 2**-8, 0.0)])
def test_half_precision_round_trip_is_within_its_relative_bound(name, relative, absolute, dtype, zero_reference):
    for u, d, slack, _ in _round_trip(name, dtype, zero_reference).values():
        assert bool(((d - u).abs() <= relative * u.abs() + absolute + slack).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero_reference", [True, False])
@pytest.mark.parametrize("block_size", [256, 8])
def test_int8_error_is_at_most_the_block_absmax_over_254(block_size, dtype, zero_reference):
    for u, d, slack, _ in _round_trip("int8", dtype, zero_reference, block_size=block_size).values():
        assert bool(((d - u).abs() <= _int8_bound(u, block_size) + slack).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero_reference", [True, False])
def test_topk_sends_the_largest_entries_exactly_and_nothing_else(dtype, zero_reference):
    fraction = 0.05
    for k, (u, d, slack, wire) in _round_trip("topk", dtype, zero_reference, fraction=fraction).items():
        index = wire[f"{k}::index"].long()
        assert index.numel() == (max(1, round(fraction * u.numel())) if u.numel() else 0)
        kept = torch.zeros(u.numel(), dtype=torch.bool)
        kept[index] = True
        assert bool((d[~kept] == 0).all())  # the server's value is the reference, unchanged
        assert bool(((d[kept] - u[kept]).abs() <= 2**-24 * u[kept].abs() + slack[kept]).all())  # float32 values
        if (~kept).any():
            assert float(u[kept].abs().min()) >= float(u[~kept].abs().max())


def test_bytes_on_the_wire_are_the_documented_cost():
    n = 1_000_000
    g = torch.Generator().manual_seed(3)
    reference = {"w": torch.randn(n, generator=g)}
    values = {"w": reference["w"] + 1e-3 * torch.randn(n, generator=g)}
    sent = {}
    for name, options in [("int8", {"block_size": 256}), ("fp16", {}), ("bf16", {}), ("topk", {"fraction": 0.01})]:
        wire, (record,) = encode(_chain(name, **options), values, _ctx(reference))
        assert record["raw_bytes"] == 4 * n and record["bytes"] == nbytes(wire)
        sent[name] = nbytes(wire)
    assert sent["int8"] == n + 4 * math.ceil(n / 256) == 1_015_628
    assert 4 * n / sent["int8"] >= 3.9
    assert sent["fp16"] == sent["bf16"] == 2 * n
    assert sent["topk"] == 8 * 10_000
    print({name: round(4 * n / b, 3) for name, b in sent.items()})  # int8 3.938, fp16 2, bf16 2, topk 50


def _accumulate(spec, rounds, size=1000):
    """`rounds` rounds of the same update Δ through the codec with the silo's state carried over: the sum
    of what the server recovered, the sum of the true updates (both float64) and the last residual."""
    chain = UPLOAD_TRANSFORMS.resolve_chain([spec], "t")
    g = torch.Generator().manual_seed(11)
    reference = {"w": torch.randn(size, generator=g)}
    values = {"w": reference["w"] + torch.randn(size, generator=g)}
    states = [{}]
    sent = torch.zeros(size, dtype=torch.float64)
    for r in range(rounds):
        wire, _ = encode(chain, values, _ctx(reference, r), states)
        sent += (decode(chain, wire, reference)["w"] - reference["w"]).double()
    true = rounds * (values["w"] - reference["w"]).double()
    return sent, true, states[0].get("w")


def _relative(sent, true):
    return float((sent - true).norm() / true.norm())


def test_error_feedback_sends_later_what_topk_dropped():
    """Σ decoded = Σ Δ − e_T: the residual is bounded, so the accumulated sum's relative error falls as
    1/T; without error feedback the same 99% of Δ is dropped every round."""
    spec = {"name": "topk", "fraction": 0.01}
    errors = {}
    for rounds in (200, 2000):
        sent, true, residual = _accumulate(spec, rounds)
        torch.testing.assert_close(sent, true - residual.double(), rtol=0, atol=1e-6 * float(true.abs().max()))
        errors[rounds] = _relative(sent, true)
    sent, true, residual = _accumulate({**spec, "error_feedback": False}, 200)
    without = _relative(sent, true)
    print({"topk 1% EF, 200 rounds": errors[200], "EF, 2000 rounds": errors[2000], "no EF": without})
    assert residual is None  # no state kept
    assert errors[2000] < 0.03 and errors[2000] < errors[200] / 5  # measured 0.213 -> 0.021
    assert without > 0.9  # measured 0.957


def test_error_feedback_cancels_int8_rounding_bias():
    """The same Δ rounds the same way every round: without error feedback the bias adds up (the sum's
    relative error stays at one round's), with it the error stays one round's residual."""
    sent, true, residual = _accumulate({"name": "int8"}, 200)
    torch.testing.assert_close(sent, true - residual.double(), rtol=0, atol=1e-6 * float(true.abs().max()))
    with_ef = _relative(sent, true)
    without = _relative(*_accumulate({"name": "int8", "error_feedback": False}, 200)[:2])
    print({"int8 EF, 200 rounds": with_ef, "no EF": without})
    assert with_ef < 1e-4 and without > 50 * with_ef  # measured 4e-5 and 7e-3


def _wire(name, **options):
    reference = {"layer.w": torch.randn(300, generator=torch.Generator().manual_seed(5))}
    chain = _chain(name, **options)
    wire, _ = encode(chain, {"layer.w": reference["layer.w"] + 1}, _ctx(reference))
    return chain, wire, reference


def _set(wire, key, value):
    return {**wire, key: value}


def _without(wire, key):
    return {k: v for k, v in wire.items() if k != key}


def _index_with(wire, position, value):
    index = wire["layer.w::index"].clone()
    index[position] = value if value is not None else index[0]
    return _set(wire, "layer.w::index", index)


HOSTILE = {
    "fp16 as float32": ("fp16", {}, lambda w: _set(w, "layer.w", w["layer.w"].float())),
    "fp16 too few values": ("fp16", {}, lambda w: _set(w, "layer.w", w["layer.w"][:-1])),
    "fp16 not a tensor": ("fp16", {}, lambda w: _set(w, "layer.w", [0.0] * 300)),
    "bf16 as bfloat16": ("bf16", {}, lambda w: _set(w, "layer.w", w["layer.w"].view(torch.bfloat16))),
    "int8 no scales": ("int8", {}, lambda w: _without(w, "layer.w::scale")),
    "int8 no codes": ("int8", {}, lambda w: _without(w, "layer.w")),
    "int8 codes as int16": ("int8", {}, lambda w: _set(w, "layer.w", w["layer.w"].short())),
    "int8 scales as float16": ("int8", {}, lambda w: _set(w, "layer.w::scale", w["layer.w::scale"].half())),
    "int8 a code short": ("int8", {}, lambda w: _set(w, "layer.w", w["layer.w"][:-1])),
    "int8 a scale too many": ("int8", {}, lambda w: _set(w, "layer.w::scale", torch.ones(3))),
    "int8 an unknown part": ("int8", {}, lambda w: _set(w, "layer.w::extra", torch.ones(1))),
    "topk no index": ("topk", {"fraction": 0.1}, lambda w: _without(w, "layer.w::index")),
    "topk index as int64": ("topk", {"fraction": 0.1}, lambda w: _set(w, "layer.w::index", w["layer.w::index"].long())),
    "topk values as float64": ("topk", {"fraction": 0.1}, lambda w: _set(w, "layer.w", w["layer.w"].double())),
    "topk an entry too many": ("topk", {"fraction": 0.1},
                               lambda w: _set(w, "layer.w", torch.ones(kept_entries(300, 0.1) + 1))),
    "topk index past the end": ("topk", {"fraction": 0.1}, lambda w: _index_with(w, -1, 300)),
    "topk negative index": ("topk", {"fraction": 0.1}, lambda w: _index_with(w, 0, -1)),
    "topk duplicate index": ("topk", {"fraction": 0.1}, lambda w: _index_with(w, 1, None)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_wire_is_refused_naming_the_tensor(case):
    name, options, corrupt = HOSTILE[case]
    chain, wire, reference = _wire(name, **options)
    decode(chain, wire, reference)  # the intact wire decodes
    with pytest.raises(ValueError, match=re.escape("layer.w")):
        decode(chain, corrupt(wire), reference)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk"])
def test_a_tensor_the_server_does_not_hold_is_refused_by_name(name):
    chain, wire, reference = _wire(name)
    with pytest.raises(ValueError, match="'ghost': not a tensor the server holds"):
        decode(chain, {**wire, "ghost": wire["layer.w"]}, reference)


def test_clip_then_int8_through_the_chain_keeps_the_residual_in_the_states_passed():
    g = torch.Generator().manual_seed(2)
    reference = {"a": torch.randn(300, generator=g), "b": torch.randn(4, 5, generator=g)}
    chain = UPLOAD_TRANSFORMS.resolve_chain([{"name": "clip", "max_norm": 0.5},
                                             {"name": "int8", "block_size": 64}], "t")
    states = [{}, {}]
    kept = states[1]
    total_sent = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in reference.items()}
    total_clipped = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in reference.items()}
    for r in (1, 2):
        values = {k: v + torch.randn(v.shape, generator=g) for k, v in reference.items()}
        assert update_norm(values, reference) > 0.5
        clipped, _ = encode(chain[:1], values, _ctx(reference, r))
        wire, records = encode(chain, values, _ctx(reference, r), states)
        assert [rec["name"] for rec in records] == ["clip", "int8"] and records[0]["clipped"] is True
        assert states[0] == {} and states[1] is kept and set(kept) == {"a", "b"}
        back = decode(chain, wire, reference)
        for k in reference:
            u = (clipped[k] - reference[k]).double().flatten()
            d = (back[k].double() - reference[k].double()).flatten()
            if r == 1:  # no residual yet: the int8 bound holds against the clipped update itself
                assert bool(((d - u).abs() <= _int8_bound(u, 64) + _slack(reference[k], u)).all())
            total_sent[k] += d.view(reference[k].shape)
            total_clipped[k] += u.view(reference[k].shape)
    for k in reference:  # what the server has is what the silo meant to send, less the residual it keeps
        torch.testing.assert_close(total_sent[k], total_clipped[k] - kept[k].double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("item, key", [
    ({"name": "int8", "block_size": 0}, "block_size"),
    ({"name": "int8", "block_size": 2**21}, "block_size"),
    ({"name": "topk", "fraction": 0}, "fraction"),
    ({"name": "topk", "fraction": 1.5}, "fraction"),
    ({"name": "fp16", "error_feedback": "sometimes"}, "error_feedback"),
    ({"name": "bf16", "levels": 3}, "levels"),
])
def test_option_errors_name_the_entry_and_key(item, key):
    with pytest.raises(ValueError, match=re.escape(f"exchange.upload_transforms[0].{key}")):
        UPLOAD_TRANSFORMS.resolve_chain([item], "exchange.upload_transforms")


def test_the_config_names_a_bad_compression_option():
    with pytest.raises(ConfigError, match=re.escape("exchange.upload_transforms[1].fraction")):
        toy_config(exchange={"upload_transforms": [{"name": "clip", "max_norm": 1.0},
                                                   {"name": "topk", "fraction": 1.5}]})
