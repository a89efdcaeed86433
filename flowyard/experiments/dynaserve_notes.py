"""Prose of the DynaServe report: the setup, and why our numbers differ from the paper's."""

SETUP = """\
**Setup.** Two instances on simulated {hardware} (roofline cost model), {models}. Systems:
PD Coloc. = `vllm`, two replicas, round robin, chunked prefill (chunk tuned per workload among
{chunks}, as the paper tuned 256-2048); PD Disagg. = `distserve` 1P1D; DynaServe = `dynaserve`
(split search K = 6, Alg. 2 batches under the 100 ms TBT SLO, per-task empirical length
predictor + 20 tokens, chunked KV push). Workloads: Poisson arrivals with lengths resampled from
the bundled traces (Azure Code 2023, the 400-row public head of BurstGPT, arXiv summarization);
Mini Reasoning is not available offline, so a stand-in with its reported mean shape (P219/D1467,
gamma-distributed) replaces it. Each run holds rate x {duration:g} s of arrivals ({min_n} to
{max_n} requests), so an overloaded run builds a queue rather than being absorbed by the
cluster's 512 concurrent sequences. Metric definitions: `flowyard/experiments/dynaserve_bench.py`."""

NOTES = """\
- **Table 1 matches in shape and mostly in size.** Colocation with 2048-token chunks misses the
  100 ms TBT SLO on long prompts (P99 about 0.3 s on P8192/D32 and P2048/D512) and
  disaggregation leaves one GPU idle on P8192/D32 and the other on P219/D1467. Our
  throughputs for those two systems are within about 20 % of the paper's. On P219/D1467 at
  saturation both baselines run their KV cache nearly full and preempted requests stall, so
  their P99 TBT (about 0.3 s) is above the paper's, which was measured at a lower load. Our HBM figure is the KV cache actually in use (time-averaged); vLLM reports its
  whole pre-allocated pool, so the paper's colocation and decode columns read about 95 %.
- **MFU is higher than the paper's** (52-56 % against 39-43 % on P8192/D32): the roofline's
  compute efficiency is calibrated on GEMM microbenchmarks, and vLLM v0.7's real steps also
  spend time in the scheduler, sampling and kernel launches that the model prices lightly.
- **Against colocation the paper's gains do not reproduce** (capacity within a few % either
  way). We give colocation its best chunk size per workload, as the paper says it did
  (256-2048); 256 or 512 wins everywhere. With such chunks the roofline prices a mixed step
  well under 100 ms, so colocation's P99 TBT holds the SLO up to the cluster's compute limit,
  which DynaServe reaches too: the roofline has no kernel interference between prefill and
  decode inside one step, which is exactly what the paper blames for colocation's tail
  (§2.4). Against disaggregation, whose GPUs idle on unbalanced work, DynaServe's gains do
  reproduce (1.1-2.6x).
- **Hand-offs cost DynaServe TBT, so its steps aim lower.** When a request moves from A to B,
  the token after the hand-off waits for B's step in flight and then B's next step, plus the
  last KV chunk: about 1.5 steps. With Alg. 2 aiming steps at 90 ms those gaps were the ones
  over 100 ms (P99 TBT 123 ms on Azure Code at 6 req/s); our DynaServe aims at 67.5 ms
  (`DynaServeConfig.step_headroom`), which keeps P99 TBT near 67 ms at the same throughput.
  The paper does not discuss this gap; a hand-off that lets A keep decoding until B has taken
  over would remove it.
- **Decode-heavy work is memory-bound, not TBT-bound.** On the reasoning stand-in a 14B
  decode step at full KV stays near 40-60 ms on the A100 roofline, so every system's TBT holds
  and capacity is set by KV memory and the scheduling-delay bound: splitting cannot help much.
- **Goodput.** Ours counts the output tokens of requests whose own P99 TBT is within 100 ms;
  the paper's exact per-request rule is not stated, and its Table 2 goodputs (316-474 tokens/s
  at 4.6-7.4 req/s) are lower than any output-token rate of that mix, so only the ratios
  between systems compare.
- **Length error.** The fixed-length predictor (1467 tokens for every request) is the paper's
  setup; errors of 10-100 tokens on a 1467-token output move the split point by under 7 %,
  and the virtual-batch predictor re-seeds from snapshots, so the effect is small, as in the
  paper; near capacity the run-to-run spread between workload draws is of the same size as
  the effect.
- **Disaggregation on long outputs.** A request that waits for a decode slot after its first
  token stalls once, for seconds; that is one gap in 1,467 and never reaches the P99 TBT, so
  without counting stalls as scheduling delay a saturated 1P1D cluster would look sustainable
  at any rate.
- **Chunked KV.** Chunks are pushed as each step computes them, so only the last chunk is in
  flight at the hand-off; our reduction is larger than the paper's 94 % because the simulated
  link has no per-message overhead."""
