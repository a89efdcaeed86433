"""Greedy outputs judged the way vLLM judges them (its tests' check_logprobs_close): two runs
agree while their tokens are equal; at the first token where they differ, each side's token
must be among the other's top-k log-probabilities, and the comparison stops there (the
sequences have diverged)."""

from __future__ import annotations

import torch


def hf_greedy_logprobs(hf, prompt: list[int], n: int, k: int = 5) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy tokens (EOS ignored) and each step's top-k log-probabilities."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                      return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = []
    for scores in out.scores:
        lp = torch.log_softmax(scores[0].float(), dim=-1)
        top = torch.topk(lp, k)
        lps.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return tokens, lps


def check_greedy_close(ref: tuple[list[int], list[dict[int, float]]],
                       got: tuple[list[int], list[dict[int, float]]], k: int = 5) -> int:
    """Assert the two greedy runs are close; return how many leading tokens are equal."""
    (ref_t, ref_lp), (got_t, got_lp) = ref, got
    assert len(ref_t) == len(got_t), (len(ref_t), len(got_t))
    for i, (a, b) in enumerate(zip(ref_t, got_t)):
        if a == b:
            continue
        ref_top = sorted(ref_lp[i], key=ref_lp[i].get, reverse=True)[:k]
        got_top = sorted(got_lp[i], key=got_lp[i].get, reverse=True)[:k]
        assert b in ref_top, f"token {i}: {b} not in the reference's top-{k} {ref_top}"
        assert a in got_top, f"token {i}: reference token {a} not in the top-{k} {got_top}"
        return i
    return len(ref_t)
