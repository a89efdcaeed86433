"""The roofline's step_time, sped up for the simulator's hot path (Python floats for scalar
terms, one (4, n) evaluation of the linear ops, in-place sums), against its frozen previous
form: every shape, scalar, array or mixed, graphed or not, must price to the same bits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from flowyard.core.plan import BatchShape
from flowyard.costmodel import make_cost_model
from flowyard.costmodel.roofline import _max_for

MODELS = [make_cost_model("llama-3-8b", "h100"), make_cost_model("qwen2.5-14b", "a100-80g", tp=2),
          make_cost_model("llama-3-8b", "h100", attn_fixed_s=7e-6)]


def reference_step_time(self, shape: BatchShape):
    """RooflineCostModel.step_time before its speed-up (at 0d41543), kept frozen."""
    pt, ps = shape.prefill_tokens, shape.prefill_seqs
    ds, dc = shape.decode_seqs, shape.decode_ctx
    pa, pk = shape.prefill_attn, shape.prefill_kv
    T = pt + ds
    mx = _max_for(shape)
    if mx is max and T == 0:
        return 0.0  # nothing to run (layer_op_times still prices the weight stream)
    a, w, bb = self._a, self._w, self._b
    layer = (mx(a[0] * T, w[0] + bb[0] * T) + mx(a[1] * T, w[1] + bb[1] * T)
             + mx(a[2] * T, w[2] + bb[2] * T) + mx(a[3] * T, w[3] + bb[3] * T)
             + mx(self._pf * (pa + self._tile * pt), self._pkv * pk + self._pqo * pt)
             + mx(self._pf * dc, self._dkv * dc + self._dqo * ds)
             + (self._lin_elem + self._attn_elem + self._ar_row) * T
             + self._lin_launch + self._attn_launch + self._ar_c)
    if self._afix:
        # one fixed cost per attention kernel that runs (the frozen form ORed two numpy boolean
        # arrays here, pricing a mixed step's arrays with one: fixed, test_costmodel_moe)
        layer = layer + self._afix * ((pt > 0) * 1.0 + (ds > 0) * 1.0)
    rows = ps + ds
    cut = (self._graph_c + self._graph_seq * rows) if shape.graphed else 0.0
    return (self.num_layers * layer - cut
            + self._emb_row * T + self._emb_c
            + mx(self._lm_a * rows, self._lm_w + self._lm_b * rows) + self._lm_norm * T
            + self._lm_c + (self._lm_gather + self._ovh_seq) * rows + self._ovh_c)



def field(kind: str, n: int, rng: np.random.Generator, top: int):
    """One BatchShape field: 0, a Python int or float, or an int or float array of length n."""
    if kind == "zero":
        return 0
    if kind == "int":
        return int(rng.integers(0, top))
    if kind == "float":
        return float(rng.uniform(0, top))
    v = rng.integers(0, top, size=n)
    return v if kind == "iarr" else v * rng.uniform(0.5, 1.5, size=n)


@settings(max_examples=300, deadline=None)
@given(model=st.integers(0, len(MODELS) - 1), n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       kinds=st.lists(st.sampled_from(["zero", "int", "float", "iarr", "farr"]), min_size=6, max_size=6),
       graphed=st.booleans())
def test_step_time_prices_every_shape_as_before(model, n, seed, kinds, graphed):
    rng = np.random.default_rng(seed)
    tops = (4096, 64, 4e6, 8192, 256, 2e6)
    shape = BatchShape(*(field(k, n, rng, t) for k, t in zip(kinds, tops)), graphed=graphed)
    cost = MODELS[model]
    got, want = cost.step_time(shape), reference_step_time(cost, shape)
    assert np.shape(got) == np.shape(want)
    np.testing.assert_array_equal(got, want)
    if _max_for(shape) is max:
        assert type(got) is float or got == 0.0  # scalar shapes price to plain floats


def test_decode_runs_and_predictor_grids_price_as_before():
    """The two array shapes of a run: a decode run (only decode_ctx varies) and a grid of
    passes (every field varies), as the simulator and DynaServe's predictor send them."""
    cost = MODELS[0]
    run = BatchShape(0, 0, 0.0, 0, 40, 30000 + 40 * np.arange(500, dtype=float))
    rng = np.random.default_rng(1)
    grid = BatchShape(*rng.integers(0, 600, size=(6, 300)).astype(float))
    for shape in (run, grid):
        np.testing.assert_array_equal(cost.step_time(shape), reference_step_time(cost, shape))
