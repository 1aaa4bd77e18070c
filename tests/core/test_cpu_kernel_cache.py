"""--cpu-kernel-cache and --cpu-length-multiple: the values they resolve to, the capacities set,
and the memory growth they stop."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from fairseq_fp16.core.cpu_kernel_cache import (
    CACHE_ENV_VARS,
    batch_products,
    cap_cpu_kernel_caches,
    check_capacity,
    resolve_kernel_cache,
    resolve_length_multiple,
)
from fairseq_fp16.core.half_matmul import cpu_has_amx, cpu_has_native_half


def test_sets_both_capacities_and_leaves_the_users_own():
    env = {}
    assert cap_cpu_kernel_caches(64, env) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
    env = {"LRU_CACHE_CAPACITY": "512", "OTHER": "x"}
    assert cap_cpu_kernel_caches("16", env) == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "512"}
    assert env["OTHER"] == "x"
    assert check_capacity("7") == 7


@pytest.mark.parametrize("bad", [0, -3, "2.5", "many", None])
def test_a_capacity_below_one_or_not_an_integer_is_refused(bad):
    env = {}
    with pytest.raises(ValueError, match=r"--cpu-kernel-cache must be auto or an integer >= 1 .*got "
                       + re.escape(repr(bad))):
        cap_cpu_kernel_caches(bad, env)
    assert env == {}


AMX = ["avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16"]  # /proc/cpuinfo of the AMX Xeon here


@pytest.mark.parametrize("choice,dtype,native,flags,expected", [
    ("auto", torch.bfloat16, True, AMX, 8),
    ("auto", torch.float16, True, AMX, 1),  # AVX512-FP16 without AMX-FP16
    ("auto", torch.float16, True, AMX + ["amx_fp16"], 8),
    ("auto", torch.bfloat16, True, ["avx512_bf16"], 1),  # bf16 units, no AMX
    ("auto", torch.bfloat16, False, AMX, 1),  # fp32 accumulation: no oneDNN kernels
    ("auto", None, True, AMX, 1),  # fp32
    ("4", torch.bfloat16, True, [], 4),
    (1, torch.bfloat16, True, AMX, 1),
])
def test_length_multiple_auto_pads_where_products_run_on_amx_tiles(choice, dtype, native, flags, expected):
    assert resolve_length_multiple(choice, dtype, native, flags) == expected


def test_auto_keeps_the_lengths_of_batches_with_large_products():
    # measured on the AMX Xeon: transformer base at 4,096 tokens (~197 G) faster unpadded, the
    # default model at 2,048 tokens (~15 G) faster padded
    assert resolve_length_multiple("auto", torch.bfloat16, True, AMX, products=197 * 10**9) == 1
    assert resolve_length_multiple("auto", torch.bfloat16, True, AMX, products=15 * 10**9) == 8
    assert resolve_length_multiple("auto", torch.bfloat16, True, AMX, products=None) == 8
    assert resolve_length_multiple("8", torch.bfloat16, True, AMX, products=197 * 10**9) == 8


def test_batch_products_count_every_linear_layers_weights_once_per_token():
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512),
                                torch.nn.Embedding(100, 512))  # a lookup: no product
    assert batch_products(model, 4096) == 4096 * 2 * 512 * 2048
    assert batch_products(model, None) is None and batch_products(None, 4096) is None


@pytest.mark.parametrize("bad", [0, "-8", "2.5", "eight", None])
def test_a_length_multiple_not_auto_nor_a_positive_integer_is_refused(bad):
    with pytest.raises(ValueError, match=r"--cpu-length-multiple must be auto or an integer >= 1 "
                       r"\(1 = lengths as they are\), got " + re.escape(repr(bad))):
        resolve_length_multiple(bad, torch.bfloat16, True, AMX)


def test_kernel_cache_auto_keeps_torchs_capacity_only_for_padded_lengths():
    assert resolve_kernel_cache("auto", 8) == 1024
    assert resolve_kernel_cache("auto", 1) == 64
    assert resolve_kernel_cache("32", 8) == 32
    with pytest.raises(ValueError, match=r"--cpu-kernel-cache must be auto or an integer >= 1"):
        resolve_kernel_cache("big", 8)


def test_amx_needs_the_dtypes_own_tile_flag():
    assert cpu_has_amx(torch.bfloat16, AMX) and not cpu_has_amx(torch.float16, AMX)
    assert not cpu_has_amx(torch.float32, AMX + ["amx_fp16"])


# bf16 linear layers, forward and backward, on 120 batch shapes as a translation
# batcher makes them; prints how much resident memory grew from step 10 to the end.
PROBE = r"""
import json, os, random, sys
import torch
if sys.argv[1] != "none":
    from fairseq_fp16.core.cpu_kernel_cache import cap_cpu_kernel_caches
    cap_cpu_kernel_caches(int(sys.argv[1]))
torch.set_num_threads(1)
torch.manual_seed(0)
rng = random.Random(0)
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
layers = [torch.nn.Linear(256, 2048).bfloat16(), torch.nn.Linear(256, 512).bfloat16()]
shapes = rng.sample([(b, t) for b in range(8, 64) for t in range(4, 40)], 120)
for i, (b, t) in enumerate(shapes):
    x = torch.randn(b, t, 256, dtype=torch.bfloat16, requires_grad=True)
    sum(layer(x).float().sum() for layer in layers).backward()
    if i == 9:
        start = rss_mb()
print(json.dumps({"growth_mb": rss_mb() - start}))
"""


@pytest.mark.skipif(not cpu_has_native_half(torch.bfloat16),
                    reason="bf16 products take oneDNN's kernels only on CPUs with bf16 units")
def test_capped_caches_stop_bf16_memory_growing_with_batch_shapes():
    def growth(capacity):
        env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV_VARS}
        out = subprocess.run([sys.executable, "-c", PROBE, capacity], capture_output=True,
                             text=True, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]

    uncapped, capped = growth("none"), growth("8")
    # measured here: 424 MB uncapped, 12 MB capped at 8 (103 MB at the default 64)
    assert uncapped > 150, uncapped
    assert capped < uncapped / 4, (capped, uncapped)
