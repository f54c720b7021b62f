"""The block quantizer of the low-precision all-gather (fsdp2.runtime.quantize).

- Exactness: the wire bytes and the dequantized values equal those of a second implementation
  written plainly in float64 (tests/support/quantize_reference.py).
- Error bounds per block, for blocks whose absmax is at least 2^-100 (a normal fp32 scale):
  int8: every element within absmax/127 of its input (and within scale/2 with fp32 output);
  e4m3: elements with |x| >= 2^-6 * scale (not on e4m3's subnormal grid) within 2^-3 |x|
  (2^-4 |x| with fp32 output), the others within 2^-9 * scale (2^-10 * scale).
- The wire layout in a group buffer (columns of rank rows), zeros, non-finite inputs, the
  compiled functions, a real uint8 all-gather on 2 gloo ranks, and bad policies.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2 import AllGatherPolicy, FSDPUsageError
from fsdp2.runtime.quantize import SLOT_ALIGN, dequantize_from, quantize_into, wire_bytes
from tests.support.quantize_reference import QMAX, reference_dequantize, reference_quantize

QDTYPES = [torch.int8, torch.float8_e4m3fn]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]

# -- inputs ----------------------------------------------------------------------------------------


@st.composite
def policies(draw):
    return AllGatherPolicy(
        draw(st.sampled_from(QDTYPES)),
        block_size=draw(st.sampled_from([16, 32, 48, 128, 256])),
        scale_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
    )


@st.composite
def shards(draw):
    """A 1-D shard: blocks of very different magnitudes, exact zeros, zero blocks, outliers; or
    arbitrary floats (subnormals, ties, huge values) drawn by hypothesis."""
    dtype = draw(st.sampled_from(FLOATS))
    finite = torch.finfo(dtype)
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(-(2.0**120), 2.0**120, width=32), max_size=300))
        return torch.tensor(values, dtype=torch.float32).clamp(finite.min, finite.max).to(dtype)
    numel = draw(st.integers(0, 1500))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    span = 8 if dtype == torch.float16 else 40
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-span, span + 1, (numel // 16 + 1,), generator=g).repeat_interleave(16)[:numel]
    x[torch.rand(numel, generator=g) < 0.05] = 0.0
    x[torch.rand(numel, generator=g) < 0.01] *= 100.0
    if numel > 64 and draw(st.booleans()):
        x[16:64] = 0.0
    return x.clamp(finite.min, finite.max).to(dtype)


def quantize(x: torch.Tensor, policy: AllGatherPolicy) -> torch.Tensor:
    wire = torch.full((wire_bytes(x.numel(), policy),), 0xAB, dtype=torch.uint8)  # garbage in, to be overwritten
    quantize_into(x, wire, policy)
    return wire


def dequantize(wire: torch.Tensor, numel: int, policy: AllGatherPolicy, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((1, numel), float("nan"), dtype=dtype)
    dequantize_from(wire.view(1, -1), out, policy)
    return out[0]


# -- exactness and bounds --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(shards(), policies(), st.sampled_from(FLOATS))
def test_matches_float64_reference(x, policy, out_dtype):
    wire = quantize(x, policy)
    expected, _ = reference_quantize(x, policy)
    assert torch.equal(wire, expected)
    back = dequantize(wire, x.numel(), policy, out_dtype)
    assert torch.equal(back, reference_dequantize(expected, x.numel(), policy, out_dtype))


SMALL_POLICIES = [AllGatherPolicy(d, 16, scale_dtype=s) for d in QDTYPES for s in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("policy", SMALL_POLICIES, ids=str)
def test_special_blocks_match_reference(policy):
    """Signed zeros, a block whose scale underflows to 0, fp32 subnormals, exact ties."""
    ties = [127.0, 0.5, 1.5, -2.5, 64.5] * 3 + [3.0]
    x = torch.tensor([-0.0] * 16 + [1e-44, -3e-45] * 8 + [1e-39] * 15 + [-1e-38] + ties)
    expected, scale = reference_quantize(x, policy)
    assert scale[1] == 0 and torch.equal(quantize(x, policy), expected)
    back = dequantize(expected, x.numel(), policy, torch.float32)
    assert torch.equal(back, reference_dequantize(expected, x.numel(), policy, torch.float32))


@settings(max_examples=150, deadline=None)
@given(shards(), policies(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_error_bounds_per_block(x, policy, out_dtype):
    wire = quantize(x, policy)
    _, scale = reference_quantize(x, policy)
    numel, size = x.numel(), policy.block_size
    err = (dequantize(wire, numel, policy, out_dtype).double() - x.double()).abs()
    x = x.double()
    block = torch.arange(numel) // size
    absmax = torch.nn.functional.pad(x.abs(), (0, -numel % size)).view(-1, size).amax(dim=1)
    normal_scale = absmax >= 2**-100
    # The stored scale is absmax / qmax, rounded to fp32 or bf16.
    assert ((scale - absmax / QMAX[policy.dtype]).abs() <= 2**-8 * absmax / QMAX[policy.dtype])[normal_scale].all()
    checked = normal_scale[block]
    s = scale[block]
    # With fp32 output the bounds are tight: the scale's own rounding only moves where the clamp
    # acts (x / scale <= 127.5 for int8, relative 2^-8 for e4m3), within the rounding error.
    exact_path = out_dtype == torch.float32
    if policy.dtype == torch.int8:
        assert (err <= absmax[block] / 127)[checked].all()
        if exact_path:
            assert (err <= s * (0.5 + 2**-16))[checked].all()  # half a step
    else:
        normal = checked & (x.abs() >= 2**-6 * s)
        assert (err <= 2**-3 * x.abs())[normal].all()
        assert (err <= 2**-9 * s)[checked & ~normal].all()
        if exact_path:
            assert (err <= 2**-4 * (1 + 2**-16) * x.abs())[normal].all()
            assert (err <= 2**-10 * (1 + 2**-16) * s)[checked & ~normal].all()


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_zero_blocks_come_back_as_zeros(qdtype):
    policy = AllGatherPolicy(qdtype, block_size=16)
    x = torch.zeros(40, dtype=torch.bfloat16)
    x[20] = 1.5
    back = dequantize(quantize(x, policy), 40, policy, torch.bfloat16)
    assert torch.equal(back, x)  # no 0/0 NaN in the zero blocks; 1.5 is exact in both formats


def test_empty_slot():
    policy = AllGatherPolicy(torch.int8)
    assert wire_bytes(0, policy) == 0
    quantize_into(torch.empty(0), torch.empty(0, dtype=torch.uint8), policy)
    dequantize_from(torch.empty(3, 0, dtype=torch.uint8), torch.empty(3, 0), policy)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_non_finite_values_poison_only_their_block(qdtype):
    policy = AllGatherPolicy(qdtype, block_size=16)
    x = torch.randn(64)
    bad = x.clone()
    bad[3], bad[40] = float("inf"), float("nan")
    back = dequantize(quantize(bad, policy), 64, policy, torch.float32)
    clean = dequantize(quantize(x, policy), 64, policy, torch.float32)
    assert back[:16].isnan().all() and back[32:48].isnan().all()
    assert torch.equal(back[16:32], clean[16:32]) and torch.equal(back[48:], clean[48:])


def test_shorter_shard_reads_as_zero_padded():
    """A rank's shard with fewer rows than the slot: the missing tail quantizes as zeros."""
    policy = AllGatherPolicy(torch.float8_e4m3fn, block_size=32)
    x = torch.randn(70)
    out = torch.empty(wire_bytes(100, policy), dtype=torch.uint8)
    quantize_into(x, out, policy, numel=100)
    assert torch.equal(out, quantize(torch.cat([x, torch.zeros(30)]), policy))


@pytest.mark.parametrize("scale_dtype,ratio", [(torch.float32, 0.5157), (torch.bfloat16, 0.5079)])
def test_wire_bytes(scale_dtype, ratio):
    policy = AllGatherPolicy(torch.int8, scale_dtype=scale_dtype)  # default block size
    n = 2**20
    assert wire_bytes(n, policy) <= 0.53 * 2 * n  # the promised bound: about half of bf16's bytes
    assert wire_bytes(n, policy) <= ratio * 2 * n
    for numel in [1, 127, 128, 129, 1000, 4097]:
        nblocks = math.ceil(numel / 128)
        used = nblocks * (128 + scale_dtype.itemsize)
        assert wire_bytes(numel, policy) == used + (-used % SLOT_ALIGN)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 300), min_size=1, max_size=4), policies())
def test_group_buffer_columns(world, sizes, policy):
    """Several parameters side by side in one ``world x row`` uint8 buffer, as the group's all-gather
    lays them out: dequantizing a column block into a column block of a wider output is exact."""
    wires = [wire_bytes(n, policy) for n in sizes]
    offsets = [sum(wires[:i]) for i in range(len(wires))]
    gathered = torch.empty(world, sum(wires), dtype=torch.uint8)
    shards = [[torch.randn(n, dtype=torch.bfloat16) for n in sizes] for _ in range(world)]
    for rank in range(world):
        for x, off, w in zip(shards[rank], offsets, wires):
            quantize_into(x, gathered[rank, off : off + w], policy)
    out = torch.empty(world, sum(sizes) + 5, dtype=torch.bfloat16)
    col = 0
    for i, (n, off, w) in enumerate(zip(sizes, offsets, wires)):
        dequantize_from(gathered[:, off : off + w], out[:, col : col + n], policy)
        for rank in range(world):
            alone = dequantize(quantize(shards[rank][i], policy), n, policy, torch.bfloat16)
            assert torch.equal(out[rank, col : col + n], alone)
        col += n


# -- compiled ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_compiled_matches_eager(qdtype):
    """Inductor's fused kernels give the same bytes and values (bf16 scales: the scale rounding
    must survive fusion; a tail block; a column of a wider output)."""
    import torch._dynamo

    torch._dynamo.reset()
    policy = AllGatherPolicy(qdtype, block_size=32, scale_dtype=torch.bfloat16)
    x = torch.randn(2, 1000, dtype=torch.bfloat16) * 3
    w = wire_bytes(1000, policy)
    eager, compiled = torch.zeros(2, w, dtype=torch.uint8), torch.ones(2, w, dtype=torch.uint8)
    quantize_compiled = torch.compile(quantize_into, fullgraph=True)
    for rank in range(2):
        quantize_into(x[rank], eager[rank], policy)
        quantize_compiled(x[rank], compiled[rank], policy)
    assert torch.equal(eager, compiled)
    out_eager, out_compiled = torch.zeros(2, 1003), torch.ones(2, 1003)
    dequantize_from(eager, out_eager[:, 1:1001], policy)
    torch.compile(dequantize_from, fullgraph=True)(eager, out_compiled[:, 1:1001], policy)
    assert torch.equal(out_eager[:, 1:1001], out_compiled[:, 1:1001])


# -- a real all-gather ---------------------------------------------------------------------------


def _gather_two_params(rank, world_size, qdtype):
    from fsdp2.runtime import collectives
    from fsdp2.tools.comm_stats import count_comm

    policy = AllGatherPolicy(qdtype, block_size=64)
    sizes = [300, 1024]  # a tail block, then whole blocks
    shards = [
        [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i)) for i, n in enumerate(sizes)]
        for r in range(world_size)
    ]
    wires = [wire_bytes(n, policy) for n in sizes]
    row = sum(wires)
    output = torch.empty(world_size * row, dtype=torch.uint8)
    own = output[rank * row : (rank + 1) * row]
    quantize_into(shards[rank][0], own[: wires[0]], policy)
    quantize_into(shards[rank][1], own[wires[0] :], policy)
    with count_comm() as stats:
        collectives.all_gather(output, own, None, async_op=False)
    rows = output.view(world_size, row)
    full = torch.empty(world_size, sum(sizes), dtype=torch.bfloat16)
    dequantize_from(rows[:, : wires[0]], full[:, : sizes[0]], policy)
    dequantize_from(rows[:, wires[0] :], full[:, sizes[0] :], policy)
    for r in range(world_size):
        for i, cols in enumerate([slice(0, sizes[0]), slice(sizes[0], None)]):
            alone = dequantize(quantize(shards[r][i], policy), sizes[i], policy, torch.bfloat16)
            assert torch.equal(full[r, cols], alone), (r, i)
            assert (full[r, cols].float() - shards[r][i]).abs().max() <= shards[r][i].abs().max() / 16
    return stats.bytes["all_gather"], world_size * row


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_gloo_all_gather_round_trip(worlds, qdtype):
    for counted, expected in worlds.run(2, _gather_two_params, qdtype):
        assert counted == expected


# -- policy validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(dtype=torch.bfloat16), "dtype"),
        (dict(dtype=torch.float8_e5m2), "dtype"),
        (dict(dtype=torch.int8, block_size=0), "block_size"),
        (dict(dtype=torch.int8, block_size=100), "block_size"),
        (dict(dtype=torch.int8, block_size=128.0), "block_size"),
        (dict(dtype=torch.int8, block_size=True), "block_size"),
        (dict(dtype=torch.int8, scale_dtype=torch.float16), "scale_dtype"),
        (dict(dtype=torch.int8, applies_to="weights"), "applies_to"),
    ],
)
def test_bad_policy(kwargs, field):
    with pytest.raises(FSDPUsageError, match=f"AllGatherPolicy\\({field}="):
        AllGatherPolicy(**kwargs)


def test_default_policy_skips_1d_parameters():
    policy = AllGatherPolicy(torch.int8)
    assert policy.block_size == 128 and policy.scale_dtype == torch.bfloat16
    assert policy.applies_to("w", torch.empty(4, 4)) and not policy.applies_to("b", torch.empty(4))
    custom = AllGatherPolicy(torch.int8, applies_to=lambda fqn, p: "embed" not in fqn)
    assert not custom.applies_to("embed.weight", torch.empty(4, 4))
