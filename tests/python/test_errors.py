"""Bad arguments raise Python exceptions that name the argument: TypeError for dtypes, ValueError
for devices, shapes, layouts and values (msa::Error's "argument 'x': expected ..., got ...")."""

from __future__ import annotations

import pytest
import torch

import msa
import msa.torch as mt
from conftest import make_case, ref_rows


@pytest.fixture(scope="module")
def c():
    return make_case(dtype=torch.float32)


@pytest.fixture(scope="module")
def rows(c):
    return ref_rows(c.qi, c.ki, c, c.topk, c.block)


def test_int64_cu_seqlens_is_a_type_error(c, rows):
    with pytest.raises(TypeError, match="argument 'cu_seqlens_q': expected dtype int32"):
        mt.sparse_attention(c.q, c.k, c.v, rows, c.cu_q.long(), c.cu_k, block_size=16)


def test_mixed_float_dtypes_are_a_type_error(c, rows):
    with pytest.raises(TypeError, match="argument 'k': expected dtype float32"):
        mt.sparse_attention(c.q, c.k.bfloat16(), c.v, rows, c.cu_q, c.cu_k, block_size=16)


def test_integer_queries_are_a_type_error(c):
    with pytest.raises(TypeError, match="argument 'qi'"):
        mt.indexer(c.qi.int(), c.ki, c.cu_q, c.cu_k, topk=4, block_size=16)


def test_wrong_device_names_the_argument(c, rows):
    with pytest.raises(ValueError, match="argument 'v': expected a tensor on cpu"):
        mt.sparse_attention(c.q, c.k, c.v.to("meta"), rows, c.cu_q, c.cu_k, block_size=16)


@pytest.mark.skipif(msa.built_with_cuda() and torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cuda_decode_step_without_a_cuda_build_or_device_is_refused():
    with pytest.raises((ValueError, RuntimeError, AssertionError)):
        mt.DecodeStep(max_batch=1, max_context=256, q_heads=2, kv_heads=1, head_dim=64, index_dim=64, device="cuda")


def test_non_contiguous_inputs_are_refused_on_the_cpu(c, rows):
    q = c.q.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="argument 'q': expected a contiguous tensor"):
        mt.sparse_attention(q, c.k, c.v, rows, c.cu_q, c.cu_k, block_size=16)


def test_shape_errors_come_from_msa_with_the_argument_named(c, rows):
    with pytest.raises(ValueError, match="argument 'k'"):
        mt.sparse_attention(c.q, c.k[:, :, :8].contiguous(), c.v, rows, c.cu_q, c.cu_k, block_size=16)
    with pytest.raises(ValueError, match="argument 'topk'|argument 'rows'|topk"):
        mt.sparse_attention(c.q, c.k, c.v, rows[:1].contiguous(), c.cu_q, c.cu_k, block_size=16)


def test_bad_selection_rows_are_refused(c, rows):
    bad = rows.clone()
    bad[0, 5, 0] = 1000  # beyond the query's own block
    with pytest.raises(ValueError, match="topk|rows|selection"):
        mt.sparse_attention(c.q, c.k, c.v, bad, c.cu_q, c.cu_k, block_size=16)


def test_bad_cu_seqlens_contents_are_refused(c, rows):
    cu = c.cu_q.clone()
    cu[1] = cu[2] + 1  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        mt.dense_attention(c.q, c.k, c.v, cu, c.cu_k)


def test_bad_params_are_refused(c):
    with pytest.raises(ValueError, match="local_blocks"):
        mt.indexer(c.qi, c.ki, c.cu_q, c.cu_k, topk=4, block_size=16, local_blocks=0)
    with pytest.raises(ValueError, match="index_compute"):
        mt.indexer(c.qi, c.ki, c.cu_q, c.cu_k, topk=4, block_size=16, index_compute="fp4")
    with pytest.raises(ValueError, match="impl"):
        mt.dense_attention(c.q, c.k, c.v, c.cu_q, c.cu_k, impl="gpu")


def test_not_a_tensor_is_a_type_error(c):
    with pytest.raises(TypeError, match="argument 'ki'"):
        mt.indexer(c.qi, [1, 2], c.cu_q, c.cu_k)
