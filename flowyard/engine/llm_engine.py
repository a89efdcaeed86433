"""The single-instance engine: the shared local scheduler + the model runner + output
processing (detokenisation, stop conditions).

Scheduling is not here. `LLMEngine.step` asks the very `BatchScheduler` the simulator uses
(the `vllm` baseline) for a plan, runs it for real, decides which requests hit EOS or a stop
string, and hands the result back through `update_from_output`, exactly like the simulated
executor does with a cost model.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from flowyard.core.kvcache import KVCacheManager
from flowyard.core.plan import StepOutput, StepPlan
from flowyard.core.prefix_cache import PrefixCachingKVManager
from flowyard.core.request import SLO, NO_SLO, Request, RequestState
from flowyard.engine import skinny_gemm
from flowyard.engine.model import LAYER_OPS, CausalLM, large_gemm_f32
from flowyard.engine.gemv_kernel import MAX_ROWS as GEMV_MAX_ROWS, gemv_bf16
from flowyard.engine.preemption import ExecutionPool, PreemptionStats
from flowyard.engine.engine_config import DTYPES, KV_CACHE_DTYPES, EngineConfig, default_token_budget, resolve_dtype
from flowyard.engine.quant import quantize_model
from flowyard.engine.runner import ModelRunner
from flowyard.engine.sampling import RequestOutput, SamplingParams, sample, top_logprobs
from flowyard.engine.threads import ThreadTuner, shape_key, shared_tuner
from flowyard.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from flowyard.policies.framework.contracts import LocalScheduler, Role, StepResult
from flowyard.policies.framework.continuous_batching import BatchConfig, BatchScheduler

def new_request(rid: int, arrival: float, prompt_ids: list[int], params: SamplingParams, slo: SLO | None,
                max_model_len: int, **fields) -> Request:
    """A `Request` for token ids, checked against the context limit (ValueError says why)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len {max_model_len}")
    return Request(id=rid, arrival=arrival, prompt_len=len(prompt_ids), max_tokens=params.max_tokens,
                   slo=slo or NO_SLO, prompt_tokens=tuple(prompt_ids), **fields)


@dataclass(slots=True)
class TrackedRequest:
    """Engine-side bookkeeping of one request: its params, detokeniser and stop handling."""

    request_id: str
    state: RequestState
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    emitted: int = 0  # characters of text already streamed
    emitted_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                 name: str = "model", *, instance: int = 0, role: Role = Role.MIXED,
                 batch: BatchConfig | None = None, ids: Iterator[int] | None = None,
                 t0: float | None = None,
                 scheduler: Callable[[KVCacheManager, int], LocalScheduler] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """instance/role/batch: this engine's place in a cluster and its policy's local
        scheduler settings; ids/t0: request-id counter and clock origin shared by a cluster;
        scheduler: build the policy's own local scheduler (from the KV manager and the
        context limit) instead of a BatchScheduler from `batch`."""
        if config.threads:
            torch.set_num_threads(config.threads)
        # pinned by `threads`, or else chosen step by step from measured times (threads.py)
        self.threads: ThreadTuner | None = None if config.threads else shared_tuner()
        self.config = config
        self.model_name = name
        self.tokenizer = tokenizer
        self.dtype = DTYPES[resolve_dtype(config.dtype)]
        # .to() drops the packed-weight copies (PackedLinear) even when the dtype is already
        # right, so an engine made on a cluster's shared model would repack every weight on its
        # first batched step: convert only when the dtype differs
        if model.embed.weight.dtype != self.dtype:
            model = model.to(self.dtype)
        self.model = quantize_model(model.eval(), config.quantization)
        # CPU bfloat16 outside `exact` mode (whose point is transformers' own oneDNN kernels):
        # large GEMMs in float32 where that is faster, and decode linears of 1 to 4 rows
        # through the gemv_bf16 C kernel where it compiled (it rounds once from float32).
        fast_bf16 = (config.attention != "exact" and self.dtype == torch.bfloat16
                     and self.model.embed.weight.device.type == "cpu")
        self.model.linear.large_f32 = fast_bf16 and large_gemm_f32()
        self.model.linear.small_gemv = fast_bf16 and gemv_bf16.available()
        # float32 on the CPU: decode linears of a few rows as W @ x^T where MKL's x @ W^T
        # reads each weight several times over (engine/skinny_gemm.py)
        self.model.linear.skinny_mm = (config.attention != "exact" and self.dtype == torch.float32
                                       and self.model.embed.weight.device.type == "cpu"
                                       and skinny_gemm.transposed_faster())
        self.model.linear.row_padding = (skinny_gemm.ROW_PADDING if self.model.linear.skinny_mm
                                         and skinny_gemm.padding_faster() else None)
        cfg = model.cfg
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv_dtype.itemsize
        tokens = config.kv_cache_tokens or config.kv_cache_memory_mb * 2**20 // per_token
        num_blocks = max(1, tokens // config.block_size)
        kv_cls = PrefixCachingKVManager if config.enable_prefix_caching else KVCacheManager
        self.kv = kv_cls(num_blocks, config.block_size)
        ctx = model.cfg.max_position_embeddings
        self.max_model_len = min(config.max_model_len or ctx, ctx, num_blocks * config.block_size)
        if scheduler is not None:
            self.scheduler: LocalScheduler = scheduler(self.kv, self.max_model_len)
        else:
            budget = config.max_num_batched_tokens or default_token_budget(self.model.embed.weight.device.type)
            base = batch or BatchConfig(max_num_batched_tokens=budget,
                                        max_num_seqs=config.max_num_seqs)
            # One step at a time: a real executor never takes up a multi-step run promise.
            self.scheduler = BatchScheduler(instance, role, self.kv, dataclasses.replace(
                base, max_model_len=self.max_model_len, max_repeats=1))
        self.instance = instance
        # what each executed step's update_from_output returned (finished, hand-offs, prefilled):
        # a cluster runtime takes them after every step for its cluster core; a lone engine
        # keeps only the last one
        self.results: list[StepResult] = []
        # called when a plan's forward pass is done, before its outputs are applied: the
        # two-executor guard advances a virtual clock by the cost model's step time there
        self.on_executed: Callable[[StepPlan], None] | None = None
        self.last_plan: StepPlan | None = None  # what the last step ran (None: nothing), for timelines
        self.runner = ModelRunner(self.model, self.kv, self.kv_dtype, grouped_decode=config.attention == "grouped",
                                  paged_decode=config.attention == "paged")
        self._idle_until: float | None = None  # set when a step found nothing to run
        self.pool = ExecutionPool(self.runner, self.scheduler, self.now, cfg.num_layers * len(LAYER_OPS))
        self._ids = ids if ids is not None else itertools.count()
        self._by_int: dict[int, TrackedRequest] = {}
        self._by_str: dict[str, TrackedRequest] = {}
        self._clock = clock or time.monotonic  # a test may inject a virtual clock
        self._t0 = t0 if t0 is not None else self._clock()
        self.eos = tuple(tokenizer.eos_token_ids)

    @classmethod
    def from_path(cls, path: str | None = None, config: EngineConfig = EngineConfig()) -> "LLMEngine":
        """Load a Hugging Face directory or GGUF file; the embedded SmolLM2 when path is None."""
        from flowyard.engine.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
        from flowyard.engine.loader import load_checkpoint

        ckpt = load_checkpoint(path or embedded_model_path())
        model = CausalLM(ckpt.config, max_positions=min(ckpt.config.max_position_embeddings, 32768))
        model.load_weights(ckpt.weights)
        name = EMBEDDED_MODEL_NAME if path is None else ckpt.name
        return cls(model, ckpt.tokenizer, config, name=name)

    def now(self) -> float:
        return self._clock() - self._t0

    def wake_delay(self) -> float | None:
        """Seconds until `step` has something to run if no request arrives: 0 after a step that
        ran, the scheduler's wake-up time after one that found nothing, None if only an event
        can help. A serving loop sleeps that long on its input queue instead of spinning."""
        if self._idle_until is None:
            return 0.0
        if self._idle_until == float("inf"):
            return None
        return max(0.0, self._idle_until - self.now())

    @property
    def preemption_stats(self) -> PreemptionStats:
        return self.pool.stats

    @property
    def cpu_threads(self) -> int:
        """The threads this engine's steps run on now (threads.py)."""
        return self.threads.current if self.threads is not None else torch.get_num_threads()

    @property
    def boundary_hook(self) -> Callable[[], None] | None:
        """Called at every preemption boundary of a preemptible step: a serving loop hands
        new arrivals to the engine there, so they can preempt the running prefill."""
        return self.pool.boundary_hook

    @boundary_hook.setter
    def boundary_hook(self, hook: Callable[[], None] | None) -> None:
        self.pool.boundary_hook = hook

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    slo: SLO | None = None, arrival: float | None = None, **fields) -> None:
        """arrival: when the request reached the server (time.monotonic()); default now.
        fields: more `Request` fields (task, session, turn, history_len)."""
        self.add_tracked(self.make_request(request_id, prompt_ids, params, slo, arrival, **fields))

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     slo: SLO | None = None, arrival: float | None = None, **fields) -> TrackedRequest:
        """Check a new request and build its record without queueing it (a cluster routes
        the real request first, then queues it on the instance the policy picks)."""
        if request_id in self._by_str:
            raise ValueError(f"duplicate request id {request_id!r}")
        now = self.now()
        arrived = now if arrival is None else min(now, arrival - self._t0)
        req = new_request(next(self._ids), arrived, prompt_ids, params, slo, self.max_model_len, **fields)
        return self.track(request_id, RequestState(req), params)

    def track(self, request_id: str, state: RequestState, params: SamplingParams) -> TrackedRequest:
        """The engine-side record of a request whose state was made elsewhere (a driver)."""
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator().manual_seed(params.seed)
        return TrackedRequest(request_id, state, params, IncrementalDetokenizer(self.tokenizer), gen)

    def add_tracked(self, t: TrackedRequest) -> None:
        """Queue a request built by `make_request` here; ValueError if the scheduler refuses it."""
        if t.request_id in self._by_str:
            raise ValueError(f"duplicate request id {t.request_id!r}")
        now = self.now()
        self._by_int[t.state.id] = t
        self._by_str[t.request_id] = t
        if not self.scheduler.add_request(t.state, now):
            self._forget(t)
            raise ValueError(t.state.reject_reason or "request rejected")
        self._idle_until = None  # new work: the next step decides again
        if self.pool.running is not None and self.scheduler.preempt_check(now):
            self.pool.signal(t.state.req.arrival)  # an arrival during a preemptible prefill (FlowPrefill)

    def abort(self, request_id: str) -> RequestOutput | None:
        t = self._by_str.get(request_id)
        if t is None:
            return None
        self.scheduler.abort(t.state.id)
        self.pool.prune()
        self._forget(t)
        return RequestOutput(request_id, finished=True, finish_reason="abort",
                             prompt_tokens=t.state.req.prompt_len, completion_tokens=t.state.num_output)

    # -- moving requests between engines (the runtimes' migrations) ------------------------
    def tracked(self, request_id: str) -> TrackedRequest | None:
        """The engine-side record of a request (its state, params and stream position)."""
        return self._by_str.get(request_id)

    def holds(self, req_id: int) -> bool:
        """Whether this engine tracks the request (it has not finished, been aborted or left)."""
        return req_id in self._by_int

    def tracked_by_id(self, req_id: int) -> TrackedRequest:
        return self._by_int[req_id]

    def detach(self, req_id: int) -> TrackedRequest:
        """Stop tracking a request whose record moves to another engine (its KV moves
        separately, through the schedulers' hand-off/migration calls)."""
        t = self._by_int.pop(req_id)
        del self._by_str[t.request_id]
        return t

    def attach(self, t: TrackedRequest) -> None:
        """Track a request arriving from another engine, keeping its int id and stream state."""
        self._by_int[t.state.id] = t
        self._by_str[t.request_id] = t
        self._idle_until = None

    def _forget(self, t: TrackedRequest) -> None:
        self._by_int.pop(t.state.id, None)
        self._by_str.pop(t.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._by_int)

    @property
    def wake_time(self) -> float | None:
        """When the scheduler asked to be called again after a step that found nothing to run."""
        t = self._idle_until
        return None if t is None or t == float("inf") else t

    @property
    def idle(self) -> bool:
        """No step to run until an event (or a wake-up time) comes: the last step found none."""
        return not self._by_int or self._idle_until is not None

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        now = self.now()
        plan = self.last_plan = self.scheduler.schedule(now)
        if plan is None:  # nothing runnable: maybe a batching window that closes later
            wake = self.scheduler.wake_at(now)
            self._idle_until = float("inf") if wake is None else wake
            return []
        self._idle_until = None
        if plan.preempt_stride:
            logits, samplers = self.pool.run(plan)
            if logits is None:  # suspended at an operator boundary; resumed by a later step
                return []
        elif self.threads is None:
            logits, samplers = self.runner.execute(plan)
        else:
            self.threads.begin(shape_key(self.instance, plan.num_tokens - len(plan.decodes), len(plan.decodes)))
            try:
                logits, samplers = self.runner.execute(plan)
            finally:
                self.threads.end()
        if self.on_executed is not None:
            self.on_executed(plan)
        if any(s.id not in self._by_int for s in samplers):  # aborted while its task was parked
            rows = [i for i, s in enumerate(samplers) if s.id in self._by_int]
            logits, samplers = logits[rows], [samplers[i] for i in rows]
        tracked = [self._by_int[s.id] for s in samplers]
        banned = [self.eos + t.params.stop_token_ids if t.state.num_output < t.params.min_tokens else ()
                  for t in tracked]  # EOS and stop ids may not end a request before min_tokens
        want = [i for i, t in enumerate(tracked) if t.params.logprobs is not None]
        raw = logits[want].clone() if want else None  # sample() bans tokens in place
        tokens = sample(logits, [t.params for t in tracked], [t.generator for t in tracked], banned)
        if raw is not None:  # some request wants log-probabilities
            ks = [k for i in want if (k := tracked[i].params.logprobs) is not None]  # all of them
            lps = top_logprobs(raw, list(range(len(want))), ks, [tokens[i] for i in want])
            for i, lp in zip(want, lps):
                tracked[i].logprobs.append(lp)
        stopped = set()
        for t, tok in zip(tracked, tokens):
            if self._check_stop(t, tok):
                stopped.add(t.state.id)
        out = StepOutput(end_times=np.array([self.now()]), sampled={t.state.id: [tok] for t, tok in zip(tracked, tokens)},
                         stopped=frozenset(stopped))
        result = self.scheduler.update_from_output(plan, out)
        self.results.append(result)
        if len(self.results) > 64:  # nobody is taking them: keep the recent ones only
            del self.results[:-1]
        finished = {s.id for s in result.finished}
        outputs = []
        for t in tracked:
            done = t.state.id in finished
            outputs.append(self._output(t, done))
            if done:
                self._forget(t)
        return outputs

    def _check_stop(self, t: TrackedRequest, tok: int) -> bool:
        """Stop on EOS (unless ignore_eos), a stop token id, or a stop string in the text."""
        p = t.params
        t.text += t.detok.push(tok)
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            t.finish_reason = "stop"
            return True
        for s in p.stop:
            idx = t.text.find(s, max(0, t.emitted - len(s)))
            if idx != -1:
                t.text = t.text[:idx]
                t.finish_reason = "stop"
                return True
        return False

    def _output(self, t: TrackedRequest, done: bool) -> RequestOutput:
        st = t.state
        if done:
            end = len(t.text)
            reason = t.finish_reason or "length"
        else:
            hold = max((len(s) for s in t.params.stop), default=1) - 1
            end = max(t.emitted, len(t.text) - hold)
            reason = None
        new_ids = st.output_tokens[t.emitted_tokens:]
        t.emitted_tokens = len(st.output_tokens)
        delta = t.text[t.emitted:end]
        t.emitted = end
        lps = t.logprobs[len(t.logprobs) - len(new_ids):] if t.params.logprobs is not None else None
        return RequestOutput(t.request_id, new_token_ids=list(new_ids), new_text=delta, finished=done,
                             finish_reason=reason, prompt_tokens=st.req.prompt_len,
                             completion_tokens=st.num_output, logprobs=lps,
                             phases=self._phases(st) if done else None)

    def _phases(self, st: RequestState) -> dict[str, float] | None:
        """vLLM's request phases on this engine's clock (the request's own times)."""
        sched, first = st.first_scheduled, st.first_token_time
        if sched is None or first is None:
            return None
        end = st.finish_time if st.finish_time is not None else self.now()
        return {"queue": max(0.0, sched - st.req.arrival), "prefill": max(0.0, first - sched),
                "decode": max(0.0, end - first), "inference": max(0.0, end - sched)}

    def warm_up(self) -> None:
        """Run one short request through prefill and decode, so that the first client does not
        pay for one-time work (oneDNN's weight packing, allocator growth); its KV is freed.
        The prompt is longer than the small-GEMV kernel's rows: a prefill of at most that many
        rows never reaches the GEMM path, and the first step that did (any real prompt) paid
        several decode steps' worth of setup, which DynaServe's online profile then learned as
        the instance's speed."""
        prompt = [1 + i % 100 for i in range(4 * GEMV_MAX_ROWS)]
        self.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))

    # -- offline use -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts (token ids) to completion together; one merged output per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{next(self._ids)}-{i}" for i in range(len(prompts))]
        merged = {rid: RequestOutput(rid) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        while any(not merged[r].finished for r in ids):
            for o in self.step():
                m = merged[o.request_id]
                m.new_token_ids += o.new_token_ids
                m.new_text += o.new_text
                if o.logprobs is not None:
                    m.logprobs = (m.logprobs or []) + o.logprobs
                m.finished, m.finish_reason = o.finished, o.finish_reason
                m.prompt_tokens, m.completion_tokens = o.prompt_tokens, o.completion_tokens
        return [merged[r] for r in ids]
